"""Compile every `triton` kernel the kernel set launches for a CUDA target, on a machine without a GPU.

Run as a script (`python tests/support/triton_compile.py [arch]`, Triton's interpreter off): each kernel
launch is intercepted and compiled with Triton's own compiler and ptxas for the given architecture
(default 90: H100/H200) instead of run, from the real call sites (a bf16 and an fp32 Qwen3 forward,
prefill and decode, the ring-CP tile ops, partials and fold, logprobs, the fp8_block GEMM). Catches what the interpreter
does not: non-constexpr globals, type errors in the compiled dialect, unsupported dot shapes.
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.int64: "*i64",
    torch.int32: "*i32",
}
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")
compiled: dict[str, int] = {}


def _compile_only(target: GPUTarget):  # noqa: ANN202
    def run(self: JITFunction, *args, grid, warmup, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        opts = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
        bound = dict(zip(self.arg_names, args, strict=False)) | kwargs
        sig, consts = {}, {}
        for p in self.params:
            v = bound[p.name]
            if p.is_constexpr:
                sig[p.name], consts[p.name] = "constexpr", v
            elif isinstance(v, torch.Tensor):
                sig[p.name] = TYPES[v.dtype]
            elif isinstance(v, TensorDescriptor):  # a host-side TMA descriptor
                sig[p.name] = f"tensordesc<{TYPES[v.base.dtype][1:]}{list(v.block_shape)}>"
            elif isinstance(v, bool):
                sig[p.name] = "i1"
            elif isinstance(v, int):
                sig[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            elif isinstance(v, float):
                sig[p.name] = "fp32"
            else:
                raise TypeError(f"{self.__name__}: unhandled argument {p.name}={v!r}")
        key = f"{self.__name__}{sorted(sig.items())}{sorted(consts.items())}{sorted(opts.items())}"
        if key not in compiled:
            kernel = triton.compile(ASTSource(self, sig, consts), target=target, options=opts)
            compiled[key] = len(kernel.asm["cubin"])
        return None

    return run


def exercise() -> None:
    from tonpolicy.config.model import ModelConfig
    from tonpolicy.kernels import get_kernels
    from tonpolicy.model.kv_cache import KVPool  # noqa: F401 - the engine's pool type
    from tonpolicy.model.qwen3 import Qwen3, Segment

    kern = get_kernels("triton", attention_tile=64)
    cfg = ModelConfig(num_layers=1)
    for dtype in (torch.bfloat16, torch.float32):
        model = Qwen3(cfg, kern, dtype)
        model(torch.arange(70))  # prefill: linear (split and fused routes), attention, row-local ops
        x = torch.randn(600, 256).to(dtype)
        w = torch.randn(96, 256).to(dtype)
        kern.linear(x, w)
        kern.combine_partials(kern.linear_partials(x, w, 2), dtype)
        for m in (1, 1100):  # with the model's 70 rows and the 600 above: every bucket's GEMM member
            kern.linear(x.repeat(2, 1)[:m], w)
            kern.linear_k_sharded(x.repeat(2, 1)[:m], w)
        q = torch.randn(3, 1, 8, 32).to(dtype)
        pool = torch.zeros(4, 128, 4, 32, dtype=dtype)
        kern.attention_pooled(q, torch.tensor([[5], [9], [70]]), pool, pool, torch.tensor([0, 1, 2]), 71, 0.2)
        wide = torch.zeros(2, 256, 4, 32, dtype=dtype)  # keys past one chunk: split-KV and its fold
        kern.attention_pooled(q[:2], torch.tensor([[5], [200]]), wide, wide, torch.tensor([0, 1]), 201, 0.2)
        kern.attention_chunk_partial(
            q[:, 0], wide[0, :128], wide[0, :128], torch.tensor([5, 9, 70]), torch.arange(128), 0.2
        )
        qs, ks = torch.randn(64, 8, 32).to(dtype), torch.randn(64, 4, 32).to(dtype)
        pos = torch.arange(64)
        part = kern.attention_tile_partial(qs, ks, ks, pos, pos, 0.2)
        kern.finalize(kern.merge(part, part), dtype)
        kern.logprobs(torch.randn(4, 2048), torch.tensor([1, 2, 3, 4]), 2003, 0.7)
        qb, kb = torch.randn(2, 70, 8, 32).to(dtype), torch.randn(2, 70, 4, 32).to(dtype)  # the trainer's
        pos2 = torch.arange(70).repeat(2, 1)
        out, lse = kern.attention_with_lse(qb, kb, kb, pos2, 0.2)
        kern.attention_backward(qb, kb, kb, pos2, out, torch.zeros(2, 70, 8), qb, 0.2)
        if dtype == torch.bfloat16:  # the fused row-local backward: fp32 differs only in its loads and stores
            xr = torch.randn(20, 256).to(dtype)
            kern.rms_norm_backward(xr, xr[0], 1e-6, xr, True)
            kern.swiglu_backward(xr, xr, xr)
    fp8 = get_kernels("triton", attention_tile=64, quant="fp8_block")
    for m in (1, 600):  # both tile buckets of the e4m3 GEMM, K whole and 4 canonical shards of 96 (ragged group)
        xs, ws = torch.randn(m, 384), torch.randn(96, 384)
        fp8.linear(xs, ws)
        fp8.linear_k_sharded(xs, ws)
    del Segment


def main() -> None:
    arch = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    JITFunction.run = _compile_only(GPUTarget("cuda", arch, 32))
    exercise()
    for key, size in compiled.items():
        print(f"sm_{arch} {size:>8} B  {key.split('[')[0]}")
    print(f"compiled {len(compiled)} kernel variants for sm_{arch}")


if __name__ == "__main__":
    main()
