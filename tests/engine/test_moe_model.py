"""The MoE model is really Qwen3-MoE: a random transformers Qwen3MoeForCausalLM, saved and loaded
here, gives the same logits (fp32 max abs <= 1e-4, bf16 <= 2e-2); our save_hf output loads back into
transformers; config.json's `num_experts` and `num_local_experts` are both read."""

from __future__ import annotations

import json

import pytest
import torch

from tonpolicy.config.model import ModelConfig
from tonpolicy.kernels import get_kernels
from tonpolicy.model.checkpoint import init_state_dict, load_hf, read_config, save_hf
from tonpolicy.model.qwen3_moe import Qwen3Moe

transformers = pytest.importorskip("transformers")

# bf16: measured 0.011-0.021 for the contract on route-agreeing tokens over 4 inputs (transformers' own bf16
# model: 0.017-0.13 from the same reference, route flips included).
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
VOCAB = 300


def _hf_model(norm_topk: bool, dtype: torch.dtype):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=norm_topk,
        mlp_only_layers=[1],
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.05)
    return model.to(dtype)


@pytest.mark.parametrize("norm_topk", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", ["ordered", "plain"])
def test_hf_moe_logits_match(tmp_path, norm_topk, dtype, kernels):
    """Against transformers in fp32 on the same weights. bf16: a token whose expert set differs from
    the fp32 reference at some layer (a near-tie that bf16 rounding tips: a few percent of tokens) has
    other numbers by design; the tolerance holds on the tokens whose routes agree everywhere."""
    hf = _hf_model(norm_topk, dtype)
    hf.save_pretrained(tmp_path)
    cfg, sd = load_hf(tmp_path)
    assert cfg.family == "qwen3_moe" and cfg.num_experts == 8 and cfg.mlp_only_layers == [1]
    assert cfg.norm_topk_prob == norm_topk and not cfg.is_moe_layer(1) and cfg.is_moe_layer(2)
    ours = Qwen3Moe(cfg, get_kernels(kernels), dtype, state_dict=sd)
    ours.routes = {}
    ids = torch.randint(0, VOCAB, (45,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf.float()(ids[None], output_router_logits=True)
    ref = out.logits[0]
    got = ours(ids)[:, :VOCAB]
    assert ref.std() > 0.1
    hf_routes = [torch.topk(r.float(), 2, dim=-1).indices.sort(dim=-1).values for r in out.router_logits]
    ours_routes = [ours.routes[li].experts for li in sorted(ours.routes)]
    assert len(hf_routes) == len(ours_routes) == 2
    agree = torch.stack([(a == b).all(-1) for a, b in zip(ours_routes, hf_routes, strict=True)]).all(0)
    if dtype == torch.float32:
        assert bool(agree.all())
    assert agree.float().mean() >= 0.9
    diff = (got - ref)[agree].abs().max().item()
    assert diff < TOL[dtype], diff


def test_save_hf_moe_loads_in_transformers(tmp_path):
    cfg = ModelConfig(
        family="qwen3_moe",
        architecture="Qwen3MoeForCausalLM",
        num_layers=3,
        hidden_size=64,
        intermediate_size=96,
        vocab_size=VOCAB,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
        init_std=0.1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    )
    sd = init_state_dict(cfg, torch.float32, seed=3)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in sd and "model.layers.0.mlp.gate_proj.weight" in sd
    save_hf(sd, cfg, tmp_path)
    hf_json = json.loads((tmp_path / "config.json").read_text())
    assert hf_json["architectures"] == ["Qwen3MoeForCausalLM"] and hf_json["num_experts"] == 4
    cfg2, sd2 = load_hf(tmp_path)
    assert sd2.keys() == sd.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    for f in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers"):
        assert getattr(cfg2, f) == getattr(cfg, f), f
    hf = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.arange(0, VOCAB, 7)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = Qwen3Moe(cfg2, get_kernels("ordered"), torch.float32, state_dict=sd2)(ids)[:, :VOCAB]
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("key", ["num_experts", "num_local_experts"])
def test_expert_count_read_under_both_names(tmp_path, key):
    hf = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    ).to_dict()
    for k in ("num_experts", "num_local_experts"):
        hf.pop(k, None)
    hf.update({key: 6, "architectures": ["Qwen3MoeForCausalLM"]})
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert read_config(tmp_path).num_experts == 6
