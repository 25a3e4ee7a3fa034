#!/usr/bin/env bash
# MindSpeed-RL's entry point: `bash examples/data/preprocess_data.sh NAME [--set KEY=VALUE ...]`
# preprocesses with configs/datasets/NAME.yaml. As upstream, the YAML's relative paths (./dataset/...,
# ./model_from_hf/...) resolve from the repository root, wherever the script is started from.
#
# Where it writes: upstream's dataset YAMLs all say `output_prefix: ./dataset/data`, while the run configs read
# a folder per data set (configs/grpo_qwen25_7b_A3.yaml: `data_path: ./dataset/deepscaler/data`), so upstream's
# quick start breaks between these two steps. This script puts NAME's files in a folder of that name:
# `output_prefix: ./dataset/data` becomes ./dataset/NAME/data (./dataset/deepscaler/data_packed_*), what the run
# configs name; `--set output_prefix=PREFIX` writes exactly at PREFIX.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: bash examples/data/preprocess_data.sh NAME [--set KEY=VALUE ...]" >&2
  echo "  NAME: a file configs/datasets/NAME.yaml, e.g. deepscaler or math_17k" >&2
  exit 2
fi
name="$1"
shift
cd "$(dirname "$0")/../.."
config="configs/datasets/${name}.yaml"
if [[ ! -f "$config" ]]; then
  echo "preprocess_data.sh: no dataset config $config (available:" \
       "$(ls configs/datasets 2>/dev/null | sed -n 's/\.yaml$//p' | tr '\n' ' '))" >&2
  exit 2
fi

# Prefer the project's virtual environment when there is one.
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi

# The YAML's output_prefix DIR/BASE becomes DIR/NAME/BASE; a later `--set output_prefix=...` (the caller's) wins.
prefix=$("$python" -c 'import sys, yaml; print((yaml.safe_load(open(sys.argv[1])) or {}).get("output_prefix") or "")' \
         "$config")
placed=()
if [[ -n "$prefix" ]]; then
  placed=(--set "output_prefix=$(dirname "$prefix")/${name}/$(basename "$prefix")")
fi
exec "$python" -m services.data.cli "$config" "${placed[@]}" "$@"
