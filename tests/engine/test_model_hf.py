"""The model is really Qwen3: a random tiny transformers Qwen3ForCausalLM, saved and loaded here,
gives the same logits within a stated tolerance; our save_hf output loads back into transformers."""

from __future__ import annotations

import pytest
import torch

from tonpolicy.config.model import ModelConfig
from tonpolicy.kernels import get_kernels
from tonpolicy.model import Qwen3, init_state_dict, load_hf, save_hf

transformers = pytest.importorskip("transformers")

# Tolerances on logits (std ~1.6, max ~7 here). fp32: exact-math-equivalent formulas (rsqrt vs
# 1/sqrt, fp32 RoPE/SwiGLU) differ by float rounding only: 1e-4. bf16: HF rounds to bf16 after every op
# (RoPE, silu, norm-weight product) while the contract rounds once per op group, so the two differ by
# bf16 noise: 0.25 absolute, and our distance to the fp32 HF model must be at most 1.5x HF bf16's own.
TOL = {torch.float32: 1e-4, torch.bfloat16: 0.25}


def _hf_model(tied: bool, dtype: torch.dtype):
    cfg = transformers.Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():  # non-trivial norm weights
            if n.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.mul_(10.0)  # default init std 0.02 gives near-uniform logits; sharpen them
    return model.to(dtype)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", ["ordered", "plain"])
def test_hf_logits_match(tmp_path, tied, dtype, kernels):
    hf = _hf_model(tied, dtype)
    hf.save_pretrained(tmp_path)
    cfg, sd = load_hf(tmp_path)
    assert cfg.tie_word_embeddings == tied and cfg.num_kv_heads == 2 and cfg.head_dim == 32
    ours = Qwen3(cfg, get_kernels(kernels), dtype, state_dict=sd)
    ids = torch.randint(0, 300, (45,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    got = ours(ids)
    assert got.shape[1] >= 300 and torch.all(got[:, 300:] == 0)
    diff = (got[:, :300] - ref).abs().max().item()
    assert ref.std() > 0.5
    assert diff < TOL[dtype], diff
    if dtype == torch.bfloat16:
        hf32 = _hf_model(tied, torch.float32)
        with torch.no_grad():
            ref32 = hf32(ids[None]).logits[0]
        ours_err = (got[:, :300] - ref32).abs().max().item()
        hf_err = (ref - ref32).abs().max().item()
        assert ours_err <= 1.5 * hf_err, (ours_err, hf_err)


@pytest.mark.parametrize("tied", [True, False])
def test_save_hf_loads_in_transformers(tmp_path, tied):
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=300,
        num_attention_heads=4,
        num_kv_heads=2,
        head_dim=16,
        tie_word_embeddings=tied,
        init_std=0.2,
    )
    sd = init_state_dict(cfg, torch.float32, seed=3)
    save_hf(sd, cfg, tmp_path)
    cfg2, sd2 = load_hf(tmp_path)
    assert sd2.keys() == sd.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    for f in (
        "num_layers",
        "hidden_size",
        "num_kv_heads",
        "head_dim",
        "vocab_size",
        "rope_theta",
        "tie_word_embeddings",
    ):
        assert getattr(cfg2, f) == getattr(cfg, f)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = torch.arange(0, 300, 7)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    got = Qwen3(cfg2, get_kernels("ordered"), torch.float32, state_dict=sd2)(ids)[:, :300]
    assert (got - ref).abs().max().item() < 1e-4


def test_init_state_dict_deterministic():
    cfg = ModelConfig()
    a, b = init_state_dict(cfg, torch.bfloat16, 7), init_state_dict(cfg, torch.bfloat16, 7)
    c = init_state_dict(cfg, torch.bfloat16, 8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert "lm_head.weight" not in a and "model.layers.3.self_attn.q_norm.weight" in a


def test_sharded_index_cannot_point_outside_the_checkpoint(tmp_path) -> None:
    import json as _json

    import pytest as _pytest

    from tonpolicy.model.checkpoint import load_hf as _load

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(
        _json.dumps(
            {
                "num_hidden_layers": 1,
                "hidden_size": 8,
                "num_attention_heads": 1,
                "intermediate_size": 8,
                "vocab_size": 8,
            }
        )
    )
    (ckpt / "model.safetensors.index.json").write_text(_json.dumps({"weight_map": {"w": "../secret.safetensors"}}))
    with _pytest.raises(ValueError, match="outside the checkpoint directory"):
        _load(ckpt)
