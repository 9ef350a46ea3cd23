#!/usr/bin/env bash
# Wheels for a GPU machine that has Python 3.12 and torch but not megatron-core or DeepSpeed
# and cannot reach a package registry (e.g. torch 2.11 with CUDA 13). Run it on a machine
# with registry access, in the repository root; it writes .whl/ (keep it out of git, e.g.
# in .git/info/exclude). docs/gpu.md has the command that installs them on the GPU node and
# runs tests/gpu/accept.py.
#
#   bash tests/gpu/prepare_wheels.sh            # PYTHON: VENV's python by default
#
# What goes in, and why each:
# - megatron-core 0.16.1: its cp312 manylinux wheel (it ships a compiled dataset helper);
# - DeepSpeed 0.19.8: PyPI has only a source distribution, so it is built here into a wheel
#   with no ops compiled (DS_BUILD_OPS unset): the package is pure Python and JIT-builds an
#   op only when asked for one; training asks for none (torch's fused AdamW on GPU, see
#   cqk_megatron/training/engine.py make_optimizer). --no-build-isolation: its setup.py
#   imports torch, the one installed here;
# - DeepSpeed's requirements the GPU image lacks: hjson, pydantic (+ pydantic-core,
#   annotated-types, typing-inspection, and the typing-extensions they need);
# - packaging, at the version megatron-core asks for (>= 24.2).
# The image already has numpy, ninja, psutil, py-cpuinfo, msgpack, einops, tqdm, pyyaml,
# sentencepiece, safetensors, tokenizers and transformers (README.md beside the device tool).
set -euo pipefail
source "$(dirname "$0")/../../scripts/venv.sh"  # VENV: which environment (default .venv)
cd "$REPO"
PYTHON=${PYTHON:-$PY}
WHEELS=.whl
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qxF "/$WHEELS/" "$exclude" 2>/dev/null || echo "/$WHEELS/" >>"$exclude"
rm -rf "$WHEELS"
mkdir -p "$WHEELS"

# Exact versions: those of constraints.txt and of the CPU venv they were tested with.
BINARY=(
  megatron-core==0.16.1
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  hjson==3.1.0
  packaging==26.4
)
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$WHEELS" "${BINARY[@]}"
"$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation -w "$WHEELS" deepspeed==0.19.8

# one version of each (two stop the install there), and nothing built for this CPU's Python
count=$(ls "$WHEELS"/*.whl | wc -l)
expected=$((${#BINARY[@]} + 1))
if [ "$count" -ne "$expected" ]; then
  echo "expected $expected wheels in $WHEELS, found $count:" >&2
  ls "$WHEELS" >&2
  exit 1
fi
if ls "$WHEELS" | grep -E -- '-cp3(8|9|10|11|13)-' >/dev/null; then
  echo "a wheel for another Python than 3.12 is in $WHEELS:" >&2
  ls "$WHEELS" >&2
  exit 1
fi
du -sh "$WHEELS"
ls -1 "$WHEELS"
