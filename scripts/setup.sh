#!/usr/bin/env bash
# Create .venv with the pinned CPU torch first (a plain `torch` would pull a multi-GB CUDA build),
# then tonpolicy and its test tools. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q "torch==2.13.0"
# data: Parquet prompts and the math_answer reward. fleet: sglang-router 0.3.2 (rollout.replicas > 1),
# pinned: its command-line flags are in the launch plan. fp8: transformers' loading of FP8 checkpoints.
# the lock: scripts/setup_sglang.sh may be installing tonpolicy (its egg-info in this tree) at the same time
flock .editable-install.lock .venv/bin/python -m pip install -q -e ".[test,slurm,fleet,data,fp8]"
# The `triton` kernel set's tests run in Triton's interpreter here (no GPU). Triton 3.6.0 is the
# version the lent H200 image has (torch 2.11); its interpreter needs NumPy < 2.4 (it converts
# 1-element arrays to ints, which NumPy 2.4 refuses).
.venv/bin/python -m pip install -q "triton==3.6.0" "numpy<2.4"
# Released SGLang's argument parser, for the test that checks every rendered flag. --no-deps: its
# dependencies pin a CUDA torch; these light ones are all `sglang.srt.server_args` needs.
.venv/bin/python -m pip install -q --no-deps --no-warn-conflicts "sglang==0.5.23"
.venv/bin/python -m pip install -q --no-warn-conflicts orjson psutil pybase64 pillow starlette msgspec pyzmq IPython aiohttp
# Contract v2's compiled kernels (tonpolicy/kernels/invariant/ordered_gemm.cpp, ordered_rowwise.cpp), built once per instruction-set
# path into ~/.cache/tonpolicy/kernels (TONPOLICY_KERNEL_CACHE); a job also builds them on first use. On a
# machine without a C++ compiler v2 cannot run: say so, and that contract v1 still runs.
if ! { .venv/bin/python -m tonpolicy.kernels.invariant.ordered_gemm --build && .venv/bin/python -m tonpolicy.kernels.invariant.ordered_rowwise --build; }; then
  echo "WARNING: contract v2's kernels could not be built (see above); install g++ (or set CXX), or run" \
    "contract v1: python -m tonpolicy contract=qwen3_dense_v1" >&2
fi
echo "tonpolicy environment ready in .venv"
