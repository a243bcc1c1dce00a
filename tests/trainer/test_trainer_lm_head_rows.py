"""The kernel spec's LM head over the loss's rows only (`layer_spec.lm_head_rows`): the picked rows'
logits keep the whole-sequence bits (the contract's row invariance), the rest are zero, and the head's
gradients are those of the whole-sequence head. Real GPTModel at TP=2 (gloo, 2 processes).
Negative control: the plain kernels' head on one picked row gives other bits (a plain GEMM's row
depends on the row count)."""

from __future__ import annotations

import torch
from support.trainer_common import random_hf

from tonpolicy.config.model import ModelConfig
from tonpolicy.trainer.process_groups import Layout, spawn

PICKS = {"three": [5, 6, 17], "one": [9]}


def _head_grads(model: torch.nn.Module) -> torch.Tensor:
    """The LM head weight's gradient (the embedding's, when tied: both runs embed alike)."""
    w = model.output_layer.weight
    w = w if w is not None else model.shared_embedding_or_output_weight()
    return w.grad.detach().clone()


def _worker(kernel_set: str, dtype: torch.dtype) -> dict[str, float]:
    from tonpolicy.kernels import get_kernels, padded_vocab_size
    from tonpolicy.trainer.cp_layout import TokenPositions
    from tonpolicy.trainer.kernel_modules import lm_head_rows
    from tonpolicy.trainer.model import build_gpt
    from tonpolicy.trainer.process_groups import init_distributed
    from tonpolicy.trainer.weights import load_into

    cfg = ModelConfig()
    init_distributed(Layout(tp=2))
    model = build_gpt(cfg, dtype, "kernels", "ulysses", get_kernels(kernel_set), canonical_shards=4)
    load_into(model, random_hf(cfg, seed=3), cfg, padded_vocab_size(cfg.vocab_size, 4))
    ids = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(5))
    pos = torch.arange(24)[None]

    def forward() -> torch.Tensor:
        return model(ids, pos, None, packed_seq_params=TokenPositions(positions=pos))  # [1, 24, V/TP]

    out: dict[str, float] = {}
    for name, pick in PICKS.items():
        rows = torch.tensor(pick)
        model.zero_grad()
        full = forward()
        full[0, rows].float().square().sum().backward()
        ref_grad = _head_grads(model)
        model.zero_grad()
        with lm_head_rows(model, rows):
            part = forward()
        part[0, rows].float().square().sum().backward()
        others = torch.ones(24, dtype=torch.bool)
        others[rows] = False
        out[f"{name}_equal"] = float(torch.equal(part[0, rows], full[0, rows]))
        out[f"{name}_others_zero"] = float(bool((part[0, others] == 0).all()))
        out[f"{name}_grad_err"] = float((_head_grads(model) - ref_grad).abs().max() / ref_grad.abs().max())
    # Outside the block the head is whole again.
    out["restored"] = float(torch.equal(forward(), full))
    return out


def test_lm_head_rows_keep_the_whole_sequence_bits() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        r = spawn(_worker, 2, "ordered", dtype)
        print(dtype, r)
        for name in PICKS:
            assert r[f"{name}_equal"] == 1.0, (dtype, name)
            assert r[f"{name}_others_zero"] == 1.0, (dtype, name)
            assert r[f"{name}_grad_err"] < (1e-2 if dtype == torch.bfloat16 else 1e-5), (dtype, name)
        assert r["restored"] == 1.0


def test_plain_kernels_head_on_one_row_is_not_the_whole_sequence_bits() -> None:
    r = spawn(_worker, 2, "plain", torch.float32)
    print(r)
    assert r["one_equal"] == 0.0
