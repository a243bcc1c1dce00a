"""Launch plans: contract fingerprint, golden plans, SGLang flags checked by SGLang's own parser."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tonpolicy.config.compose import compose_config
from tonpolicy.contract.identity import NUMERICS_FIELDS, fingerprint
from tonpolicy.launch.plan import (
    API_KEY_PLACEHOLDER,
    NODE_RANK_PLACEHOLDER,
    launch_plan,
    launch_script,
    sglang_argv,
)

GOLDEN = Path(__file__).parent / "golden"
RUN_DIR = Path("/RUN")
GOLDEN_CASES = {
    "qwen3_4b_tp2_pp2_cuda": ["model=qwen3_4b", "parallel=tp2_pp2", "trainer.device=cuda"],
    "qwen3_4b_cp2_ring_sglang": ["model=qwen3_4b", "parallel=cp2_ring", "rollout=sglang", "trainer.device=cuda"],
    "tiny_tp2_cpu": ["parallel=tp2", "trainer.device=cpu"],
    "tiny_off_policy_cp2_ulysses_cpu": ["contract=off_policy", "parallel=cp2_ulysses", "trainer.device=cpu"],
    # Two nodes of 8 GPUs: the trainer at TP 8 x PP 2 across them, one SGLang server (TP 16) spanning both.
    "qwen3_8b_2x8_sglang": [
        "mode=plan",
        "model=qwen3_8b",
        "parallel.tp=8",
        "parallel.pp=2",
        "trainer.device=cuda",
        "trainer.nnodes=2",
        "trainer.master_addr=10.0.0.1",
        "rollout=sglang",
        "parallel.rollout_tp=16",
        "rollout.nnodes=2",
        "rollout.dist_init_addr=10.0.0.1:20000",
        "rollout.weight_sync=distributed",
    ],
}


def test_fingerprint_tracks_every_numerics_field() -> None:
    c = compose_config().contract
    base = fingerprint(c)
    assert base == fingerprint(compose_config().contract), "fingerprint must be deterministic"
    changes = {
        "family": "qwen3_moe",
        "kernels": "plain",
        "dtype": "float32",
        "accumulate_dtype": "float64",
        "attention_tile": 64,
        "row_tile": 32,
        "prefill_row_tile": 64,
        "canonical_shards": 8,
        "logits_dtype": "bfloat16",
        "quant": "fp8_block",
        "logprob_recipe": "other",
    }
    assert set(changes) == set(NUMERICS_FIELDS)
    seen = {base}
    for field, value in changes.items():
        fp = fingerprint(dataclasses.replace(c, **{field: value}))
        assert fp not in seen, field
        seen.add(fp)
    for field, value in {
        "attention_backend": "triton",
        "enable_deterministic_inference": True,
        "rl_on_policy_target": "fsdp",
        "model_package": None,
    }.items():
        changed = dataclasses.replace(c, sglang=dataclasses.replace(c.sglang, **{field: value}))
        assert fingerprint(changed) != base, field
    # Labels and layout gates do not change the numerics.
    assert fingerprint(dataclasses.replace(c, name="renamed", supported_cp_types=["ring"])) == base
    assert fingerprint(compose_config(["contract=off_policy"]).contract) != base


def render(overrides: list[str]) -> dict:
    return json.loads(json.dumps(launch_plan(compose_config(overrides), RUN_DIR)))


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_golden_plan(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TONPOLICY_SGLANG_PYTHON", "python")  # no machine-specific interpreter path
    plan = render(GOLDEN_CASES[name])
    path = GOLDEN / f"{name}.json"
    if os.environ.get("TONPOLICY_UPDATE_GOLDEN"):
        path.write_text(json.dumps(plan, indent=2, sort_keys=True) + "\n")
    assert plan == json.loads(path.read_text()), (
        f"plan changed; rerun with TONPOLICY_UPDATE_GOLDEN=1 if intended: {path}"
    )


def test_plan_contents() -> None:
    plan = render(GOLDEN_CASES["qwen3_4b_tp2_pp2_cuda"])
    argv = plan["sglang_command"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    # The contract inside SGLang: tonpolicy's model package, no deterministic mode, radix cache on.
    assert argv[1:3] == ["-m", "tonpolicy.inside_sglang.server"]
    assert "--enable-deterministic-inference" not in argv and "--disable-radix-cache" not in argv
    assert "--rl-on-policy-target" not in argv and "--skip-tokenizer-init" in argv
    assert "--disable-cuda-graph" in argv and "--device" not in argv
    tc = plan["megatron"]["transformer_config"]
    assert (tc["tensor_model_parallel_size"], tc["pipeline_model_parallel_size"]) == (2, 2)
    assert not tc["sequence_parallel"] and not tc["apply_rope_fusion"] and not tc["bias_activation_fusion"]
    assert plan["megatron"]["layer_spec"]["transformer_engine"] is False
    env = plan["environment"]
    assert env["NCCL_ALGO"] == "Ring" and env["NCCL_PROTO"] == "Simple"
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and env["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
    assert plan["dist_backend"] == "nccl"
    off = render(["contract=off_policy", "trainer.device=cuda"])
    assert off["sglang_command"][1:3] == ["-m", "sglang.launch_server"]  # stock SGLang: its own model
    assert "--enable-deterministic-inference" not in off["sglang_command"]
    assert "NCCL_ALGO" not in off["environment"]
    script = launch_script(plan)
    assert "sglang.launch_server" not in script  # the embedded server is the rollout here
    assert "torch.distributed.run" in script and "export NCCL_ALGO=Ring" in script


def test_rendered_sglang_flags_exist_in_sglang() -> None:
    """Every flag we render must be accepted by released SGLang's own argument parser."""
    argvs = []
    for overrides in [
        *GOLDEN_CASES.values(),
        ["contract=off_policy", "rollout=sglang", "trainer.device=cuda", "rollout.chunked_prefill_size=256"],
        ["model=qwen3_30b_a3b", "rollout=sglang", "trainer.device=cuda", "parallel.rollout_tp=2"],
    ]:
        argv = sglang_argv(compose_config(overrides), "/ckpt")
        assert argv[1:3] in (["-m", "sglang.launch_server"], ["-m", "tonpolicy.inside_sglang.server"])
        # The shell's part: launch.sh expands the node rank (and the API key) before SGLang parses them.
        argvs.append([{NODE_RANK_PLACEHOLDER: "1", API_KEY_PLACEHOLDER: "key"}.get(a, a) for a in argv[3:]])
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parents[1] / "support" / "sglang_argcheck.py")],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(r["ok"] for r in results), results
    assert results[2]["attention_backend"] == "torch_native"  # tiny_tp2_cpu: SGLang's CPU engine
    assert results[-1]["ok"] and "--enable-return-routed-experts" in sglang_argv(
        compose_config(["model=qwen3_moe_tiny", "rollout=sglang"]), "/ckpt"
    )  # a MoE model's server reports each token's experts (routing_agreement)
    # A flag that does not exist is refused: the check can fail.
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parents[1] / "support" / "sglang_argcheck.py")],
        input=json.dumps([["--model-path", "x", "--true-on-policy-contract", "v1"]]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert json.loads(proc.stdout.strip().splitlines()[-1])[0]["ok"] is False


def test_multi_node_launch_sh_runs_on_every_node() -> None:
    """Each node runs the same launch.sh with its NODE_RANK (or SLURM's SLURM_NODEID): node 0 writes the
    initial weights; every node runs its torchrun (static rendezvous at node 0) and its SGLang rank."""
    plan = render(GOLDEN_CASES["qwen3_8b_2x8_sglang"])
    script = launch_script(plan)
    assert 'NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"' in script
    assert 'if [ "$NODE_RANK" = 0 ]; then "$PY" -m tonpolicy.launch.init_checkpoint' in script
    assert '--nnodes 2 --nproc-per-node 8 --node-rank "$NODE_RANK" --master-addr 10.0.0.1' in script
    assert '--nnodes 2 --node-rank "$NODE_RANK" --dist-init-addr 10.0.0.1:20000' in script
    single = launch_script(render(GOLDEN_CASES["tiny_tp2_cpu"]))
    assert "NODE_RANK" not in single and "if [" not in single


def test_names_rendered_into_launch_sh_cannot_inject_commands(tmp_path: Path) -> None:
    cfg = compose_config()
    cfg = dataclasses.replace(
        cfg,
        parallel=dataclasses.replace(cfg.parallel, name="tp1\ntouch /tmp/pwned"),
        contract=dataclasses.replace(cfg.contract, name="c\nrm -rf ~"),
    )
    script = launch_script(launch_plan(cfg, RUN_DIR))
    assert "\ntouch /tmp/pwned" not in script and "\nrm -rf ~" not in script
    path = tmp_path / "launch.sh"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)]).returncode == 0
