"""Contract v2's row-local ops ("owned order"): exp, log, row sum/max, RMSNorm, SwiGLU, logprobs and RoPE
tables whose bits are fixed by the source (ordered_rowwise.cpp), not by torch's vectorised CPU kernels,
whose bits may follow the vector ISA (ATEN_CPU_CAPABILITY default/avx2/avx512; measured with torch 2.13 on an
AVX2 host: log_softmax, sigmoid, randn and linspace change between default and avx2, exp and the last-dim sum
did not there, the sum's lane count is the vector width's).

The definition (`describe()` states it for the contract's fingerprint):
- arithmetic: IEEE 754 fp32, round to nearest even, gradual underflow (no DAZ, no FTZ: MXCSR is set to its
  IEEE default for every call in every computing thread, whatever the caller's mode); every FMA is one
  written below (built with -ffp-contract=off, no -ffast-math, no -march=native). Every NaN an op returns is
  the one pattern 0x7FC00000 (bf16 0x7FC0). Rounding to bf16: to nearest even.
- exp(x): NaN -> NaN; xc = min(max(x, -112), 89); n = rne(xc * LOG2E) by (v + 1.5*2^23) - 1.5*2^23;
  Cody-Waite: r = fma(-n, LN2_HI, xc), r = fma(-n, LN2_LO, r) (LN2_HI = 0.693359375, LN2_LO =
  -2.12194440e-4); p = Horner of the 8 coefficients EXP_P (Cephes expf, c0 = c1 = 1): p = fma(p, r, c_k);
  exp = (p * 2^n1) * 2^n2 with n1 = floor(n/2), n2 = n - n1 (each 2^k built from bits; so results below
  2^-126 round once, gradually; exp(-inf) = +0, exp(+inf) = exp(89) = +inf, overflow -> +inf).
- log(x): NaN or x < 0 -> NaN; +-0 -> -inf; +inf -> +inf; subnormal x scaled by 2^23 (e -= 23); from the
  bits x = 2^e * m with m in [sqrt(2)/2, sqrt(2)) (mantissa > 0x3504F3: halved, e + 1); f = m - 1 (exact);
  z = f*f; q = Horner(LOG_P (Cephes logf, 9 coefficients), f); y = (q*f)*z; y = fma(e, LN2_LO, y);
  y = fma(-0.5, z, y); log = fma(e, LN2_HI, f + y).
- sin/cos(a) (RoPE): |a| > 2^24 or not finite -> NaN; n = rne(a * fp32(2/pi)) (IEEE round to integral,
  ties to even); r = a - n*pi/2 as three fmas with PIO2_1 = fp32(pi/2), PIO2_2, PIO2_3 (the next 24-bit
  pieces); z = r*r; S = fma(Horner(SIN_P, z) * z, r, r); C = fma(Horner(COS_P, z) * z, z, -0.5*z) + 1
  (Cephes sinf/cosf coefficients); quadrant n & 3: sin = S, C, -S, -C and cos = C, -S, -C, S.
- row sum of x[0..L): 16 lanes, lane j = -0.0 + x[j] + x[j+16] + ... in ascending order (plain fp32 adds);
  then the tree a[j] += a[j+8] (j < 8), a[j] += a[j+4] (j < 4), a[j] += a[j+2] (j < 2), a[0] + a[1]. An
  absent element adds nothing (a tail lane is padded with -0.0, the exact identity), so an AVX2 pair of
  8-lane registers, one AVX-512 register and the scalar loop compute the same chain. Empty row: -0.0.
- row max: the largest under the total order -inf < ... < -0 < +0 < ... < +inf (so +0 beats -0); any NaN
  -> NaN; empty row: -inf.
- rms_norm(x [..., H], w [H], eps): x, w upcast to fp32 exactly; ss = rowsum(x*x) (each square rounded,
  then the row sum above); var = ss / H; d = sqrt(var + fp32(eps)) (IEEE); out = (x / d) * w (IEEE
  division per element, as pointwise.rms_norm does), rounded once to x.dtype.
- swiglu(g, u) = (g / (exp(-g) + 1)) * u in fp32, rounded once to g.dtype.
- logprobs(logits [..., V'], tokens, V, T): T <= 0 means 1 (logprob_temperature's greedy rule);
  z = logits[..., :V] / fp32(T) (IEEE division; T = 1 skips it: x / 1 = x); m = rowmax(z);
  s = rowsum(exp(z - m)); out = (z[token] - m) - log(s). (m is computed as rowmax(x) / T: rounding is
  monotonic, the same value.)
- rope_cos_sin(positions, D, theta): inv[i] = 1.0f / fp32(exp64(e_i * log64(theta))), e_i = fp32(2i) /
  fp32(D) (fp32 division), exp64/log64 this source's own fp64 routines (series with fixed terms, ~1e-16);
  angle = fp32(position) * inv[i] (fp32 product); cos/sin as above; rotate-half layout: columns i and
  i + D/2 both hold angle i. Positions in [0, 2^24), theta >= 1.
- accuracy (secondary; measured against fp64): exp <= 0.87 ulp on [-87.3, 88.7], log <= 0.76 ulp on every
  positive finite input, sin/cos <= 8e-8 absolute for |a| <= 1e5 (1.2e-7 to 1e6, ~3e-6 at 4e6: the rounded
  a * fp32(2/pi) picks a quadrant off by one more often, |r| leaves the polynomial's range), inv[i] within
  2 ulp of the torch recipe.
- threads (OpenMP) split rows, or blocks of 16 elements for elementwise ops; a row's reductions are never
  split, so the bits do not depend on the thread count, the row's position or the other rows.

ordered_rowwise.cpp implements it once per instruction-set path (avx512: one 16-lane register; avx2: two
8-lane registers; portable: GCC vector extensions on baseline x86-64, tests only), each built with fixed -m
flags into the kernel cache (tonpolicy.kernels.native_build), chosen like the ordered GEMM's
(TONPOLICY_ORDERED_ISA or the CPU's flags; its avx512bf16 runs the avx512 library). Every library carries
the scalar reference of every op (plain loops, the same definition written again) for the tests
(`reference_*`). rms_norm, swiglu and logprobs are differentiable: the forward is the library's, the
backward the plain torch formula's (only the forward is under the contract). The library's loading is
ordered_rowwise_lib, the ops on one path ordered_rowwise_ops, their gradients ordered_rowwise_grad.
"""

