"""Resume bit for bit, at tp1 and at a TP x PP layout: a run of 3 steps whose trainer dies after its
step-2 checkpoint, resumed with checkpoint.resume=auto, writes the same step records (apart from times)
and ends with the same weights, bit for bit, as a run that was never interrupted. Control (tp1):
resumed with the weights but a fresh optimizer (TONPOLICY_FAULT=resume_without_optimizer_state), the
same gradient makes other weights. The TP x PP run's saved trainer state (megatron's distributed checkpoint)
loads into a tp1 trainer, resharded bit for bit; a run is still resumed only at the layout that saved it
(another layout's gradients are reduced in another order: tp1 and tp2_pp2 runs differ from step 0's
grad norm on)."""

from __future__ import annotations

import json
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.e2e_common import records, tonpolicy_argv

from tonpolicy.trainer.process_groups import spawn

JOB = ("experiment.steps=3", "checkpoint.save_every=2")
LAYOUTS = {"tp1": True, "tp2_pp2": False}  # layout -> whether its runs include the control


def _strip(record: dict) -> dict:
    # times, rates and the process's peak memory differ between runs
    return {k: v for k, v in record.items() if k != "time" and not k.endswith(("_s", "_mib"))}


def _run(run_dir: Path, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, **({"TONPOLICY_FAULT": fault} if fault else {})}
    argv = tonpolicy_argv(run_dir, *JOB, *extra)
    return subprocess.run(argv, cwd=run_dir.parent, capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The uninterrupted run beside a run killed at step 2 (its trainer's rank 0 dies); that run resumed
    as shipped and (tp1), from a copy of it, resumed forgetting the optimizer's state."""
    layout, control = f"parallel={request.param}", LAYOUTS[request.param]
    names = ("whole", "resumed", "control") if control else ("whole", "resumed")
    dirs = {name: tmp_path_factory.mktemp(f"{name}_{request.param}") / "run" for name in names}
    with ThreadPoolExecutor(2) as pool:
        whole = pool.submit(_run, dirs["whole"], layout)
        killed = _run(dirs["resumed"], layout, fault="rank_exit:0:2")
        assert whole.result().returncode == 0, whole.result().stderr[-3000:]
    assert killed.returncode == 4, killed.stderr[-3000:]
    assert [r["step"] for r in records(dirs["resumed"])] == [0, 1]
    if control:
        shutil.copytree(dirs["resumed"], dirs["control"])
    with ThreadPoolExecutor(2) as pool:
        again = [pool.submit(_run, dirs["resumed"], layout, "checkpoint.resume=auto")]
        if control:
            fault = "resume_without_optimizer_state"
            again.append(pool.submit(_run, dirs["control"], layout, "checkpoint.resume=auto", fault=fault))
        for future in again:
            proc = future.result()
            assert proc.returncode == 0, proc.stderr[-3000:]
            assert "resuming after step 1" in proc.stderr
    return dirs


def test_a_resumed_run_is_the_uninterrupted_run_bit_for_bit(runs: dict[str, Path]) -> None:
    whole, resumed = records(runs["whole"]), records(runs["resumed"])
    assert [r["step"] for r in resumed] == [0, 1, 2]
    assert [_strip(r) for r in resumed] == [_strip(r) for r in whole]
    final = [_final(runs[n]) for n in ("whole", "resumed")]
    assert final[0].keys() == final[1].keys() and all(final[0][k].equal(final[1][k]) for k in final[0])
    samples = [(runs[n] / "samples.jsonl").read_text().splitlines() for n in ("whole", "resumed")]
    assert [json.loads(s)["responses"] for s in samples[0]] == [json.loads(s)["responses"] for s in samples[1]]


@pytest.mark.parametrize("runs", ["tp1"], indirect=True)  # what it shows does not depend on the layout
def test_without_the_optimizer_state_the_resumed_run_differs(runs: dict[str, Path]) -> None:
    whole, control = records(runs["whole"]), records(runs["control"])
    assert [_strip(r) for r in control[:2]] == [_strip(r) for r in whole[:2]]
    assert control[2]["grad_norm"] == whole[2]["grad_norm"]  # same weights, same batch: same gradient
    final = [_final(runs[n]) for n in ("whole", "control")]
    assert any(not final[0][k].equal(final[1][k]) for k in final[0])  # but another update


def _final(run_dir: Path) -> dict:
    return load_file(run_dir / "checkpoints" / "step_3" / "model.safetensors")


@pytest.mark.parametrize("runs", ["tp2_pp2"], indirect=True)
def test_a_saved_state_loads_at_another_layout(runs: dict[str, Path]) -> None:
    """tp2_pp2's step-2 state in a tp1 trainer: every tensor of its optimizer is the saved global tensor's
    slice, bit for bit, with the Adam step; the bf16 weights the HF files hold are its fp32 main weights
    rounded, and these hold more bits than the weights (they came from the trainer state). Control: the
    same trainer before loading (a fresh optimizer) has neither the state nor those bits."""
    fresh, loaded = spawn(_checks_at_tp1, 1, str(runs["resumed"] / "checkpoints" / "step_2"))
    assert fresh["main_beyond_weights"] == 0 and fresh["adam_step"] == set(), fresh
    assert loaded["tensors"] > 0 and loaded["differ_from_saved"] == 0, loaded
    assert loaded["main_not_rounding_to_weights"] == 0 and loaded["main_beyond_weights"] > 0, loaded
    assert loaded["adam_step"] == {
        json.loads((runs["resumed"] / "checkpoints/step_2/trainer_state.json").read_text())["adam_step"]
    }


def _checks_at_tp1(step_dir: str) -> tuple[dict, dict]:
    """A tp1 trainer on `step_dir`'s weights, checked before and after loading its trainer state."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
    from megatron.core.dist_checkpointing.serialization import load_plain_tensors

    from tonpolicy.config.compose import compose_config
    from tonpolicy.trainer.optimizer_state import OPTIMIZER_DIR, sharded_optimizer_state
    from tonpolicy.trainer.worker import TrainerWorker

    worker = TrainerWorker(compose_config(["parallel=tp1", *JOB]), step_dir)
    worker._setup_optimizer()
    fresh = _main_weight_checks(worker)
    worker.load_trainer_state(Path(step_dir))
    saved = load_plain_tensors(str(Path(step_dir) / OPTIMIZER_DIR))  # each global tensor whole
    sharded = sharded_optimizer_state(worker, is_loading=False)
    apply_factories(sharded)
    shards = [t for t in nested_values(sharded) if isinstance(t, ShardedTensor)]
    differ = sum(not _bits(t.data).equal(_bits(saved[t.key][_where(t)])) for t in shards)
    return fresh, {**_main_weight_checks(worker), "tensors": len(shards), "differ_from_saved": differ}


def _main_weight_checks(worker: object) -> dict:
    opts = getattr(worker.optimizer, "chained_optimizers", [worker.optimizer])
    groups = [
        zip(ps, ms, strict=True)
        for o in opts
        for ps, ms in zip(o.float16_groups, o.fp32_from_float16_groups, strict=True)
    ]
    pairs = [pair for group in groups for pair in group]
    return {
        "main_not_rounding_to_weights": sum(not m.bfloat16().equal(p) for p, m in pairs),
        "main_beyond_weights": sum(not m.equal(p.float()) for p, m in pairs),
        "adam_step": {float(s["step"]) for o in opts for s in o.optimizer.state.values() if "step" in s},
    }


def _where(shard: object) -> tuple:
    """The shard's place in its global tensor (leading axes prepended by megatron: one index each)."""
    lead = shard.prepend_axis_num
    offsets = shard.global_offset
    return (*offsets[:lead], *(slice(o, o + n) for o, n in zip(offsets[lead:], shard.local_shape, strict=True)))


def _bits(t: object) -> object:
    return t.view(torch.int32) if t.dtype == torch.float32 else t
