"""docs/guides/megatron_integration.md's recipe, run: a plain megatron-core GPTModel built only from
tonpolicy.api (examples/integration/megatron_gpt.py) scores the response tonpolicy's rollout engine
sampled (decode over a KV cache, each logprob from the step that sampled its token) with 0 mismatched
fp32 bit patterns. Negative control: the same script under the off-policy contract (megatron's own
modules, plain torch) mismatches."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from tonpolicy.config.model import ModelConfig
from tonpolicy.families import family, resolve
from tonpolicy.kernels import get_kernels
from tonpolicy.model.checkpoint import init_state_dict, save_hf
from tonpolicy.rollout.engine import Engine, GenRequest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "integration" / "megatron_gpt.py"
PROMPT, TEMPERATURE = [11, 4, 27, 9, 3, 18, 5], 0.8


def _rollout_samples(checkpoint: Path) -> list[dict]:
    cfg = ModelConfig()
    state = init_state_dict(cfg, torch.float32, 5)
    save_hf(state, cfg, checkpoint)
    model = resolve(family(cfg.family).engine_model)(cfg, get_kernels("ordered"), torch.float32, state)
    request = GenRequest(PROMPT, 32, temperature=TEMPERATURE, seed=1, ignore_eos=True)
    (out,) = Engine(model, max_running_requests=1).generate([request])
    return [
        {
            "prompt": PROMPT,
            "response": out.output_ids,
            "logprobs": out.output_logprobs.tolist(),
            "temperature": TEMPERATURE,
            "sampled_by": "tonpolicy's rollout engine",
        }
    ]


def test_a_plain_gpt_model_from_the_api_gives_the_rollouts_bits(tmp_path: Path) -> None:
    checkpoint, samples = tmp_path / "tiny", tmp_path / "samples.json"
    samples.write_text(json.dumps(_rollout_samples(checkpoint)))
    contracts = {"contract": "contract=qwen3_dense_v2", "control": "contract=off_policy"}
    runs = {
        name: subprocess.Popen(
            [sys.executable, str(SCRIPT), str(checkpoint), str(samples), choice, "contract.dtype=float32"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for name, choice in contracts.items()
    }
    reports = {}
    for name, run in runs.items():
        out, err = run.communicate(timeout=600)
        assert run.returncode == 0, err[-4000:]
        reports[name] = json.loads(out.strip().splitlines()[-1])
    print(reports)
    assert reports["contract"]["tokens_scored"] == 32 and reports["contract"]["exact"], reports
    assert reports["contract"]["max_abs_logprob_diff"] == 0.0
    assert reports["control"]["tokens_scored"] == 32 and reports["control"]["mismatched_tokens"] > 0, reports