from __future__ import annotations

from typing import Any

import torch

# The library, the ops on one path and their gradients' formulas, imported from here by their callers too.
from tonpolicy.kernels.invariant.ordered_isa import OrderedKernelsUnavailable as OrderedKernelsUnavailable
from tonpolicy.kernels.invariant.ordered_rowwise_grad import plain_logprobs as plain_logprobs
from tonpolicy.kernels.invariant.ordered_rowwise_grad import plain_rms_norm as plain_rms_norm
from tonpolicy.kernels.invariant.ordered_rowwise_grad import plain_swiglu as plain_swiglu
from tonpolicy.kernels.invariant.ordered_rowwise_lib import ISA_IDS as ISA_IDS
from tonpolicy.kernels.invariant.ordered_rowwise_lib import PORTABLE as PORTABLE
from tonpolicy.kernels.invariant.ordered_rowwise_lib import SOURCE_FILE as SOURCE_FILE
from tonpolicy.kernels.invariant.ordered_rowwise_lib import build_paths, chosen_path, isa_paths, library
from tonpolicy.kernels.invariant.ordered_rowwise_lib import require as require
from tonpolicy.kernels.invariant.ordered_rowwise_ops import RowwiseFunctions

__all__ = [
    "OrderedKernelsUnavailable",
    "describe",
    "exp",
    "exp_",
    "log",
    "logprobs",
    "reference_exp",
    "reference_log",
    "reference_logprobs",
    "reference_rms_norm",
    "reference_rope_cos_sin",
    "reference_row_max",
    "reference_row_sum",
    "reference_sincos",
    "reference_swiglu",
    "require",
    "rms_norm",
    "rope_cos_sin",
    "row_max",
    "row_sum",
    "sincos",
    "swiglu",
]

