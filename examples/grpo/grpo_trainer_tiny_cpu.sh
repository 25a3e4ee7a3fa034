#!/usr/bin/env bash
# GRPO on one CPU machine with a tiny random Qwen2 model and arithmetic prompts: the whole system
# (Redis, reward worker, vLLM rollout, Megatron actor and reference, coordinator) in about two minutes.
# Usage: bash examples/grpo/grpo_trainer_tiny_cpu.sh [WORK_DIR] [extra `rlfabric up` flags...]
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${1:-runs/tiny_cpu}
shift || true
RLF=".venv/bin/rlfabric"
[ -f "$WORK/tiny_model/config.json" ] || "$RLF" tiny-model "$WORK/tiny_model" >/dev/null
if [ ! -f "$WORK/dataset/arith_packed_input_ids_document.idx" ]; then
  .venv/bin/python -c "from services.data.synthetic import write_arithmetic_jsonl as w; w('$WORK/arith.jsonl', 512)"
  "$RLF" preprocess configs/datasets/deepscaler.yaml --set input="$WORK/arith.jsonl" \
    --set tokenizer_name_or_path="$WORK/tiny_model" --set output_prefix="$WORK/dataset/arith" \
    --set prompt_type=empty --set workers=1 --quiet
fi
exec "$RLF" up configs/grpo_tiny_cpu.yaml \
  -o megatron_training.tokenizer_name_or_path="$WORK/tiny_model" \
  -o megatron_training.data_path="$WORK/dataset/arith" \
  -o actor_config.load="$WORK/tiny_model" \
  -o actor_config.save="$WORK/ckpt" \
  --run-dir "$WORK/run" "$@"
