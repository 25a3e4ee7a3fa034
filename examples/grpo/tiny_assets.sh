#!/usr/bin/env bash
# The files configs/grpo_tiny_cpu.yaml names, made once (a second call finds them and returns at once):
#   WORK/tiny_model          a seeded random tiny Qwen2 with its tokenizer (`rlfabric tiny-model`)
#   WORK/dataset/arith_*     512 synthetic "What is A + B?" prompts, preprocessed as MindSpeed-RL data
# `make up` with the default config and examples/grpo/grpo_trainer_tiny_cpu.sh call it.
# Usage: bash examples/grpo/tiny_assets.sh [WORK_DIR, default runs/tiny_cpu]
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${1:-runs/tiny_cpu}
RLF=".venv/bin/rlfabric"
if [ ! -f "$WORK/tiny_model/config.json" ]; then
  rm -rf "$WORK/tiny_model.tmp"
  "$RLF" tiny-model "$WORK/tiny_model.tmp" >/dev/null
  mv "$WORK/tiny_model.tmp" "$WORK/tiny_model"
  echo "made $WORK/tiny_model"
fi
if [ ! -f "$WORK/dataset/arith_packed_input_ids_document.idx" ]; then
  .venv/bin/python -c "from services.data.synthetic import write_arithmetic_jsonl as w; w('$WORK/arith.jsonl', 512)"
  "$RLF" preprocess configs/datasets/deepscaler.yaml --set input="$WORK/arith.jsonl" \
    --set tokenizer_name_or_path="$WORK/tiny_model" --set output_prefix="$WORK/dataset/arith" \
    --set prompt_type=empty --set workers=1 --quiet
  echo "made $WORK/dataset/arith"
fi
