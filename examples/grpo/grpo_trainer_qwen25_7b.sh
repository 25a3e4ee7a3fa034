#!/usr/bin/env bash
# The seed's Qwen2.5-7B GRPO run (configs/grpo_qwen25_7b_A3.yaml, unchanged) on one node.
# Before: preprocess the data (bash examples/data/preprocess_data.sh deepscaler) and convert the HF weights
# (rlfabric convert hf2mcore --tp 2 --pp 2 ./Qwen2.5-7B ./ckpt). Needs accelerators: the CUDA/Ascend extras
# (`pip install -e .[cuda]` or `.[ascend]`). On a cluster, start the services under deploy/ instead.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec .venv/bin/rlfabric up configs/grpo_qwen25_7b_A3.yaml "$@"