_functions: dict[str | None, RowwiseFunctions] = {}


def functions(path: str | None = None) -> RowwiseFunctions:
    """The ops on `path` (default: the chosen path)."""
    got = _functions.get(path)
    if got is None:
        got = _functions[path] = RowwiseFunctions(path)
    return got


# The ops on the chosen path ------------------------------------------------------------------------
def exp_(x: torch.Tensor) -> torch.Tensor:
    """exp of an fp32 tensor, in place (returns x)."""
    return functions().exp_(x)


def exp(x: torch.Tensor) -> torch.Tensor:
    return functions().exp(x)


def log(x: torch.Tensor) -> torch.Tensor:
    return functions().log(x)


def sincos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return functions().sincos(x)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """fp32 [...]: the ordered sum of fp32 x [..., L] over its last dim."""
    return functions().row_sum(x)


def row_max(x: torch.Tensor) -> torch.Tensor:
    """fp32 [...]: the max of fp32 x [..., L] over its last dim (any NaN -> NaN, +0 above -0)."""
    return functions().row_max(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return functions().rms_norm(x, weight, eps)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return functions().swiglu(gate, up)


def logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    return functions().logprobs(logits, tokens, vocab_size, temperature)


def _scaled_and_normalizer(logits: torch.Tensor, vocab_size: int, temperature: float):  # noqa: ANN202
    """(z, m, L): z = logits[..., :vocab_size] / T (T <= 0 means 1) and `logprobs`' own steps, m = max(logits) / T
    and L = log of the ordered row sum of exp(z - m), so that (z_t - m) - L is `logprobs` at t."""
    t = temperature if temperature > 0 else 1.0
    x = logits[..., :vocab_size].float().contiguous()
    m, z = row_max(x), x
    if t != 1.0:  # fp32 IEEE division, as the kernel's
        m, z = m / t, x / t
    return z, m, log(row_sum(exp(z - m.unsqueeze(-1))))


def log_normalizer(logits: torch.Tensor, vocab_size: int, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, L), fp32 [...], such that the logprob of token t is (z_t - m) - L (see `_scaled_and_normalizer`)."""
    _, m, lse = _scaled_and_normalizer(logits, vocab_size, temperature)
    return m, lse


def log_softmax(logits: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """fp32 [..., vocab_size]: every token's logprob by the ordered recipe (top-k and prompt logprobs), each
    column equal to `logprobs` at that token."""
    z, m, lse = _scaled_and_normalizer(logits, vocab_size, temperature)
    return (z - m.unsqueeze(-1)) - lse.unsqueeze(-1)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    return functions().rope_cos_sin(positions, head_dim, theta)


def reference_exp(x: torch.Tensor) -> torch.Tensor:
    return functions().reference_exp(x)


def reference_log(x: torch.Tensor) -> torch.Tensor:
    return functions().reference_log(x)


def reference_sincos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return functions().reference_sincos(x)


def reference_row_sum(x: torch.Tensor) -> torch.Tensor:
    return functions().reference_row_sum(x)


def reference_row_max(x: torch.Tensor) -> torch.Tensor:
    return functions().reference_row_max(x)


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return functions().reference_rms_norm(x, weight, eps)


def reference_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return functions().reference_swiglu(gate, up)


def reference_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int, temperature: float):
    return functions().reference_logprobs(logits, tokens, vocab_size, temperature)


def reference_rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    return functions().reference_rope_cos_sin(positions, head_dim, theta)


def describe() -> dict[str, Any]:
    """The definition in words and constants (part of the contract's fingerprint: nothing about the path
    or the host)."""
    return {
        "arithmetic": "IEEE 754 fp32, round to nearest even, gradual underflow (no DAZ/FTZ: MXCSR set to the IEEE "
        "default per call and thread); every fma written (single rounding); any NaN result is 0x7FC00000 (bf16 "
        "0x7FC0); rounding to bf16 to nearest even, once, at the end",
        "exp": "NaN->NaN; xc=min(max(x,-112),89); n=rne(xc*0x1.715476p+0f) via (v+0x1.8p23f)-0x1.8p23f; "
        "r=fma(-n,0x1.63p-1f,xc); r=fma(-n,-0x1.bd0106p-13f,r); p=Horner fma over [0x1.a0d2cep-13f, 0x1.6e879cp-10f, "
        "0x1.111210p-7f, 0x1.555382p-5f, 0x1.555554p-3f, 0x1.0p-1f, 1, 1]; exp=(p*2^(n>>1))*2^(n-(n>>1)), powers "
        "from bits",
        "log": "NaN or x<0 -> NaN; +-0 -> -inf; +inf -> +inf; x<2^-126: x*=2^23, e-=23; x=2^e*m from bits, m in "
        "[sqrt2/2, sqrt2) (mantissa>0x3504F3: halved, e+1); f=m-1; z=f*f; q=Horner fma over [0x1.204376p-4f, "
        "-0x1.d7a370p-4f, 0x1.de4a34p-4f, -0x1.fcba9ep-4f, 0x1.23d37ep-3f, -0x1.555ca0p-3f, 0x1.999d58p-3f, "
        "-0x1.fffff8p-3f, 0x1.555554p-2f]; y=(q*f)*z; y=fma(e,-0x1.bd0106p-13f,y); y=fma(-0.5,z,y); "
        "log=fma(e,0x1.63p-1f,f+y)",
        "sincos": "|a|>2^24 or non-finite -> NaN; n=rne(a*0x1.45f306p-1f) (roundToIntegralTiesToEven); "
        "r=fma(-n,0x1.921fb6p+0f,a); r=fma(-n,-0x1.777a5cp-25f,r); r=fma(-n,-0x1.ee59dap-50f,r); z=r*r; "
        "S=fma(fma(fma(-0x1.9943f2p-13f,z,0x1.11073cp-7f),z,-0x1.555546p-3f)*z,r,r); "
        "C=fma(fma(fma(0x1.99eb9cp-16f,z,-0x1.6c0c34p-10f),z,0x1.55554ap-5f)*z,z,-0.5*z)+1; "
        "q=n&3: sin=[S,C,-S,-C][q], cos=[C,-S,-C,S][q]",
        "row_sum": "16 lanes: lane j = -0.0 + x[j] + x[j+16] + ... ascending (fp32 adds); then a[j]+=a[j+8] (j<8), "
        "a[j]+=a[j+4] (j<4), a[j]+=a[j+2] (j<2), a[0]+a[1]; empty row -0.0",
        "row_max": "max under -inf < ... < -0 < +0 < ... < +inf; any NaN -> NaN; empty row -inf",
        "rms_norm": "x, w upcast exactly; ss=row_sum(x*x) (squares rounded); var=ss/H; d=sqrt(var+fp32(eps)); "
        "out=(x/d)*w rounded once to x.dtype",
        "swiglu": "(g/(exp(-g)+1))*u in fp32, rounded once to gate.dtype",
        "logprobs": "T<=0 means 1; z=logits[..., :V]/fp32(T) (T=1: no division); m=row_max(z); "
        "s=row_sum(exp(z-m)); out=(z[token]-m)-log(s), fp32",
        "rope": "inv[i]=1.0f/fp32(exp64(fp32(2i)/fp32(D) * log64(theta))) (own fp64 series: log64 via atanh series "
        "to s^12, exp64 via 17-term Taylor after ln2 reduction); angle=fp32(pos)*inv[i]; cos/sin by sincos; "
        "columns i and i+D/2 hold angle i; positions in [0, 2^24), theta >= 1",
        "threads": "rows (or 16-element blocks of elementwise ops) split across threads; a row's reduction never",
    }


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m tonpolicy.kernels.invariant.ordered_rowwise")
    ap.add_argument("--build", action="store_true", help="build every instruction-set path this CPU runs")
    args = ap.parse_args(argv)
    if not args.build:
        ap.print_help()
        return 0
    try:
        paths = isa_paths()
        build_paths(paths)
        for p in paths:
            print(f"ordered_rowwise {p}: {library(p).so}")
        print(f"ordered_rowwise: chosen path {chosen_path()}")
    except OrderedKernelsUnavailable as e:
        print(f"ordered_rowwise: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
