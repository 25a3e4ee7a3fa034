#!/usr/bin/env bash
# MindSpeed-RL's examples/ckpt/ckpt_convert_qwen25_mcore2hf.sh with its flags, run by rlfabric's converter
# (cli/convert_ckpt.py maps them to `rlfabric convert mcore2hf`). As upstream, --save-dir is the original
# Hugging Face folder and the trained weights go to its mg2hf/ folder (with its config and tokenizer files):
# here ./ckpt (configs/grpo_qwen25_7b_A3.yaml's save, its latest iteration) -> ./Qwen2.5-7B/mg2hf. Later flags
# win, e.g. `--iteration 100` or `--save-dir ./Qwen2.5-7B-grpo` (a folder without config.json is written whole).
# Run from anywhere: relative paths resolve from the repository root, as upstream runs it.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]]; then source /usr/local/Ascend/ascend-toolkit/set_env.sh; fi
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi

exec "$python" cli/convert_ckpt.py \
    --use-mcore-models \
    --model-type GPT \
    --model-type-hf llama2 \
    --load-model-type mg \
    --save-model-type hf \
    --target-tensor-parallel-size 2 \
    --target-pipeline-parallel-size 2 \
    --add-qkv-bias \
    --load-dir ./ckpt \
    --save-dir ./Qwen2.5-7B \
    "$@"
