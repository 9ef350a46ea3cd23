# Sourced (not run) by scripts/install.sh, scripts/demo.sh and .ci/run: the one place that
# says which Python environment they use.
#   VENV   the environment's folder (default: .venv in the repository); a relative path
#          is taken from the directory the command was started in.
# Sets and exports REPO (the repository root) and VENV (absolute), and sets PY (its
# python). Source it before any cd, so that a relative VENV means what the caller meant.
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=$(realpath -m -s "${VENV:-$REPO/.venv}")
PY="$VENV/bin/python"
export REPO VENV

# Stop with the fix when the environment is not there (after an install it always is).
require_python() {
  if [ ! -x "$PY" ]; then
    echo "error: no Python environment at $VENV (VENV); install it with" \
      "'VENV=$VENV bash scripts/install.sh', or set VENV to an installed one" >&2
    exit 1
  fi
}
