"""One cell of the instruction-set matrix (tests/kernels/test_isa_matrix.py), run in a fresh process under the
cell's caps: prints a JSON line with the host check's failures, a hash of the contract GEMMs' bits (v2's
ordered GEMM and v1's exact one), a hash of a whole v2 forward (greedy generation over a mixed batch:
logits' argmax and logprobs, bf16 and fp32, dense and MoE), the runtime fingerprints engines report,
and how many rows the pre-exact strategy (library GEMMs in fixed row tiles) got wrong (the negative control)."""

from __future__ import annotations

import hashlib
import json

import torch

from tonpolicy.config.compose import compose_config
from tonpolicy.contract.host import host_problems
from tonpolicy.kernels import get_kernels
from tonpolicy.kernels.invariant import exact_gemm, ordered_gemm


def old_strategy_mismatches() -> int:
    """Rows whose bits differ between a 512-row library GEMM and 4-row tiles (zero-padded), the tiling the
    kernels used before the exact GEMM: fp32 through MKL, bf16 through oneDNN."""
    bad = 0
    for _dt, k, n, x, w, big in _library_gemms():
        tiles = torch.bmm(x[:16].reshape(4, 4, k), w.t().unsqueeze(0).expand(4, k, n)).reshape(16, n)
        bad += int((big[:16] != tiles).any(dim=1).sum())
    return bad


def single_row_mismatches() -> int:
    """Rows whose bits differ between a 512-row library GEMM and the same row alone (a one-request decode
    through the library): where the 4-row tiling happens to hold (AMD hosts), this still breaks."""
    bad = 0
    for _dt, _k, _n, x, w, big in _library_gemms():
        alone = torch.cat([torch.mm(x[i : i + 1], w.t()) for i in range(16)])
        bad += int((big[:16] != alone).any(dim=1).sum())
    return bad


def _library_gemms() -> list[tuple]:
    out = []
    for dt in (torch.float32, torch.bfloat16):
        for k, n in ((128, 256), (1024, 1024)):
            g = torch.Generator().manual_seed(k + n)
            x = torch.randn(512, k, generator=g).to(dt)
            w = (torch.randn(n, k, generator=g) * k**-0.5).to(dt)
            out.append((dt, k, n, x, w, torch.mm(x, w.t())))
    return out


def gemm_hash() -> str:
    h = hashlib.sha256()
    k = get_kernels("ordered")
    for dt in (torch.float32, torch.bfloat16):
        # integer draws scaled by a power of two: the same values under every cap (randn is not: its
        # vectorised Box-Muller follows the CPU capability)
        g = torch.Generator().manual_seed(1)
        x = (torch.randint(-(2**15), 2**15, (37, 384), generator=g).double() * 2**-14).to(dt)
        w = (torch.randint(-(2**15), 2**15, (256, 384), generator=g).double() * 2**-20).to(dt)
        h.update(k.linear(x, w).float().numpy().tobytes())
        h.update(k.linear_k_sharded(x, w).float().numpy().tobytes())
        h.update(exact_gemm.matmul_as(x.float(), dt, w.float().t(), dt).numpy().tobytes())
    return h.hexdigest()


def _integer_draws(shape: tuple[int, ...], g: torch.Generator, scale: float) -> torch.Tensor:
    """Values that are the same under every cap (randn is not: its vectorised Box-Muller follows the CPU
    capability): integers scaled by a power of two."""
    return torch.randint(-(2**12), 2**12, shape, generator=g).double() * scale


def forward_hash(kernel_set: str = "ordered") -> str:
    """A whole forward under a contract's kernel set, of the default model (bf16 and fp32) and of the tiny MoE
    (fp32: its routing softmax too): greedy generation of several prompts of different lengths, 4 at a time
    (prefill and decode rows in one batch), every token's id and logprob."""
    from tonpolicy.model.checkpoint import param_shapes
    from tonpolicy.model.qwen3 import Qwen3
    from tonpolicy.model.qwen3_moe import Qwen3Moe
    from tonpolicy.rollout.engine import Engine, GenRequest

    dense, moe = compose_config().model, compose_config(["model=qwen3_moe_tiny"]).model
    h = hashlib.sha256()
    for cfg, model_class, dt in (
        (dense, Qwen3, torch.float32),
        (dense, Qwen3, torch.bfloat16),
        (moe, Qwen3Moe, torch.float32),
    ):
        g = torch.Generator().manual_seed(2)
        sd = {}
        for name, shape in param_shapes(cfg).items():
            w = 1.0 + _integer_draws(shape, g, 2**-15) if len(shape) == 1 else _integer_draws(shape, g, 2**-17)
            sd[name] = w.to(dt)
        engine = Engine(model_class(cfg, get_kernels(kernel_set), dt, sd), max_running_requests=4)
        prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 33, 70, 1, 17, 40)]
        for r in engine.generate([GenRequest(p, 6, temperature=0.0) for p in prompts]):
            h.update(json.dumps([r.output_ids, [float(x).hex() for x in r.output_logprobs]]).encode())
    return h.hexdigest()


def runtime_fingerprint(kernel_set: str) -> str:
    """The runtime fingerprint an engine under this cell reports (what the handshake compares)."""
    from tonpolicy.contract.identity import runtime_identity

    return runtime_identity(get_kernels(kernel_set), "bfloat16", "cpu")["fingerprint"]


def main() -> None:
    problems = []
    for dtype in ("bfloat16", "float32"):
        cfg = compose_config([f"contract.dtype={dtype}"])
        problems += host_problems(cfg.model, cfg.contract)
    print(
        json.dumps(
            {
                "capability": torch.backends.cpu.get_cpu_capability(),
                "problems": problems,
                "gemm_hash": gemm_hash(),
                "forward_hash": forward_hash(),
                "v1_forward_hash": forward_hash("invariant"),
                "runtime_fingerprint": runtime_fingerprint("ordered"),
                "v1_runtime_fingerprint": runtime_fingerprint("invariant"),
                "ordered_isa": ordered_gemm.chosen_path(),
                "old_mismatches": old_strategy_mismatches(),
                "single_row_mismatches": single_row_mismatches(),
            }
        )
    )


if __name__ == "__main__":
    main()
