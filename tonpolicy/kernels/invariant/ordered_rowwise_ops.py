"""Contract v2's row-wise ops on one path's library: the arguments checked and laid out as rows, the
library called, the differentiable ops given the plain formula's gradient (ordered_rowwise states the
definition and runs these on the chosen path)."""

from __future__ import annotations

import math

import torch

from tonpolicy.kernels import logprob_temperature
from tonpolicy.kernels.invariant.ordered_rowwise_grad import (
    PlainGrad,
    plain_logprobs,
    plain_rms_norm,
    plain_swiglu,
    tracked,
)
from tonpolicy.kernels.invariant.ordered_rowwise_lib import library, run

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


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
            run(self.lib, op, ref, (src.data_ptr(), dst.data_ptr(), src.numel(), self._nt(threads)))
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
            run(self.lib, "sincos", ref, (x.data_ptr(), x.numel(), s.data_ptr(), c.data_ptr(), self._nt(threads)))
        return s, c

    # -- row reductions -------------------------------------------------------------------------------
    def _reduce(self, op: str, x: torch.Tensor, ref: bool, threads: int | None) -> torch.Tensor:
        _cpu(x)
        if x.dtype != torch.float32:
            raise ValueError(f"{op}: fp32 input (got {x.dtype})")
        x2, rows, n, ld = _rows(x)
        out = torch.empty(x.shape[:-1], dtype=torch.float32)
        if out.numel():
            run(self.lib, op, ref, (x2.data_ptr(), rows, n, ld, out.data_ptr(), self._nt(threads)))
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
            run(self.lib, "rms_norm", ref, ints, (float(eps),))
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, threads: int | None = None):
        """x [..., H] (fp32/bf16) normalised by its ordered RMS and scaled by weight [H]; x.dtype."""
        if tracked(x, weight):
            return PlainGrad.apply(
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
            run(self.lib, "swiglu", ref, ints)
        return out

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, threads: int | None = None) -> torch.Tensor:
        """(g / (exp(-g) + 1)) * u in fp32, rounded once to gate.dtype."""
        if tracked(gate, up):
            return PlainGrad.apply(lambda a, b: self._swiglu(a, b, False, threads), plain_swiglu, gate, up)
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
            run(self.lib, "logprobs", ref, ints, (t,))
        return out

    def logprobs(self, logits, tokens, vocab_size: int, temperature: float, threads: int | None = None):
        """fp32 log_softmax(logits[..., :vocab_size] / T) at `tokens` (T <= 0 means 1), the ordered recipe."""
        if tracked(logits):
            return PlainGrad.apply(
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
            run(self.lib, "rope", ref, ints, (float(theta),))
        return cos.to(positions.device), sin.to(positions.device)

    def rope_cos_sin(self, positions: torch.Tensor, head_dim: int, theta: float, threads: int | None = None):
        """fp32 (cos, sin) [len(positions), head_dim], rotate-half layout (tables built on the CPU, then
        moved to positions' device)."""
        return self._rope(positions, head_dim, theta, False, threads)

    def inv_freq(self, head_dim: int, theta: float) -> torch.Tensor:
        """fp32 [head_dim/2]: RoPE's inverse frequencies (one scalar routine, every path)."""
        out = torch.empty(head_dim // 2, dtype=torch.float32)
        run(self.lib, "inv_freq", True, (head_dim, out.data_ptr()), (float(theta),))
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
