"""tonpolicy.api, through itself only: its public names, an import that loads and changes nothing,
composing and validating, running a job (its plan), the contract object and the parity check."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tonpolicy import api

PROBE = """
import ctypes, json, logging, os, signal, sys, warnings
asked = []  # C functions looked up through ctypes (tonpolicy.cpu_memory reaches glibc's mallopt so)
lookup = ctypes.CDLL.__getattr__
def spy(lib, name):
    asked.append(name)
    return lookup(lib, name)
ctypes.CDLL.__getattr__ = spy
def state():
    return {
        "environ": dict(os.environ), "path": list(sys.path), "cwd": os.getcwd(),
        "signals": {s.name: repr(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD)},
        "warnings": repr(warnings.filters), "logging": repr(logging.root.handlers) + str(logging.root.level),
    }
before, modules = state(), set(sys.modules)
import tonpolicy.api
heavy = ("torch", "hydra", "omegaconf", "megatron", "numpy")
loaded = sorted(m for m in set(sys.modules) - modules if m.split(".")[0] in heavy)
after = state()
if sys.argv[1] == "tune":  # the control: what the command line's entry does
    from tonpolicy.cpu_memory import tune_malloc
    tune_malloc()
print(json.dumps({"changed": [k for k in before if before[k] != after[k]], "loaded": loaded, "asked": asked}))
"""


def _probe(mode: str) -> dict:
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout)


def test_the_public_names() -> None:
    assert sorted(api.__all__) == sorted(
        [
            "SGLANG_VERSION",
            "Contract",
            "ParityReport",
            "RunResult",
            "bits_differ",
            "compose",
            "megatron_cpu_support",
            "parity",
            "run",
            "validate",
            "weights_updated",
        ]
    )
    for name in api.__all__:
        assert getattr(api, name) is not None, name
    for method in ("sglang_environment", "sglang_server_args", "megatron_transformer_config", "megatron_block_spec"):
        assert callable(getattr(api.Contract, method)), method
    with pytest.raises(AttributeError):
        api.not_a_name  # noqa: B018


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's mallopt")
def test_importing_the_api_loads_and_changes_nothing() -> None:
    """No torch, Hydra or megatron loaded, no variable, path, signal handler, warning filter or logging
    set, and glibc's heap settings left alone; the control shows the probe sees the command line's tuning."""
    plain, tuned = _probe("plain"), _probe("tune")
    assert plain["changed"] == [] and plain["loaded"] == [] and "mallopt" not in plain["asked"], plain
    assert "mallopt" in tuned["asked"], tuned


def test_compose_gives_the_config_or_every_problem() -> None:
    cfg = api.compose(["contract.dtype=float32", "parallel=tp2"])
    assert not isinstance(cfg, list) and cfg.parallel.tp == 2 and cfg.contract.dtype == "float32"
    problems = api.compose(["parallel=tp3", "experiment.temprature=0.5"])
    assert isinstance(problems, list) and {p.key for p in problems} >= {"parallel"}, problems
    problems = api.compose(["parallel.tp=3", "contract.dtype=float16"])
    assert isinstance(problems, list) and {p.key for p in problems} >= {"parallel.tp", "contract.dtype"}, problems
    assert all(str(p).startswith(f"{p.key}=") for p in problems)
    assert api.validate(cfg) == []
    broken = replace(cfg, parallel=replace(cfg.parallel, tp=3))
    assert [p.key for p in api.validate(broken)][:1] == ["parallel.tp"]


def test_run_writes_the_plan_or_refuses(tmp_path: Path) -> None:
    done = api.run(["mode=plan", "parallel=tp2", "logger=none"], tmp_path / "plan")
    assert done.ok and done.run_dir == tmp_path / "plan" and done.problems == []
    plan = json.loads((tmp_path / "plan" / "launch_plan.json").read_text())
    assert plan["trainer_command"] and (tmp_path / "plan" / "launch.sh").exists()
    refused = api.run(["parallel.tp=3"], tmp_path / "bad")
    assert refused.exit_code == 2 and not refused.ok and refused.problems[0].key == "parallel.tp"


def test_the_contract_object() -> None:
    cfg = api.compose(["contract.dtype=float32"])
    contract = api.Contract(cfg)
    assert (contract.name, contract.version, contract.exact, contract.layer_spec) == (
        "qwen3_dense_v2",
        2,
        True,
        "kernels",
    )
    assert len(contract.fingerprint) == 64
    stock = api.Contract(api.compose(["contract=off_policy"]))
    assert stock.fingerprint != contract.fingerprint and stock.layer_spec == "stock" and not stock.exact
    env = contract.sglang_environment("cpu")
    assert env["SGLANG_EXTERNAL_MODEL_PACKAGE"] == "tonpolicy.inside_sglang.model"
    assert json.loads(env["TONPOLICY_CONTRACT"])["fingerprint"] == contract.fingerprint
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and "SGLANG_USE_CPU_ENGINE" not in contract.sglang_environment("cuda")
    assert "SGLANG_EXTERNAL_MODEL_PACKAGE" not in stock.sglang_environment("cuda")  # stock SGLang: its own model
    args = contract.sglang_server_args("/ckpt", "cpu", 31000)
    assert args[:2] == ["--model-path", "/ckpt"] and "-m" not in args
    assert args[args.index("--port") + 1] == "31000" and args[args.index("--dtype") + 1] == "float32"
    with pytest.raises(ValueError, match="device='tpu'"):
        contract.sglang_environment("tpu")


def test_the_logprob_recipe_and_the_parity_check() -> None:
    import torch

    contract = api.Contract(api.compose(["contract.dtype=float32"]))
    vocab = contract.config.model.vocab_size
    logits = torch.randn(3, contract.megatron_gpt_kwargs()["vocab_size"], generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([0, 7, vocab - 1])
    ours = contract.logprobs(logits, tokens, 0.7)
    want = torch.log_softmax(logits[:, :vocab] / 0.7, -1).gather(-1, tokens[:, None])[:, 0]
    assert ours.dtype == torch.float32 and (ours - want).abs().max() < 1e-5  # the padded columns left out
    assert api.parity([ours], [ours.clone()]).exact
    report = api.parity([[0.0, -1.5]], [[-0.0, -1.5]])  # the same value, another bit pattern
    assert (report.tokens_scored, report.mismatched_tokens, report.exact) == (2, 1, False)
    assert api.bits_differ(torch.tensor([0.0]), torch.tensor([-0.0])).tolist() == [True]
    assert isinstance(report, api.ParityReport)
