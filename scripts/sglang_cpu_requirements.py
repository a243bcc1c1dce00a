"""Print installed SGLang's own requirements minus its CUDA-only kernel packages.

SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1, torch_native attention) never imports these: their
wheels are CUDA builds (together ~3 GB, a third of the environment), and `sgl_kernel`'s few CPU ops
come from tonpolicy/inside_sglang/cpu_standin instead. Everything else SGLang asks for is installed, at the
versions it pins, with its own dependencies. Run with the environment's Python after
`pip install --no-deps sglang`.
"""

from __future__ import annotations

from importlib.metadata import requires

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

CUDA_ONLY = frozenset(
    canonicalize_name(name)
    for name in (
        "sglang-kernel",  # CUDA kernels; tonpolicy ships the CPU ops SGLang calls
        "flashinfer-python",  # CUDA attention / sampling kernels
        "flash-attn-4",  # CUDA (CuTe DSL) attention
        "nvidia-cutlass-dsl",  # CUDA kernel DSL
        "nvidia-mathdx",  # CUDA device math libraries
        "nvshmem4py-cu13",  # GPU-initiated communication
        "tilelang",  # CUDA kernel compiler
        "quack-kernels",  # CUDA (CuTe DSL) kernels
        "humming-kernels",  # CUDA quantized GEMMs
        "sgl-deep-ep",  # CUDA expert-parallel all-to-all
        "sgl-deep-gemm",  # CUDA FP8 GEMMs
        "sgl-flash-mla",  # CUDA MLA attention
    )
)


def cpu_requirements(package: str = "sglang") -> list[str]:
    kept = []
    for line in requires(package) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an optional extra, or another platform's dependency
        if canonicalize_name(req.name) in CUDA_ONLY:
            continue
        req.marker = None
        kept.append(str(req))
    return kept


if __name__ == "__main__":
    print("\n".join(cpu_requirements()))
