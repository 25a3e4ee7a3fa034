#!/usr/bin/env bash
# MindSpeed-RL's examples/ckpt/ckpt_convert_qwen25_hf2mcore.sh with its flags, run by rlfabric's converter
# (cli/convert_ckpt.py maps them to `rlfabric convert hf2mcore`). The paths and sizes are those of
# configs/grpo_qwen25_7b_A3.yaml: the Hugging Face model in ./Qwen2.5-7B (its tokenizer_name_or_path), the
# checkpoint in ./ckpt (its actor_config.load) at TP 2 x PP 2. Later flags win, e.g.
#   bash examples/ckpt/ckpt_convert_qwen25_hf2mcore.sh --target-tensor-parallel-size 4 --save-dir ./ckpt-tp4
# Run from anywhere: relative paths resolve from the repository root, as upstream runs it.
set -euo pipefail
cd "$(dirname "$0")/../.."
# Ascend: CANN's environment, where it is installed (upstream sources it unconditionally).
if [[ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]]; then source /usr/local/Ascend/ascend-toolkit/set_env.sh; fi
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi

exec "$python" cli/convert_ckpt.py \
       --use-mcore-models \
       --model-type GPT \
       --load-model-type hf \
       --save-model-type mg \
       --target-tensor-parallel-size 2 \
       --target-pipeline-parallel-size 2 \
       --add-qkv-bias \
       --load-dir ./Qwen2.5-7B \
       --save-dir ./ckpt \
       --tokenizer-model ./Qwen2.5-7B/tokenizer.json \
       --model-type-hf llama2 \
       --params-dtype bf16 \
       "$@"
