#!/usr/bin/env bash
# One command for a session with a GPU (one GPU, one device call):
#   device run: command="bash experiments/gpu_check.sh", carry=[".whl"], timeout_s=600
# The GPU image lacks megatron-core and hydra-core/omegaconf (tonpolicy.config imports hydra's
# ConfigStore). Prepare the wheels once, here, in the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl megatron-core==0.16.1 \
#     hydra-core==1.3.2 omegaconf==2.3.0
#   .venv/bin/pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3   # it has no wheel on PyPI
# Parts run most-informative first, each under min(its own limit, what is left of GPU_CHECK_BUDGET_S), so
# the whole fits one device call. Results: $OUT/gpu_check.log (summary, jobs), gpu_check.json, gpu_triton.json
# (+.log), gpu_graph.json (+.log), gpu_sglang.json, gpu_speed.json; experiments/results/ keeps the ones recorded
# so far.
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
dest="${OUT:-/tmp/gpu_check}"
runs=/tmp/gpu_check_runs  # job folders stay on the machine: the device returns at most 8 files
mkdir -p "$dest" "$runs"
log="$dest/gpu_check.log"
deadline=$((SECONDS + ${GPU_CHECK_BUDGET_S:-540}))
# part NAME LIMIT_S CMD...: runs CMD under min(LIMIT_S, time left), logs its exit code and seconds.
part() {
  local name=$1 limit=$2 left=$((deadline - SECONDS)) t0=$SECONDS
  shift 2
  ((left < limit)) && limit=$left
  if ((limit < 20)); then echo "== $name: skipped, the budget is spent" | tee -a "$log" >&3; return; fi
  echo "== $name (limit ${limit}s)" | tee -a "$log" >&3
  timeout "$limit" "$@"
  echo "== $name: exit $? in $((SECONDS - t0))s" | tee -a "$log" >&3
}
exec 3>&1  # part's own lines bypass the pipes that filter a part's output
torchrun1=(python3 -m torch.distributed.run --standalone --nproc-per-node 1)
quiet() { grep -v "Unknown MLP\|warn"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$log"
# First, the speed table (gpu/speed_table.py): linears vs cuBLAS at 4096 rows and at 1-128 rows in a CUDA
# graph, attention vs SDPA/FlashAttention, trainer step vs the stock spec; target, measured, met per row.
# `bash experiments/gpu_check.sh speed` runs this part alone (one device call of at most 5 minutes).
part speed_table 300 "${torchrun1[@]}" experiments/gpu/speed_table.py --out "$dest/gpu_speed.json" 2>&1 | quiet \
  | tail -30 | tee -a "$log"
[[ "${1:-}" == speed ]] && exit 0
# The embedded engine's decode in CUDA graphs: per batch-size bucket, graph replay ==
# eager == the Megatron trainer's full forward (bf16, fp32), plain control, capture time, tokens/s on/off.
part graph_check 200 "${torchrun1[@]}" experiments/gpu/graph_check.py --out "$dest/gpu_graph.json" 2>&1 | quiet \
  | tee "$dest/gpu_graph.log" | tail -40
# One job end to end on the triton contract, decode in CUDA graphs: the gate must pass every step (exit 0).
part triton_job_graphs 150 python3 -m tonpolicy contract=qwen3_dense_triton_v1 trainer.device=cuda \
  rollout.cuda_graphs=true logger=none experiment.steps=3 hydra.run.dir="$runs/triton_graphs" 2>&1 | tail -8 \
  | tee -a "$log"
# The triton kernel set: invariances of the compiled kernels, both engines bit for bit, timings.
part triton_check 150 "${torchrun1[@]}" experiments/gpu/triton_check.py --out "$dest/gpu_triton.json" 2>&1 | quiet \
  | tee "$dest/gpu_triton.log" | tail -6
# The CPU-designed `invariant` set (contract v1) through cuBLAS: parity, invariance and step time.
part cublas_check 90 "${torchrun1[@]}" experiments/gpu/cublas_check.py --out "$dest/gpu_check.json" 2>&1 | quiet | tail -6 \
  | tee -a "$log"
if python3 -c "import pytest" >/dev/null 2>&1; then
  part graph_pytest 90 python3 -m pytest -q -p no:cacheprovider tests/engine/test_decode_graphs_gpu.py 2>&1 \
    | tail -4 | tee -a "$log"
fi
# The embedded engine follows trainer.device: the default contract on CUDA (CPU-designed kernels, not
# expected to pass the gate there: why `triton` exists); its exit code is reported, not required.
part cublas_job 90 python3 -m tonpolicy trainer.device=cuda logger=none experiment.steps=2 \
  hydra.run.dir="$runs/embedded_cuda" 2>&1 | tail -5 | tee -a "$log"
# Real SGLang with tonpolicy's model package on CUDA, only where SGLang is installed: the lent
# GPU image has none and its wheels exceed the carry limit. gpu/sglang_check.py (the triton set inside SGLang,
# decode graphs in buckets 1, 4, 8, every logprob == the full forward, plain control) writes its JSON either
# way ("skipped" and why when SGLang is not importable).
part sglang_check 200 python3 experiments/gpu/sglang_check.py --out "$dest/gpu_sglang.json" 2>&1 | tail -6 \
  | tee -a "$log"
if python3 -c "import sglang.srt.entrypoints.http_server" >/dev/null 2>&1; then
  export TONPOLICY_SGLANG_PYTHON=python3
  part sglang_job 200 python3 -m tonpolicy rollout=sglang trainer.device=cuda parallel=tp1 logger=none \
    experiment.steps=3 hydra.run.dir="$runs/sglang_cuda" 2>&1 | tail -8 | tee -a "$log"
  part sglang_triton_job 200 python3 -m tonpolicy rollout=sglang contract=qwen3_dense_triton_v1 \
    trainer.device=cuda parallel=tp1 logger=none experiment.steps=3 hydra.run.dir="$runs/sglang_triton_cuda" \
    2>&1 | tail -8 | tee -a "$log"
else
  echo "rollout=sglang on CUDA: skipped, SGLang is not installed on this machine" | tee -a "$log"
fi
