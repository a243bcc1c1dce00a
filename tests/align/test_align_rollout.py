"""The rollout dumper: the engine's decode path against a full forward of the same model.

Under `invariant` they must match bit for bit; a checkpoint forced onto the `plain` kernels must be
reported at exactly that (layer, op); `plain` everywhere (the negative control) must diverge.
"""

from __future__ import annotations

import pytest
import torch

from tonpolicy.align.compare import compare_dumps
from tonpolicy.align.names import Checkpoint, checkpoint
from tonpolicy.align.recorder import Selection
from tonpolicy.align.rollout_dump import decode_dump, full_forward_dump
from tonpolicy.config.model import ModelConfig
from tonpolicy.kernels import get_kernels
from tonpolicy.model.qwen3 import Qwen3
from tonpolicy.rollout.engine.generation import GenRequest

CFG = ModelConfig()
PROMPT = [3, 11, 12, 13, 14, 15, 4]
_MODELS: dict[tuple[str, torch.dtype], Qwen3] = {}


def _model(kernels: str = "ordered", dtype: torch.dtype = torch.bfloat16) -> Qwen3:
    if (kernels, dtype) not in _MODELS:
        _MODELS[(kernels, dtype)] = Qwen3(CFG, get_kernels(kernels), dtype)
    return _MODELS[(kernels, dtype)]


def _request(new: int = 5) -> GenRequest:
    return GenRequest(list(PROMPT), new, temperature=1.0, seed=11)


@pytest.mark.parametrize("chunk", [None, 3])
def test_decode_matches_full_forward_and_engine_logprobs(chunk: int | None) -> None:
    model = _model()
    plain = model.kernels
    dump, response, engine_lps = decode_dump(model, _request(), Selection(), chunked_prefill_size=chunk)
    # Nothing stays installed once the dump is taken.
    assert model.kernels is plain and not {"forward_segments", "fused"} & set(model.__dict__)
    n, p = len(dump.tokens), len(PROMPT)
    assert dump.tokens == PROMPT + response and len(response) == 5
    lp = Checkpoint(CFG.num_layers, "logprobs")
    # The decode step that sampled token t is the trainer's position t-1.
    assert dump.positions[lp] == list(range(p - 1, n - 1))
    assert torch.equal(dump.tensors[lp].flatten(), engine_lps)
    assert dump.positions[checkpoint(2, "q_rope", CFG.num_layers)] == list(range(n - 1))
    assert dump.tensors[checkpoint(2, "q_rope", CFG.num_layers)].shape == (n - 1, CFG.q_size)
    assert dump.tensors[Checkpoint(CFG.num_layers, "logits")].shape == (n - p, CFG.vocab_size)
    full = full_forward_dump(model, dump.tokens, p, 1.0, Selection())
    report = compare_dumps(dump, full)
    assert report.match, report.first
    assert len(report.checkpoints) == 1 + 17 * CFG.num_layers + 3


@pytest.mark.parametrize(
    ("dtype", "layer", "op"),
    [
        (torch.bfloat16, 2, "input_norm"),
        (torch.bfloat16, 1, "k_rope"),
        (torch.bfloat16, 3, "attn_out"),
        (torch.bfloat16, 0, "mlp_act"),
        (torch.float32, 2, "v"),
        (torch.float32, 1, "o_proj"),
        (torch.float32, 0, "logits"),
    ],
)
def test_perturbed_op_is_reported_at_exactly_that_layer_and_op(dtype: torch.dtype, layer: int, op: str) -> None:
    model = _model(dtype=dtype)
    target = checkpoint(layer, op, CFG.num_layers)
    dump, _, _ = decode_dump(model, _request(4), Selection(), perturb={target: get_kernels("plain")})
    report = compare_dumps(dump, full_forward_dump(model, dump.tokens, len(PROMPT), 1.0, Selection()))
    assert not report.match
    assert (report.first.layer, report.first.op) == (target.layer, op)
    before = [c for c in report.checkpoints if Checkpoint(c.layer, c.op).sort_key() < target.sort_key()]
    assert before and all(c.mismatched_elements == 0 for c in before)


def test_plain_kernels_are_a_negative_control() -> None:
    model = _model("plain")
    dump, _, _ = decode_dump(model, _request(), Selection())
    report = compare_dumps(dump, full_forward_dump(model, dump.tokens, len(PROMPT), 1.0, Selection()))
    assert not report.match and report.first is not None


def test_selection_bounds_what_is_kept() -> None:
    model = _model()
    p = len(PROMPT)
    sel = Selection(layers={1}, positions={0, p - 1, p + 1}, ops={"embed", "q", "mlp_act", "residual", "logprobs"})
    dump, _, _ = decode_dump(model, _request(), sel)
    names = {ck.name: pos for ck, pos in dump.positions.items()}
    assert names == {
        "embed": [0, p - 1, p + 1],
        "layers.1.q": [0, p - 1, p + 1],
        "layers.1.mlp_act": [0, p - 1, p + 1],
        "layers.1.residual": [0, p - 1, p + 1],
        "logprobs": [p - 1, p + 1],
    }
    assert (
        sum(t.numel() for t in dump.tensors.values())
        == 3 * (CFG.hidden_size * 2 + CFG.q_size + CFG.intermediate_size) + 2
    )
