#!/usr/bin/env bash
# `make setup PLATFORM=cuda|ascend`: create .venv with that platform's locked stack
# (requirements/constraints-<platform>.txt, whose header says what it was checked for). CPU: setup_cpu.sh.
# Idempotent like setup_cpu.sh: nothing happens while pyproject.toml and the lock are unchanged and the stack imports.
set -euo pipefail
cd "$(dirname "$0")/../.."

PLATFORM=${1:?usage: setup_accel.sh cuda|ascend}
case "$PLATFORM" in cuda|ascend) ;; *) echo "setup: PLATFORM must be cpu, cuda or ascend, not '$PLATFORM'" >&2; exit 2 ;; esac
PY=${PYTHON:-python3.11}
VENV=.venv
CONSTRAINTS=requirements/constraints-$PLATFORM.txt
STAMP=$VENV/.setup-stamp
want=$(cat pyproject.toml setup.py services/common/_wordcopy.c "$CONSTRAINTS" deploy/local/setup_accel.sh \
       | sha256sum | cut -d' ' -f1)-$PLATFORM
imports="import vllm, megatron.core, grpc, redis, mathruler, math_verify"
[ "$PLATFORM" = ascend ] && imports="$imports, torch_npu, vllm_ascend"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && "$VENV/bin/python" -c "$imports" 2>/dev/null; then
  echo "setup: .venv is up to date ($PLATFORM)"
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/pip" install --disable-pip-version-check -c "$CONSTRAINTS")
if [ "$PLATFORM" = cuda ]; then
  "${pip[@]}" -e ".[cuda,dev]"
else
  # triton-ascend comes from Ascend's index; vLLM is built with no device target (the lock's header says why).
  "${pip[@]}" --extra-index-url https://mirrors.huaweicloud.com/ascend/repos/pypi -e ".[ascend,dev]"
  VLLM_TARGET_DEVICE=empty "${pip[@]}" --no-binary vllm "vllm==$(sed -n 's/^vllm==\([^ ]*\).*/\1/p' "$CONSTRAINTS")"
fi
"$VENV/bin/python" -W ignore -c "$imports" || { echo "setup: the installed $PLATFORM stack does not import" >&2; exit 1; }
echo "$want" > "$STAMP"
echo "setup: installed the $PLATFORM stack into $VENV"
