#!/usr/bin/env bash
# GRPO on one CPU machine with a tiny random Qwen2 model and arithmetic prompts: the whole system
# (Redis, reward worker, vLLM rollout, Megatron actor and reference, coordinator) in about two minutes.
# Usage: bash examples/grpo/grpo_trainer_tiny_cpu.sh [WORK_DIR] [extra `rlfabric up` flags...]
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${1:-runs/tiny_cpu}
shift || true
bash examples/grpo/tiny_assets.sh "$WORK"
exec .venv/bin/rlfabric up configs/grpo_tiny_cpu.yaml \
  -o megatron_training.tokenizer_name_or_path="$WORK/tiny_model" \
  -o megatron_training.data_path="$WORK/dataset/arith" \
  -o actor_config.load="$WORK/tiny_model" \
  -o actor_config.save="$WORK/ckpt" \
  --run-dir "$WORK/run" "$@"
