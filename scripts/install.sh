#!/usr/bin/env bash
# Create the environment and install everything, from nothing. Used by the README's
# commands and CI.
#   bash scripts/install.sh                 # into ./.venv
#   VENV=/opt/cqk bash scripts/install.sh   # elsewhere (scripts/venv.sh: the same VENV
#                                           # then chooses it for demo.sh and .ci/run)
set -euo pipefail
source "$(dirname "$0")/venv.sh"
cd "$REPO"
PYTHON=${PYTHON:-python3}

if [ ! -x "$PY" ]; then
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$PY" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install --upgrade pip setuptools wheel
# torch first and explicitly: a plain "torch" would pull a multi-GB CUDA build.
"${PIP[@]}" install "torch==2.13.0"
"${PIP[@]}" install -c constraints.txt "megatron-core==0.16.1"
# DeepSpeed builds against the installed torch: no build isolation.
"${PIP[@]}" install -c constraints.txt --no-build-isolation deepspeed
"${PIP[@]}" install -c constraints.txt -e ".[dev,logging,hf,eval,analysis]"
"$PY" -c "import torch, megatron.core, deepspeed, cqk_megatron; print('installed in $VENV: torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| deepspeed', deepspeed.__version__)"
