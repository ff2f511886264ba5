#!/usr/bin/env bash
# Build (or reuse) a virtual environment with torch 2.9.0 + torch-xla 2.9.0 from PyPI,
# install autopart into it, and run the XLA tests there on the XLA:CPU device.
#
#   scripts/xla_env.sh [VENV_DIR] [-- PYTEST_ARGS...]
#
# VENV_DIR defaults to $AUTOPART_XLA_VENV, else .xla-venv in the repository root.
# The venv is reused when it already holds torch 2.9.0 and torch-xla 2.9.0; pip then
# only checks the other requirements. Every pip call goes through
# scripts/xla-constraints.txt, so nothing can upgrade torch past the pair torch-xla was
# built for. PJRT_DEVICE defaults to CPU (XLA:CPU); on trn1/trn2 set PJRT_DEVICE=NEURON
# and use the Neuron SDK's torch-neuronx instead of this venv (docs/neuroncore.md).
# PYTHON picks the interpreter used to create the venv (default python3; torch-xla
# 2.9.0 has wheels for CPython 3.10-3.13 on x86_64 Linux).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${AUTOPART_XLA_VENV:-$repo/.xla-venv}"
if [[ $# -gt 0 && "$1" != "--" ]]; then
    venv="$1"
    shift
fi
[[ "${1:-}" == "--" ]] && shift
pytest_args=("$@")
[[ ${#pytest_args[@]} -eq 0 ]] && pytest_args=(-q tests/test_xla.py)
constraints="$repo/scripts/xla-constraints.txt"
python="${PYTHON:-python3}"
start=$SECONDS

log() { echo "[xla_env] $*"; }

if [[ ! -x "$venv/bin/python" ]]; then
    log "creating $venv with $("$python" --version 2>&1)"
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --quiet --constraint "$constraints")

have_pair=$("$venv/bin/python" - <<'PY' 2>/dev/null || echo no
from importlib.metadata import version
print("yes" if (version("torch"), version("torch-xla")) == ("2.9.0", "2.9.0") else "no")
PY
)
if [[ "$have_pair" == yes ]]; then
    log "reusing torch 2.9.0 + torch-xla 2.9.0 in $venv"
else
    log "installing torch==2.9.0 and torch-xla==2.9.0 (torch pulls the CUDA wheels, ~7 GB)"
    "${pip[@]}" torch==2.9.0 torch-xla==2.9.0
fi

log "installing autopart (editable) and its test requirements"
"${pip[@]}" --editable "$repo" pytest pytest-timeout hypothesis

"$venv/bin/python" - <<'PY'
import torch, torch_xla, transformers
assert torch.__version__.split("+")[0] == "2.9.0", f"torch moved to {torch.__version__}"
print(f"[xla_env] torch {torch.__version__}, torch_xla {torch_xla.__version__}, "
      f"transformers {transformers.__version__}")
PY
log "environment ready in $((SECONDS - start)) s"

export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"
log "running pytest ${pytest_args[*]} with PJRT_DEVICE=$PJRT_DEVICE"
cd "$repo"
"$venv/bin/python" -m pytest "${pytest_args[@]}"
log "done in $((SECONDS - start)) s"
