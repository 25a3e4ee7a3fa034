#!/usr/bin/env bash
# `make demo`: GRPO that visibly learns, on one CPU machine (2 cores), in under ten minutes.
# The task is "A+B=" -> the sum, A and B in 0..99 (the W2 learning race of the design notes): a tiny Qwen2 with
# a digit-split tokenizer is warmed up to about 50% greedy accuracy by supervised fine-tuning, then GRPO runs
# through `rlfabric up` (every service a process, talking gRPC) with a custom reward rule, validating on 500
# held-out problems; the final model is sampled independently; charts and a summary close it.
# Usage: bash examples/grpo/grpo_demo_cpu.sh [WORK_DIR] [extra `rlfabric up` flags...]
# A WORK_DIR that already holds the warm-up keeps it (delete the folder to start from scratch).
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${1:-runs/demo}
shift || true
RLF=".venv/bin/rlfabric"
PY=".venv/bin/python"
VERIFIER="leading_number=$PY examples/grpo/leading_number_verifier.py --port {port}"
start=$(date +%s)
step() { printf '\n== [%3d s] %s\n' "$(( $(date +%s) - start ))" "$*"; }

step "1/7 a tiny Qwen2 (hidden 128, 2 layers, random) with a digit-split byte-level BPE of 512 entries"
[ -f "$WORK/base_model/config.json" ] || "$RLF" tiny-model "$WORK/base_model" --vocab-size 512 --digits single >/dev/null
echo "$WORK/base_model"

step "2/7 the task: every A+B= with A, B in 0..99; 500 held out, 9,500 to train on"
"$PY" -c "from services.data.synthetic import write_addition_task as w; w('$WORK/task', held_out=500)"
for split in train heldout; do
  [ -f "$WORK/dataset/${split}_packed_input_ids_document.idx" ] || "$RLF" preprocess configs/datasets/deepscaler.yaml \
    --set input="$WORK/task/$split.jsonl" --set tokenizer_name_or_path="$WORK/base_model" \
    --set output_prefix="$WORK/dataset/$split" --set prompt_type=empty --set workers=1 --quiet >/dev/null
done
echo "$WORK/dataset/{train,heldout}"

step "3/7 supervised warm-up (rlfabric sft): until 45% of a training slice is answered greedily"
[ -f "$WORK/sft_model/sft_summary.json" ] || "$RLF" sft "$WORK/base_model" "$WORK/task/train.jsonl" \
  "$WORK/sft_model" --held-out "$WORK/task/heldout.jsonl" --recipe addition --quiet

step "4/7 GRPO (rlfabric up configs/grpo_demo_cpu.yaml): validation on the held-out set before, every 100 iterations, at the end"
rm -rf "$WORK/run" "$WORK/ckpt" "$WORK/final_model" "$WORK/eval_final"
"$RLF" up configs/grpo_demo_cpu.yaml \
  -o megatron_training.tokenizer_name_or_path="$WORK/sft_model" \
  -o megatron_training.data_path="$WORK/dataset/train" \
  -o rlfabric.val_data_path="$WORK/dataset/heldout" \
  -o actor_config.load="$WORK/sft_model" \
  -o actor_config.save="$WORK/ckpt" \
  --run-dir "$WORK/run" --verifier-command "$VERIFIER" "$@"

step "5/7 the final model sampled independently: 8 samples per held-out problem, temperature 1, fresh seeds"
"$RLF" convert mcore2hf "$WORK/ckpt" "$WORK/final_model" --quiet >/dev/null
"$RLF" eval --model "$WORK/final_model" --dataset "$WORK/task/heldout.jsonl" --template empty --max-tokens 8 \
  -n 8 --temperature 1 --verifier-function leading_number --verifier-command "$VERIFIER" --out "$WORK/eval_final" \
  | grep -v '^eval: '

step "6/7 charts (rlfabric plot)"
"$RLF" plot "$WORK/run"

step "7/7 what GRPO did"
"$PY" examples/grpo/demo_report.py "$WORK" --seconds "$(( $(date +%s) - start ))"
