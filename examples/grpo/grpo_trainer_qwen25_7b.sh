#!/usr/bin/env bash
# The seed's launch step, `bash examples/grpo/grpo_trainer_qwen25_7b.sh [CONFIG_NAME] [ARGS...]`: GRPO with
# configs/CONFIG_NAME.yaml (default grpo_qwen25_7b_A3, the upstream file unchanged) on this host, through
# upstream's entry point `python cli/train_grpo.py --config-name CONFIG_NAME` (cli/train_grpo.py: `rlfabric up`).
# ARGS are `section.key=value` overrides (Hydra's form, or `-o section.key=value`) and `rlfabric up` flags.
# Before it (docs/quickstart.md): `bash examples/data/preprocess_data.sh deepscaler` (./dataset/deepscaler/data)
# and `bash examples/ckpt/ckpt_convert_qwen25_hf2mcore.sh` (./Qwen2.5-7B -> ./ckpt at TP 2 x PP 2); `rlfabric up`
# names whatever is missing before it starts anything. The 7B run needs accelerators (`make setup
# PLATFORM=cuda|ascend`). Upstream's NNODES / MASTER_ADDR / CURRENT_IP / SOCKET_IFNAME start a Ray cluster; rlfabric
# runs one host here, and a cluster's services are started under deploy/ (docs/deploy.md) instead.
set -euo pipefail
cd "$(dirname "$0")/../.."
YAML=grpo_qwen25_7b_A3
if [[ $# -gt 0 && "$1" != -* && "$1" != *=* ]]; then
  YAML="$1"
  shift
fi
# The seed's step 1: jemalloc against host-memory growth on long runs, where it is installed (the images link it
# here); set LD_PRELOAD yourself to use another.
JEMALLOC=/usr/local/lib/libjemalloc.so.2
if [[ -z "${LD_PRELOAD:-}" && -f "$JEMALLOC" ]]; then export LD_PRELOAD="$JEMALLOC"; fi
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
echo "Use $YAML"
exec "$python" cli/train_grpo.py --config-name "$YAML" "$@"
