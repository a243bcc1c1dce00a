#!/usr/bin/env bash
# One command for a session with a GPU (one H200, well under 10 minutes):
#   device run: command="bash experiments/gpu_check.sh", carry=[".whl"], timeout_s=600
# The GPU image lacks megatron-core and hydra-core/omegaconf (tonpolicy.config imports hydra's
# ConfigStore). Prepare the wheels once, here, in the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl megatron-core==0.16.1 hydra-core==1.3.2 omegaconf==2.3.0 \
#     antlr4-python3-runtime==4.9.3 PyYAML
# (if megatron-core has no cp312 manylinux wheel for that platform tag, add the --platform tags that
# ../.library/device/README.md lists); antlr4-python3-runtime 4.9.3 has no wheel: build one with
# `.venv/bin/pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3`. Results: $OUT/gpu_check.json,
# $OUT/gpu_triton.json and their logs; experiments/results/ keeps the ones recorded so far.
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
dest="${OUT:-/tmp/gpu_check}"
mkdir -p "$dest"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$dest/gpu_check.log"
timeout 540 python3 -m torch.distributed.run --standalone --nproc-per-node 1 experiments/gpu_check.py \
  --out "$dest/gpu_check.json" 2>&1 | tee -a "$dest/gpu_check.log"
# The triton kernel set (issue 14): invariances of the compiled kernels, both engines bit for bit, timings.
timeout 420 python3 -m torch.distributed.run --standalone --nproc-per-node 1 experiments/gpu_triton_check.py \
  --out "$dest/gpu_triton.json" 2>&1 | grep -v "Unknown MLP\|warn" | tee "$dest/gpu_triton.log"
# The embedded engine's decode in CUDA graphs (issue 35, item 2): per batch-size bucket, graph replay ==
# eager == the Megatron trainer's full forward (bf16, fp32), plain control, capture time, tokens/s on/off.
timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node 1 experiments/gpu_graph_check.py \
  --out "$dest/gpu_graph.json" 2>&1 | grep -v "Unknown MLP\|warn" | tee "$dest/gpu_graph.log"
if python3 -c "import pytest" >/dev/null 2>&1; then
  timeout 180 python3 -m pytest -q -p no:cacheprovider tests/engine/test_decode_graphs_gpu.py 2>&1 | tail -4 \
    | tee -a "$dest/gpu_graph.log"
fi
# One job end to end on the triton contract, decode in CUDA graphs: the gate must pass every step (exit 0).
timeout 240 python3 -m tonpolicy contract=qwen3_dense_triton_v1 trainer.device=cuda rollout.cuda_graphs=true \
  logger=none experiment.steps=3 hydra.run.dir="$dest/run_triton_cuda" 2>&1 | tail -6 | tee -a "$dest/gpu_check.log"
echo "triton job with cuda graphs: exit ${PIPESTATUS[0]}" | tee -a "$dest/gpu_check.log"
# The embedded engine follows trainer.device (issue 9): one job end to end on the GPU (the CPU-designed
# `contract` set through cuBLAS: measured on an H200 to miss the gate, which is why `triton` exists).
timeout 240 python3 -m tonpolicy trainer.device=cuda logger=none experiment.steps=2 \
  hydra.run.dir="$dest/run_embedded_cuda" 2>&1 | tail -5 | tee -a "$dest/gpu_check.log"
# Real SGLang with tonpolicy's model package on CUDA (issues 9, 35). Only where SGLang is installed: the
# lent GPU image has none and its wheels exceed the carry limit. On a cluster with SGLang this is the check.
# gpu_sglang_check.py: the triton set inside SGLang, decode in CUDA graphs (buckets 1, 4, 8), every
# logprob == the full forward, bf16 and fp32, plain kernels as the control; it writes $dest/gpu_sglang.json
# either way (with "skipped" and why when SGLang is not importable).
timeout 420 python3 experiments/gpu_sglang_check.py --out "$dest/gpu_sglang.json" 2>&1 | tail -6 \
  | tee -a "$dest/gpu_check.log"
if python3 -c "import sglang.srt.entrypoints.http_server" >/dev/null 2>&1; then
  TONPOLICY_SGLANG_PYTHON=python3 timeout 300 python3 -m tonpolicy rollout=sglang trainer.device=cuda parallel=tp1 \
    logger=none experiment.steps=3 hydra.run.dir="$dest/run_sglang_cuda" 2>&1 | tail -8 | tee -a "$dest/gpu_check.log"
  # The triton set end to end through SGLang (graphs on): the gate must pass on every step (exit 0).
  TONPOLICY_SGLANG_PYTHON=python3 timeout 300 python3 -m tonpolicy rollout=sglang contract=qwen3_dense_triton_v1 \
    trainer.device=cuda parallel=tp1 logger=none experiment.steps=3 hydra.run.dir="$dest/run_sglang_triton_cuda" \
    2>&1 | tail -8 | tee -a "$dest/gpu_check.log"
else
  echo "rollout=sglang on CUDA: skipped, SGLang is not installed on this machine" | tee -a "$dest/gpu_check.log"
fi
