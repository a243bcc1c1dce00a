"""The fp32 mode that the contract's torch operations assume: gradual underflow (IEEE), never FTZ/DAZ.

The compiled kernels (ordered_gemm, ordered_rowwise) set MXCSR themselves for each call in every thread, so a
caller's mode changes nothing there. Operations that run through torch cannot: `torch.set_flush_denormal(True)`
(or a library built with -ffast-math) puts FTZ|DAZ in the calling thread's MXCSR, and torch's intra-op
threads take the mode of the thread that starts them and keep it. contract.quant=fp8_block's final combine
(y = y + S_b * (sa * sw), docs/REDUCTION_RULES.md) is defined with gradual underflow, so a process whose
threads flush is refused rather than given other bits.
"""

from __future__ import annotations

import torch

SETTING = "torch.set_flush_denormal(True)"
_TINY = 2.0**-140  # subnormal in fp32: FTZ zeroes the product, DAZ the operand
_STRIDE = 1024
# Thread counts whose intra-op threads were seen not to flush. A pool takes the starter's mode when it
# grows, and it grows only to a thread count not seen yet, so a count is probed once.
_threads_checked: set[int] = set()


class FlushDenormalError(RuntimeError):
    pass


def calling_thread_flushes() -> bool:
    return (torch.full((1,), _TINY) * 1.0).item() == 0.0


def any_thread_flushes() -> bool:
    """One subnormal product in every intra-op thread's chunk (a tensor of a whole grain per thread)."""
    x = torch.ones(32768 * torch.get_num_threads())
    x[::_STRIDE] = _TINY
    return not bool((x * 1.0)[::_STRIDE].ne(0).all())


def require_gradual_underflow(what: str) -> None:
    """Refuse, naming the setting and the rule, when this thread or torch's intra-op threads flush."""
    threads = torch.get_num_threads()
    flushes = calling_thread_flushes()
    if not flushes and threads not in _threads_checked:
        flushes = any_thread_flushes()
        if not flushes:
            _threads_checked.add(threads)
    if flushes:
        raise FlushDenormalError(
            f"{what}: subnormals are flushed to zero in this process ({SETTING}, or a library built with "
            "-ffast-math, set FTZ/DAZ); the rule is gradual underflow (IEEE fp32), so the bits would differ: "
            "call torch.set_flush_denormal(False) before torch starts its threads"
        )
