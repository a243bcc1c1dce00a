"""Each invalid combination fails before anything starts, naming key, value and rule; all at once."""

from __future__ import annotations

import json

import pytest

from tonpolicy.config.compose import compose_config
from tonpolicy.validation.validate import ConfigError, validate

CASES = [
    # (overrides, expected substring(s) of the error)
    (["parallel.tp=3"], ["parallel.tp=3: must divide model.num_attention_heads=8"]),
    (["parallel=tp4", "model.num_kv_heads=2"], ["parallel.tp=4: must divide model.num_kv_heads=2"]),
    (["model=qwen3_4b", "parallel.tp=8"], ["canonical_shards=4"]),
    (["parallel.pp=3"], ["parallel.pp=3: must divide model.num_layers=4"]),
    (["parallel.pp=2", "parallel.pp_layers=[1,2]"], ["parallel.pp_layers=[1, 2]: stages must each hold"]),
    (["parallel.cp=2"], ["parallel.cp_type='none': parallel.cp=2 needs a CP type"]),
    (["parallel=cp2_ring", "parallel.cp_type=striped"], ["parallel.cp_type='striped': must be one of"]),
    (["parallel=cp2_ring", "trainer.seq_pad_multiple=32"], ["2*cp*attention_tile=128"]),
    (
        ["parallel=cp2_ulysses", "parallel.tp=4", "model.num_attention_heads=12"],
        ["Ulysses CP needs model.num_attention_heads=12 divisible by tp*cp=8", "num_kv_heads=4 divisible by tp*cp=8"],
    ),
    (
        ["parallel=tp2", "trainer.nproc_per_node=4"],
        ["trainer.nproc_per_node=4: nnodes*nproc_per_node must equal tp*pp*cp*dp=2"],
    ),
    (["model.family=llama"], ["contract.family='qwen3': contract qwen3_dense_v2 is for family 'qwen3'"]),
    (
        ["contract.supported_cp_types=[ulysses]", "parallel=cp2_ring"],
        ["contract qwen3_dense_v2 supports CP types ['ulysses']"],
    ),
    (
        ["contract.supported_rollout_backends=[sglang]"],
        ["rollout.backend='embedded': contract qwen3_dense_v2 supports rollout backends"],
    ),
    (["experiment.temperature=0"], ["experiment.temperature=0.0: must be finite and >= 1e-06"]),
    (["experiment.max_new_tokens=0"], ["experiment.max_new_tokens=0: must be a positive integer"]),
    (["experiment.max_new_tokens=2000"], ["exceeds model.max_position_embeddings=1024"]),
    (["parallel.rollout_tp=2"], ["the embedded rollout engine runs unsharded"]),
    (
        ["rollout=sglang", "parallel.rollout_tp=3", "trainer.device=cuda"],
        ["parallel.rollout_tp=3: must divide model.num_attention_heads=8"],
    ),
    (
        ["rollout=sglang", "trainer.device=cpu", "contract.sglang.model_package=null"],
        ["SGLang's own kernels cannot reproduce its bits"],
    ),
    (
        ["rollout=sglang", "contract=off_policy", "contract.sglang.model_package=tonpolicy.inside_sglang.model"],
        ["is stock SGLang's: must be null"],
    ),
    (["rollout=sglang", "trainer.device=cpu", "contract.sglang.attention_backend=fa3"], ["runs only torch_native"]),
    (
        ["rollout=sglang", "trainer.device=cuda", "contract.sglang.rl_on_policy_target=fsdp"],
        ["round the returned logprobs to bf16"],
    ),
    (
        [
            "rollout=sglang",
            "trainer.device=cuda",
            "contract.sglang.enable_deterministic_inference=true",
            "contract.sglang.attention_backend=fa3",
        ],
        ["must be false with the model package"],
    ),
    (
        ["rollout=sglang", "rollout.python=/nonexistent/bin/python"],
        ["/nonexistent/bin/python is not an executable interpreter"],
    ),
    (
        ["contract.sglang.enable_deterministic_inference=true", "contract.sglang.attention_backend=torch_native"],
        ["SGLang deterministic inference accepts only"],
    ),
    (["mode=train"], ["mode='train': must be one of ['plan', 'run', 'align']"]),
    (["contract.kernels=contract"], ["contract.kernels='contract': must be one of", "(renamed: use 'invariant')"]),
    # Ranges of every numeric field a process acts on (each of these used to fail after start).
    (["experiment.seed=-1"], ["experiment.seed=-1: must be in [0, 4294967295]"]),
    (["experiment.seed=20000000000000"], ["experiment.seed=20000000000000: must be in [0, 4294967295]"]),
    (["experiment.temperature=1e-9"], ["experiment.temperature=1e-09: must be finite and >= 1e-06"]),
    (["experiment.temperature=inf"], ["experiment.temperature=inf: must be finite"]),
    (["rollout.health_timeout_s=-5"], ["rollout.health_timeout_s=-5.0: must be a positive number of seconds"]),
    (["rollout.chunked_prefill_size=0"], ["rollout.chunked_prefill_size=0: must be a positive integer (or null)"]),
    (["trainer.master_port=70000"], ["trainer.master_port=70000: must be in [0, 65535]"]),
    (
        ["trainer.nnodes=2"],
        [
            "trainer.nnodes=2: must divide the world size tp*pp*cp*dp=1",
            "model.checkpoint=None: several nodes start from one checkpoint",
            "trainer.master_port=0: several nodes meet at one port",
        ],
    ),
    (
        ["parallel=tp2", "trainer.nnodes=2", "trainer.node_rank=2"],
        ["trainer.node_rank=2: must be in [0, trainer.nnodes=2)"],
    ),
    (
        ["trainer.lr=nan", "trainer.kl_coef=-1", "model.rms_norm_eps=0"],
        [
            "trainer.lr=nan: must be a positive finite number",
            "trainer.kl_coef=-1.0: must be a finite number >= 0",
            "model.rms_norm_eps=0.0: must be a positive finite number",
        ],
    ),
    (["rollout.host=0.0.0.0"], ["rollout.host='0.0.0.0': binds a non-loopback address", "rollout.allow_remote=true"]),
    (
        ["model.checkpoint=/nonexistent"],
        ["model.checkpoint='/nonexistent': must be an HF checkpoint directory with config.json"],
    ),
    (
        ["experiment=parity_smoke", "parallel.pp=2", "parallel.num_microbatches=1"],
        ["parallel.num_microbatches=1: leaves 1 microbatches per replica, fewer than parallel.pp=2"],
    ),
    (
        ["experiment=parity_smoke", "parallel.pp=2", "parallel.num_microbatches=1", "trainer.micro_batch_size=1"],
        ["parallel.num_microbatches=1: is batch/(dp*micro_batch_size)=8"],
    ),
    (
        ["experiment=parity_smoke", "parallel.pp=2", "trainer.micro_batch_size=8"],
        ["leaves 1 microbatches per replica, fewer than parallel.pp=2"],
    ),
    (
        ["trainer.micro_batch_size=3"],
        ["trainer.micro_batch_size=3: parallel.dp*micro_batch_size=3 must divide the batch"],
    ),
    (["parallel=cp2_ring", "trainer.pack_sequences=true"], ["trainer.pack_sequences=True: packed rows are not split"]),
    (["parallel.dp=3"], ["parallel.dp=3: parallel.dp*micro_batch_size=3 must divide the batch"]),
    # Several nodes (mode=plan): node 0 must be reachable, a server spanning nodes needs its address.
    (["mode=plan", "parallel=tp2", "trainer.nnodes=2"], ["trainer.master_addr='127.0.0.1': is loopback"]),
    (["rollout.nnodes=2"], ["rollout.nnodes=2: must be 1, or more only with rollout=sglang"]),
    (
        ["rollout=sglang", "trainer.device=cuda", "parallel.rollout_tp=2", "rollout.nnodes=2"],
        ["rollout.dist_init_addr=None: a server spanning nodes needs host:port"],
    ),
    (
        [
            "rollout=sglang",
            "trainer.device=cuda",
            "parallel.rollout_tp=3",
            "model.num_attention_heads=12",
            "model.num_kv_heads=12",
            "rollout.nnodes=2",
            "rollout.dist_init_addr=h:1",
        ],
        ["rollout.nnodes=2: must divide parallel.rollout_tp=3"],
    ),
    (
        [
            "mode=plan",
            "rollout=sglang",
            "trainer.device=cuda",
            "parallel.rollout_tp=2",
            "rollout.nnodes=2",
            "rollout.dist_init_addr=h:1",
        ],
        ["rollout.nnodes=2: a server spanning nodes runs on every node of the plan: must equal trainer.nnodes=1"],
    ),
    (["rollout.weight_sync=nfs"], ["rollout.weight_sync='nfs': must be one of ['disk', 'distributed']"]),
    (
        ["rollout=sglang", "trainer.device=cuda", "parallel.rollout_dp=2", "rollout.weight_sync=distributed"],
        [
            "parallel.rollout_dp=2: rollout data parallelism is a fleet of servers behind sglang-router: use "
            "rollout.replicas=2"
        ],
    ),
    (
        ["rollout.replicas=0", "rollout.router_policy=manual"],
        ["rollout.replicas=0: must be a positive integer", "rollout.router_policy='manual': must be one of"],
    ),
    # The task's own keys.
    (["task=digit_copy"], ["task.graded_tokens=4: grades more tokens than experiment.max_new_tokens=1"]),
    (
        ["task.graded_tokens=0", "task.target_digit=12", "task.lr=-1", "task.max_digits=0"],
        [
            "task.graded_tokens=0: must be a positive integer",
            "task.target_digit=12: must be a digit in [0, 9]",
            "task.lr=-1.0: must be a positive finite number",
            "task.max_digits=0: must be a positive integer",
        ],
    ),
    (
        ["contract=qwen3_dense_v1", "contract.row_tile=6", "contract.prefill_row_tile=500"],
        [
            "contract.row_tile=6: must be a multiple of 4 (GEMMs of 1-3 rows take another path, other bits)",
            "contract.prefill_row_tile=500: must be a multiple of contract.row_tile=6",
        ],
    ),
    (
        ["contract.logits_dtype=fp8"],
        ["contract.logits_dtype='fp8': must be one of ['float32', 'bfloat16']"],
    ),
    (
        ["contract=off_policy", "contract.logits_dtype=bfloat16"],
        ["contract.logits_dtype='bfloat16': bfloat16 logits are a choice of the contract kernels on a bfloat16 model"],
    ),
    (
        ["task.max_digits=7"],
        ["task.max_digits=7: a prompt of 7 digits and two words exceeds experiment.max_prompt_len=8"],
    ),
]


