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
backward the plain torch formula's (only the forward is under the contract).
"""

from __future__ import annotations

import ctypes
import math
import threading
from pathlib import Path
from typing import Any

import torch

from tonpolicy.kernels import logprob_temperature, native_build
from tonpolicy.kernels.invariant import ordered_gemm
from tonpolicy.kernels.invariant.ordered_gemm import OrderedKernelsUnavailable

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

PATHS = ("avx512", "avx2")  # best first
PORTABLE = ordered_gemm.PORTABLE
PATH_FLAGS = {p: ordered_gemm.PATH_FLAGS[p] for p in (*PATHS, PORTABLE)}
SOURCE_FILE = Path(__file__).with_suffix(".cpp")
ISA_IDS = {"avx512": 5, "avx2": 2, PORTABLE: 0}  # what rowwise_isa() answers
MAX_POSITION = 1 << 24

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_OPS = {
    "exp": 0, "log": 1, "row_sum": 2, "row_max": 3, "rms_norm": 4, "swiglu": 5, "logprobs": 6, "rope": 7,
    "sincos": 8, "inv_freq": 9,
}  # fmt: skip
_RC = {
    1: "unknown op",
    2: "unsupported dtype",
    3: "a token outside [0, vocab)",
    4: "a position outside [0, 2^24)",
    5: "head_dim must be even and >= 2",
}


def isa_paths() -> list[str]:
    """The paths this CPU runs, best first (the ordered GEMM's choice, its avx512bf16 as avx512)."""
    return [p for p in PATHS if p in {_lib_path(q) for q in ordered_gemm.isa_paths()}]


def _lib_path(gemm_path: str) -> str:
    return "avx512" if gemm_path == "avx512bf16" else gemm_path


def chosen_path() -> str:
    """TONPOLICY_ORDERED_ISA if set (a path this CPU runs), else the best path: the ordered GEMM's rule."""
    return _lib_path(ordered_gemm.chosen_path())


class _Lib:
    def __init__(self, path: str, so: Path) -> None:
        lib = ctypes.CDLL(str(so))
        lib.rowwise_call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.rowwise_call.restype = ctypes.c_int
        lib.rowwise_isa.restype = ctypes.c_int
        self.path, self.so, self.call, self.isa = path, so, lib.rowwise_call, lib.rowwise_isa()


_libs: dict[str, _Lib | OrderedKernelsUnavailable] = {}  # a path's library or its remembered failure
_args = threading.local()


def _arrays() -> tuple[ctypes.Array, ctypes.Array]:
    a = getattr(_args, "a", None)
    if a is None:
        a = _args.a = ((ctypes.c_int64 * 12)(), (ctypes.c_double * 2)())
    return a


def build_path(path: str) -> Path:
    """Build (or find in the cache) one path's library; OrderedKernelsUnavailable on failure."""
    flags = [*ordered_gemm.BASE_FLAGS, *PATH_FLAGS[path], f"-DROWWISE_ISA_{path.upper()}"]
    try:
        return native_build.build(f"ordered_rowwise_{path}", SOURCE_FILE, flags)
    except native_build.NoCompilerError as e:
        raise OrderedKernelsUnavailable(
            f"the ordered row-wise ops need a C++ compiler: set CXX or install g++ ({e})"
        ) from e
    except native_build.NativeBuildError as e:
        raise OrderedKernelsUnavailable(f"the ordered row-wise ops' {path} build failed: {e}") from e


# The test-only portable build runs on any x86-64; the real paths only where the CPU has their flags.
_LIBRARIES = native_build.PathLibraries(
    build_path, _Lib, PATH_FLAGS, lambda p: p == PORTABLE or p in isa_paths(), OrderedKernelsUnavailable
)


def build_paths(paths: list[str]) -> None:
    """Build several paths at once (the compilers run outside the GIL); errors are raised by library()."""
    _LIBRARIES.build_paths(paths)


def library(path: str | None = None) -> _Lib:
    """The compiled ops of `path` (default: the chosen path), built on first use."""
    return _LIBRARIES.library(path or chosen_path(), _libs)


def require() -> None:
    """Raise OrderedKernelsUnavailable (saying what is missing) unless the chosen path builds and loads."""
    library()


# ---------------------------------------------------------------------------------------------------
def _cpu(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.device.type != "cpu":
            raise ValueError(f"the ordered row-wise ops run on CPU tensors (got {t.device})")


def _dtype(t: torch.Tensor, what: str) -> int:
    code = _DTYPES.get(t.dtype)
    if code is None:
        raise ValueError(f"{what}: fp32 or bf16 (got {t.dtype})")
    return code


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(t, R, L, row stride): x [..., L] as R rows at t.data_ptr() with unit element stride and a uniform
    row stride (t is x, or a copy only when needed)."""
    n = x.shape[-1] if x.dim() else 1
    if x.is_contiguous():
        return x, (x.numel() // n if n else math.prod(x.shape[:-1])), n, n
    x2 = x.reshape(math.prod(x.shape[:-1]), n)
    if (n > 1 and x2.stride(-1) != 1) or (x2.shape[0] > 1 and x2.stride(0) < n):
        x2 = x2.contiguous()
    return x2, x2.shape[0], n, (x2.stride(0) if x2.shape[0] > 1 else n)


def _run(lib: _Lib, op: str, ref: bool, ints: tuple[int, ...], floats: tuple[float, ...] = ()) -> None:
    a, d = _arrays()
    a[: len(ints)] = ints
    if floats:
        d[: len(floats)] = floats
    rc = lib.call(_OPS[op], int(ref), a, d)
    if rc:
        raise ValueError(f"ordered_rowwise.{op}: {_RC.get(rc, f'code {rc}')}")


class _PlainGrad(torch.autograd.Function):
    """out = fwd(*inputs) (the library's bits), with the gradient of plain(*inputs), the torch formula
    (recomputed in backward: only the forward is under the contract)."""

    @staticmethod
    def forward(ctx, fwd, plain, *inputs):  # noqa: ANN001, ANN205
        ctx.plain = plain
        ctx.save_for_backward(*inputs)
        return fwd(*inputs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN205
        need = ctx.needs_input_grad[2:]
        ins = [
            t.detach().requires_grad_(n) if t.is_floating_point() else t
            for t, n in zip(ctx.saved_tensors, need, strict=True)
        ]
        with torch.enable_grad():
            out = ctx.plain(*ins)
        wanted = [t for t, n in zip(ins, need, strict=True) if n]
        got = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (None, None, *(next(got) if n else None for n in need))


def _tracked(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


def plain_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch formula (rms_norm's gradient)."""
    xf = x.float()
    var = (xf * xf).sum(dim=-1, keepdim=True) / x.shape[-1]
    return (xf / torch.sqrt(var + eps) * weight.float()).to(x.dtype)


def plain_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The torch formula (swiglu's gradient)."""
    g = gate.float()
    return (g / (1.0 + torch.exp(-g)) * up.float()).to(gate.dtype)


def plain_logprobs(logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
    """The torch formula (logprobs' gradient)."""
    x = logits[..., :vocab_size].float()
    t = logprob_temperature(temperature)
    if t != 1.0:
        x = x / t
    return torch.log_softmax(x, dim=-1).gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)


class RowwiseFunctions:
    """The ops on one path's library (the module's functions use the chosen path; tests take each path
    with `functions(path)`). `threads`: None = torch.get_num_threads()."""

    def __init__(self, path: str | None = None) -> None:
        self.lib = library(path)
        self.path = self.lib.path

    @staticmethod
    def _nt(threads: int | None) -> int:
        return torch.get_num_threads() if threads is None else threads

    # -- elementwise ------------------------------------------------------------------------------
    def _elementwise(self, op: str, x: torch.Tensor, out: torch.Tensor | None, ref: bool, threads: int | None):
        _cpu(x)
        if x.dtype != torch.float32:
            raise ValueError(f"{op}: fp32 input (got {x.dtype})")
        src = x if x.is_contiguous() else x.contiguous()
        dst = out if out is not None and out.is_contiguous() else torch.empty_like(src)
        if src.numel():
            _run(self.lib, op, ref, (src.data_ptr(), dst.data_ptr(), src.numel(), self._nt(threads)))
        if out is not None and dst is not out:
            out.copy_(dst)
            return out
        return dst

    def exp_(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """exp of fp32 x in place (returns x)."""
        return self._elementwise("exp", x, x, False, threads)

    def exp(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        return self._elementwise("exp", x, None, False, threads)

    def log(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        return self._elementwise("log", x, None, False, threads)

    def sincos(self, x: torch.Tensor, ref: bool = False, threads: int | None = None):
        """(sin, cos) of fp32 angles (the RoPE definition; |a| > 2^24 gives NaN)."""
        _cpu(x)
        if x.dtype != torch.float32:
            raise ValueError(f"sincos: fp32 input (got {x.dtype})")
        x = x.contiguous()
        s, c = torch.empty_like(x), torch.empty_like(x)
        if x.numel():
            _run(self.lib, "sincos", ref, (x.data_ptr(), x.numel(), s.data_ptr(), c.data_ptr(), self._nt(threads)))
        return s, c

    # -- row reductions -------------------------------------------------------------------------------
    def _reduce(self, op: str, x: torch.Tensor, ref: bool, threads: int | None) -> torch.Tensor:
        _cpu(x)
        if x.dtype != torch.float32:
            raise ValueError(f"{op}: fp32 input (got {x.dtype})")
        x2, rows, n, ld = _rows(x)
        out = torch.empty(x.shape[:-1], dtype=torch.float32)
        if out.numel():
            _run(self.lib, op, ref, (x2.data_ptr(), rows, n, ld, out.data_ptr(), self._nt(threads)))
        return out

    def row_sum(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """fp32 [...]: the ordered sum over the last dim of fp32 x [..., L]."""
        return self._reduce("row_sum", x, False, threads)

    def row_max(self, x: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """fp32 [...]: the max over the last dim (any NaN -> NaN, +0 above -0)."""
        return self._reduce("row_max", x, False, threads)

    # -- rms_norm -------------------------------------------------------------------------------------
    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, ref: bool, threads: int | None):
        _cpu(x, weight)
        xd, wd = _dtype(x, "rms_norm x"), _dtype(weight, "rms_norm weight")
        h = x.shape[-1]
        if weight.shape != (h,):
            raise ValueError(f"rms_norm: weight {tuple(weight.shape)} for x {tuple(x.shape)}")
        x2, rows, _, ld = _rows(x.detach())
        w = weight.detach().contiguous()
        out = torch.empty(x.shape, dtype=x.dtype)
        if out.numel():
            ints = (x2.data_ptr(), xd, rows, h, ld, w.data_ptr(), wd, out.data_ptr(), self._nt(threads))
            _run(self.lib, "rms_norm", ref, ints, (float(eps),))
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, threads: int | None = None):
        """x [..., H] (fp32/bf16) normalised by its ordered RMS and scaled by weight [H]; x.dtype."""
        if _tracked(x, weight):
            return _PlainGrad.apply(
                lambda a, b: self._rms_norm(a, b, eps, False, threads),
                lambda a, b: plain_rms_norm(a, b, eps),
                x,
                weight,
            )
        return self._rms_norm(x, weight, eps, False, threads)

    # -- swiglu ---------------------------------------------------------------------------------------
    def _swiglu(self, gate: torch.Tensor, up: torch.Tensor, ref: bool, threads: int | None) -> torch.Tensor:
        _cpu(gate, up)
        gd, ud = _dtype(gate, "swiglu gate"), _dtype(up, "swiglu up")
        if gate.shape != up.shape:
            raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
        g, u = gate.detach().contiguous(), up.detach().contiguous()
        out = torch.empty(gate.shape, dtype=gate.dtype)
        if out.numel():
            ints = (g.data_ptr(), gd, u.data_ptr(), ud, g.numel(), out.data_ptr(), gd, self._nt(threads))
            _run(self.lib, "swiglu", ref, ints)
        return out

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """(g / (exp(-g) + 1)) * u in fp32, rounded once to gate.dtype."""
        if _tracked(gate, up):
            return _PlainGrad.apply(lambda a, b: self._swiglu(a, b, False, threads), plain_swiglu, gate, up)
        return self._swiglu(gate, up, False, threads)

    # -- logprobs -------------------------------------------------------------------------------------
    def _logprobs(self, logits, tokens, vocab_size: int, temperature: float, ref: bool, threads: int | None):
        _cpu(logits, tokens)
        xd = _dtype(logits, "logprobs logits")
        t = logprob_temperature(temperature)
        if not math.isfinite(t):
            raise ValueError(f"logprobs: temperature must be finite (got {temperature})")
        if not 0 < vocab_size <= logits.shape[-1]:
            raise ValueError(f"logprobs: vocab_size {vocab_size} for logits of width {logits.shape[-1]}")
        if tokens.shape != logits.shape[:-1]:
            raise ValueError(f"logprobs: tokens {tuple(tokens.shape)} for logits {tuple(logits.shape)}")
        x2, rows, _, ld = _rows(logits.detach()[..., :vocab_size])
        tok = tokens.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(tokens.shape, dtype=torch.float32)
        if out.numel():
            ints = (x2.data_ptr(), xd, rows, vocab_size, ld, tok.data_ptr(), out.data_ptr(), self._nt(threads))
            _run(self.lib, "logprobs", ref, ints, (t,))
        return out

    def logprobs(self, logits, tokens, vocab_size: int, temperature: float, threads: int | None = None):
        """fp32 log_softmax(logits[..., :vocab_size] / T) at `tokens` (T <= 0 means 1), the ordered recipe."""
        if _tracked(logits):
            return _PlainGrad.apply(
                lambda a, b: self._logprobs(a, b, vocab_size, temperature, False, threads),
                lambda a, b: plain_logprobs(a, b, vocab_size, temperature),
                logits,
                tokens,
            )
        return self._logprobs(logits, tokens, vocab_size, temperature, False, threads)

    # -- rope -----------------------------------------------------------------------------------------
    def _rope(self, positions: torch.Tensor, head_dim: int, theta: float, ref: bool, threads: int | None):
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"rope_cos_sin: head_dim must be even and >= 2 (got {head_dim})")
        if not (math.isfinite(theta) and theta >= 1.0):
            raise ValueError(f"rope_cos_sin: theta must be finite and >= 1 (got {theta})")
        pos = positions.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
        cos = torch.empty(pos.numel(), head_dim, dtype=torch.float32)
        sin = torch.empty(pos.numel(), head_dim, dtype=torch.float32)
        if pos.numel():
            ints = (pos.data_ptr(), pos.numel(), head_dim, cos.data_ptr(), sin.data_ptr(), self._nt(threads))
            _run(self.lib, "rope", ref, ints, (float(theta),))
        return cos.to(positions.device), sin.to(positions.device)

    def rope_cos_sin(self, positions: torch.Tensor, head_dim: int, theta: float, threads: int | None = None):
        """fp32 (cos, sin) [len(positions), head_dim], rotate-half layout (tables built on the CPU, then
        moved to positions' device)."""
        return self._rope(positions, head_dim, theta, False, threads)

    def inv_freq(self, head_dim: int, theta: float) -> torch.Tensor:
        """fp32 [head_dim/2]: RoPE's inverse frequencies (one scalar routine, every path)."""
        out = torch.empty(head_dim // 2, dtype=torch.float32)
        _run(self.lib, "inv_freq", True, (head_dim, out.data_ptr()), (float(theta),))
        return out

    # -- the scalar reference (tests) -----------------------------------------------------------------
    def reference_exp(self, x: torch.Tensor) -> torch.Tensor:
        return self._elementwise("exp", x, None, True, 1)

    def reference_log(self, x: torch.Tensor) -> torch.Tensor:
        return self._elementwise("log", x, None, True, 1)

    def reference_sincos(self, x: torch.Tensor):
        return self.sincos(x, True, 1)

    def reference_row_sum(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce("row_sum", x, True, 1)

    def reference_row_max(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce("row_max", x, True, 1)

    def reference_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._rms_norm(x, weight, eps, True, 1)

    def reference_swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self._swiglu(gate, up, True, 1)

    def reference_logprobs(self, logits, tokens, vocab_size: int, temperature: float) -> torch.Tensor:
        return self._logprobs(logits, tokens, vocab_size, temperature, True, 1)

    def reference_rope_cos_sin(self, positions: torch.Tensor, head_dim: int, theta: float):
        return self._rope(positions, head_dim, theta, True, 1)


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
