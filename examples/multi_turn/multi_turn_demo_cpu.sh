#!/usr/bin/env bash
# `make demo-multi-turn`: GRPO with a tool, on one CPU machine (2 cores). The task is "What is A*B?" (A, B in
# 317..999), which a tiny Qwen2 cannot multiply but can solve by calling the code interpreter: a supervised warm-up
# (examples/multi_turn/tool_task.py) teaches the call and copying the numbers, then a mix with direct answers,
# then GRPO runs through `rlfabric up configs/grpo_multi_turn_demo_cpu.yaml`, which starts, besides Redis, a reward
# worker, a vLLM replica, Megatron actor and reference trainers and the coordinator, the code sandbox
# (`rlfabric sandbox serve`, bubblewrap) and a tool server (`rlfabric tools serve`). Reward (retool_reward), tool
# calls per sample and tool success rate rise; a report and charts close it.
# Usage: bash examples/multi_turn/multi_turn_demo_cpu.sh [WORK_DIR] [extra `rlfabric up` flags...]
# A WORK_DIR that already holds the warm-up keeps it (delete the folder to start from scratch).
set -euo pipefail
cd "$(dirname "$0")/../.."
WORK=${1:-runs/multi_turn_demo}
shift || true
RLF=".venv/bin/rlfabric"
PY=".venv/bin/python"
start=$(date +%s)
step() { printf '\n== [%3d s] %s\n' "$(( $(date +%s) - start ))" "$*"; }

step "1/4 a tiny Qwen2 (digit tokenizer), the task (qwen chat template), the warm-up (call, copy, then a mix)"
"$PY" examples/multi_turn/tool_task.py "$WORK"

step "2/4 GRPO with the code interpreter (rlfabric up configs/grpo_multi_turn_demo_cpu.yaml)"
rm -rf "$WORK/run" "$WORK/ckpt"
"$RLF" up configs/grpo_multi_turn_demo_cpu.yaml \
  -o megatron_training.tokenizer_name_or_path="$WORK/sft_model" \
  -o megatron_training.data_path="$WORK/dataset/train" \
  -o actor_config.load="$WORK/sft_model" \
  -o actor_config.save="$WORK/ckpt" \
  --run-dir "$WORK/run" "$@"

step "3/4 charts (rlfabric plot)"
"$RLF" plot "$WORK/run"

step "4/4 what GRPO did"
"$PY" examples/multi_turn/report.py "$WORK" --seconds "$(( $(date +%s) - start ))"
