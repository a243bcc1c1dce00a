"""A saved checkpoint is a complete HF model directory: every non-weight file of the checkpoint the
model came from (tokenizer, chat template, generation_config.json), its config.json with every key
(only the dtype follows the weights), weights sharded with an index past the shard size, files 0644;
transformers loads it and it reads back bit for bit."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import torch

from tonpolicy.config.model import ModelConfig
from tonpolicy.model.checkpoint import init_state_dict, load_hf, read_config, save_hf

EXTRA = {"bos_token_id": 7, "eos_token_id": 3, "a_key_tonpolicy_does_not_know": [1, 2]}


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "source"
    save_hf(init_state_dict(ModelConfig(), torch.float32, 0), ModelConfig(), src)
    hf = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**hf, **EXTRA}))
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": 3, "temperature": 0.6}))
    (src / "chat_template.jinja").write_text("{{ messages }}")
    return src


def test_a_saved_checkpoint_carries_the_source_files_and_reads_back(tmp_path: Path) -> None:
    src = _source(tmp_path)
    cfg, sd = load_hf(src)
    assert cfg.checkpoint == str(src)
    trained = {k: (v * 1.5).to(torch.bfloat16) for k, v in sd.items()}
    out = tmp_path / "step_1"
    save_hf(trained, cfg, out, max_shard_bytes=200_000)

    names = {p.name for p in out.iterdir()}
    assert {"generation_config.json", "chat_template.jinja", "tokenizer.json"} <= names
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    assert len(shards) > 1 and "model.safetensors.index.json" in names and "model.safetensors" not in names
    # Each shard within the size, or one tensor alone that is larger (as Hugging Face shards).
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    for shard in shards:
        held = [trained[k] for k, f in weight_map.items() if f == shard]
        assert len(held) == 1 or sum(t.numel() * t.element_size() for t in held) <= 200_000, shard
    assert all(stat.S_IMODE((out / n).stat().st_mode) == 0o644 for n in names)
    source_hf, saved_hf = (json.loads((d / "config.json").read_text()) for d in (src, out))
    assert saved_hf == {**source_hf, "torch_dtype": "bfloat16", "dtype": "bfloat16"}
    _, back = load_hf(out)
    assert back.keys() == trained.keys() and all(torch.equal(back[k], trained[k]) for k in back)
    assert read_config(out).family == cfg.family


def test_transformers_loads_a_sharded_checkpoint(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = _source(tmp_path)
    cfg, sd = load_hf(src)
    save_hf(sd, cfg, tmp_path / "out", max_shard_bytes=200_000)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out", torch_dtype=torch.float32)
    loaded = dict(model.named_parameters())
    assert torch.equal(loaded["model.embed_tokens.weight"], sd["model.embed_tokens.weight"])
    assert model.generation_config.eos_token_id == 3
    assert AutoTokenizer.from_pretrained(tmp_path / "out").vocab_size == cfg.vocab_size
