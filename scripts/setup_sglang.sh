#!/usr/bin/env bash
# Create .venv-sglang: released SGLang with its dependencies (it pins torch 2.14.1, a CUDA build that
# also runs on CPU) plus tonpolicy and its trainer dependencies, so `rollout=sglang` runs the SGLang
# server and the trainer under one torch build. SGLang stays out of .venv (the CPU torch).
# Without a GPU it leaves out SGLang's CUDA-only kernel packages (scripts/sglang_cpu_requirements.py
# names them), which its CPU engine never imports: ~3 GB less. Idempotent: a second run only checks.
# About 2-4 minutes and 7 GB on a fresh CPU machine (11 GB with the CUDA kernels).
#   SGLANG_VENV=<dir> to put it elsewhere (then point rollout.python or TONPOLICY_SGLANG_PYTHON at it).
#   SGLANG_CUDA_KERNELS=1 / 0 to install / leave out the CUDA kernels (default: 1 where nvidia-smi runs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${SGLANG_VENV:-.venv-sglang}
# pip's cache would hold a second copy of every downloaded wheel (GBs here): not on a CI machine.
export PIP_NO_CACHE_DIR=1
CUDA_KERNELS=${SGLANG_CUDA_KERNELS:-$(nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)}
NEED_GB=$([ "$CUDA_KERNELS" = 1 ] && echo 13 || echo 9)
if [ ! -x "$VENV/bin/python" ]; then
  FREE_GB=$(df -Pk "$(dirname "$VENV")" | awk 'NR==2 {print int($4 / 1048576)}')
  if [ "$FREE_GB" -lt "$NEED_GB" ]; then
    echo "setup_sglang.sh: $VENV needs about $NEED_GB GB free on $(dirname "$VENV"); $FREE_GB GB are." >&2
    echo "  Free some space or set SGLANG_VENV=<dir on a larger disk>." >&2
    exit 1
  fi
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel packaging
if [ "$CUDA_KERNELS" = 1 ]; then
  "$VENV/bin/python" -m pip install -q "sglang==0.5.23"
else
  "$VENV/bin/python" -m pip install -q --no-deps "sglang==0.5.23"
  "$VENV/bin/python" scripts/sglang_cpu_requirements.py >"$VENV/sglang-cpu-requirements.txt"
  "$VENV/bin/python" -m pip install -q --no-warn-conflicts -r "$VENV/sglang-cpu-requirements.txt"
fi
# the lock: scripts/setup.sh may be installing tonpolicy (its egg-info in this tree) at the same time
flock .editable-install.lock "$VENV/bin/python" -m pip install -q -e ".[test]"
# On a machine without a GPU SGLang runs its CPU engine; the few sgl_kernel CPU ops it calls come from
# tonpolicy/inside_sglang/cpu_standin (PyPI ships sgl_kernel for CUDA only), put on PYTHONPATH by the launch plan.
# The release the model package is tested with (tonpolicy/config/sglang_release.py; keep the pins above
# equal to it), and tonpolicy's SGLang plugin (the contract sampler) visible to SGLang.
"$VENV/bin/python" - <<'PYCHECK'
from importlib.metadata import entry_points
import sglang, torch
from tonpolicy.config.sglang_release import require_sglang_release
require_sglang_release()
assert "tonpolicy_contract_sampler" in {e.name for e in entry_points(group="sglang.srt.plugins")}
print(f"tonpolicy SGLang environment ready: sglang {sglang.__version__}, torch {torch.__version__}")
PYCHECK
