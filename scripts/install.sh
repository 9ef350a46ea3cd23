#!/usr/bin/env bash
# Create .venv and install everything, from nothing. Used by the README's commands and CI.
#   bash scripts/install.sh            # into ./.venv (or $VENV)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip setuptools wheel
# torch first and explicitly: a plain "torch" would pull a multi-GB CUDA build.
"${PIP[@]}" install "torch==2.13.0"
"${PIP[@]}" install -c constraints.txt "megatron-core==0.16.1"
# DeepSpeed builds against the installed torch: no build isolation.
"${PIP[@]}" install -c constraints.txt --no-build-isolation deepspeed
"${PIP[@]}" install -c constraints.txt -e ".[dev,logging,hf,eval,analysis]"
"$VENV/bin/python" -c "import torch, megatron.core, deepspeed, cqk_megatron; print('installed: torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| deepspeed', deepspeed.__version__)"
