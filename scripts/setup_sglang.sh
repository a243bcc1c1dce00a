#!/usr/bin/env bash
# Create .venv-sglang: released SGLang with all its dependencies (it pins torch 2.14.1, a CUDA build
# that also runs on CPU) plus tonpolicy and its trainer dependencies, so `rollout=sglang` runs the
# SGLang server and the trainer under one torch build. SGLang stays out of .venv (the CPU torch).
# Idempotent: a second run only checks. About 4 minutes and 11 GB on a fresh machine.
#   SGLANG_VENV=<dir> to put it elsewhere (then point rollout.python or TONPOLICY_SGLANG_PYTHON at it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${SGLANG_VENV:-.venv-sglang}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip setuptools wheel
"$VENV/bin/python" -m pip install -q "sglang==0.5.23"
"$VENV/bin/python" -m pip install -q -e ".[test]"
# On a machine without a GPU SGLang runs its CPU engine; the few sgl_kernel CPU ops it calls come from
# tonpolicy/rollout/sglang_cpu (PyPI ships sgl_kernel for CUDA only), put on PYTHONPATH by the launch plan.
"$VENV/bin/python" - <<'PYCHECK'
import sglang, torch
print(f"tonpolicy SGLang environment ready: sglang {sglang.__version__}, torch {torch.__version__}")
PYCHECK