@pytest.mark.parametrize(("overrides", "expected"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_invalid_combination_is_rejected(overrides: list[str], expected: list[str]) -> None:
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    for text in expected:
        assert text in str(info.value), str(info.value)


def test_all_errors_reported_at_once() -> None:
    cfg = compose_config(["parallel.tp=3", "parallel.pp=3", "experiment.temperature=-1", "model.family=llama"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    keys = {i.key for i in info.value.issues}
    assert {"parallel.tp", "parallel.pp", "experiment.temperature", "contract.family"} <= keys


def test_hf_config_cross_check(tmp_path) -> None:
    hf = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_hidden_layers": 36,
        "hidden_size": 2560,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 9728,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    validate(compose_config(["model=qwen3_4b", f"model.hf_config={path}"]), check_hf=False)
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["model=qwen3_4b", f"model.hf_config={path}"]))
    assert "a MoE architecture" in str(info.value)

    hf |= {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "num_hidden_layers": 40}
    path.write_text(json.dumps(hf))
    with pytest.raises(ConfigError) as info:
        validate(compose_config(["model=qwen3_4b", f"model.hf_config={tmp_path}"]))
    keys = {i.key for i in info.value.issues}
    assert keys == {"model.hidden_size", "model.num_layers"}

    hf |= {"hidden_size": 2560, "num_hidden_layers": 36}
    path.write_text(json.dumps(hf))
    validate(compose_config(["model=qwen3_4b", f"model.hf_config={path}"]))


def test_missing_hf_config_is_reported(tmp_path) -> None:
    with pytest.raises(ConfigError, match="model.hf_config=.*readable UTF-8 HF config.json"):
        validate(compose_config([f"model.hf_config={tmp_path / 'nope.json'}"]))


def test_zero_counts_do_not_hide_the_other_problems() -> None:
    cfg = compose_config(["parallel.tp=0", "experiment.temperature=-1", "model.family=llama", "trainer.master_port=-3"])
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    keys = {i.key for i in info.value.issues}
    assert {"parallel.tp", "experiment.temperature", "contract.family", "trainer.master_port"} <= keys


def test_unknown_key_added_with_plus_is_refused_with_a_suggestion() -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(["+experiment.temprature=0.5", "+trainer.foo=1"])
    text = str(info.value)
    assert "experiment.temprature=0.5: unknown key (not in the schema); did you mean experiment.temperature?" in text
    assert "trainer.foo=1: unknown key" in text


def _hf(tmp_path, body: bytes):
    path = tmp_path / "config.json"
    path.write_bytes(body)
    return compose_config([f"model.hf_config={path}"])


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"[1, 2]", "must hold a JSON object (an HF config), not a list"),
        (b"\xff\xfe{}", "must be a readable UTF-8 HF config.json (UnicodeDecodeError"),
        (b"{not json", "must be a readable UTF-8 HF config.json (JSONDecodeError"),
    ],
)
def test_malformed_hf_config_is_a_message_not_a_traceback(tmp_path, body: bytes, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        validate(_hf(tmp_path, body))
    assert expected in str(info.value)


def test_hf_config_non_numeric_rope_theta_and_dense_moe(tmp_path) -> None:
    cfg = compose_config()
    m = cfg.model
    hf = {
        "architectures": [m.architecture],
        "num_hidden_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_kv_heads,
        "head_dim": m.head_dim,
        "intermediate_size": m.intermediate_size,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_position_embeddings,
        "rope_theta": "big",
        "rms_norm_eps": m.rms_norm_eps,
        "tie_word_embeddings": m.tie_word_embeddings,
        "num_experts": 128,
    }
    with pytest.raises(ConfigError) as info:
        validate(_hf(tmp_path, json.dumps(hf).encode()))
    text = str(info.value)
    assert "model.rope_theta=1000000.0: model.hf_config has rope_theta='big'" in text
    assert "has num_experts=128: a mixture-of-experts model" in text
    hf |= {"rope_theta": m.rope_theta, "num_experts": 0}
    validate(_hf(tmp_path, json.dumps(hf).encode()))  # the same file, dense and numeric: accepted


def test_checkpoint_must_match_the_profile(tmp_path) -> None:
    import dataclasses

    import torch

    from tonpolicy.model.checkpoint import init_state_dict, save_hf

    other = dataclasses.replace(compose_config().model, num_layers=2)
    save_hf(init_state_dict(other, torch.float32, 0), other, tmp_path / "ckpt")
    with pytest.raises(ConfigError) as info:
        validate(compose_config([f"model.checkpoint={tmp_path / 'ckpt'}"]))
    assert "model.num_layers=4: model.checkpoint has num_hidden_layers=2" in str(info.value)
    validate(compose_config([f"model.checkpoint={tmp_path / 'ckpt'}", "model.num_layers=2"]))
