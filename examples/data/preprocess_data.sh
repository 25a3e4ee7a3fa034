#!/usr/bin/env bash
# MindSpeed-RL's entry point: `bash examples/data/preprocess_data.sh NAME [--set KEY=VALUE ...]`
# preprocesses with configs/datasets/NAME.yaml. Run it from the repository root: the YAML's relative
# paths (./dataset/..., ./model_from_hf/...) resolve from there, as upstream.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -* ]]; then
  echo "usage: bash examples/data/preprocess_data.sh NAME [--set KEY=VALUE ...]" >&2
  echo "  NAME: a file configs/datasets/NAME.yaml, e.g. deepscaler or math_17k" >&2
  exit 2
fi
name="$1"
shift
config="configs/datasets/${name}.yaml"
if [[ ! -f "$config" ]]; then
  echo "preprocess_data.sh: no dataset config $config (run from the repository root; available:" \
       "$(ls configs/datasets 2>/dev/null | sed -n 's/\.yaml$//p' | tr '\n' ' '))" >&2
  exit 2
fi

# Prefer the project's virtual environment when there is one.
python="${PYTHON:-}"
if [[ -z "$python" ]]; then
  if [[ -x .venv/bin/python ]]; then python=.venv/bin/python; else python=python3; fi
fi
exec "$python" -m services.data.cli "$config" "$@"
