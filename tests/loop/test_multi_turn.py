"""The multi-turn task's rollout (tonpolicy.rl.multi_turn, loop.rollout_batch.collect_episodes), token in,
token out, through the real embedded server over HTTP: each turn sends the earlier turns' ids exactly
as sampled plus the environment's, later turns hit the prefix cache with the same logprob bits as with
it off, the gate sees only the model's tokens, and masked tokens carry no loss. Negative controls: a
client that re-tokenises the conversation's text would send other ids; without the mask the gate
fails on the environment's tokens and their old logprobs change the gradient."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.server_proc import DTYPE, IDENTITY, ServerProc, save_checkpoint

from tonpolicy.config.compose import compose_config
from tonpolicy.contract.gate import bits_differ
from tonpolicy.loop.gate_policy import Gate
from tonpolicy.loop.rollout_batch import collect_batch
from tonpolicy.loop.weight_sync import sampled_versions
from tonpolicy.model.tokenizer import TextTokenizer, save_tokenizer
from tonpolicy.rl.multi_turn import Episode, calculator_reply, run_episodes, segments
from tonpolicy.rl.task import CALL, DIGIT0, RESULT, SEP, reward

TURNS = 3
OVERRIDES = [
    "task=calculator",
    f"task.max_turns={TURNS}",
    "experiment.max_new_tokens=3",
    "experiment.prompts_per_step=2",
    "experiment.samples_per_prompt=2",
    "experiment.top_k=-1",  # the whole vocabulary: placeholder tokens <tN>, which do not survive re-tokenising
]


class Recording:
    """The rollout client, recording what each /generate sent and got."""

    def __init__(self, client: Any) -> None:
        self.client, self.calls = client, []

    def generate(self, ids: list[list[int]], params: Any, **kw: Any) -> list[dict[str, Any]]:
        outs = self.client.generate(ids, params, **kw)
        self.calls.append(([list(x) for x in ids], outs))
        return outs


def test_calculator_environment_and_episode_bookkeeping() -> None:
    prompt = [7, DIGIT0 + 3, DIGIT0 + 9, SEP]  # add 3 9 :
    assert calculator_reply(prompt, [50, CALL, 2]) == [RESULT, DIGIT0 + 2]
    assert calculator_reply(prompt, [50, 2]) == [RESULT, DIGIT0 + 2]  # it always answers (an untrained
    # policy never samples `call`): the final answer is read from these environment tokens
    # the reward: the final turn's first token is the tool's result s = (3 + 9) mod 10 = 2, by id mod 10
    assert reward("calculator", prompt, [DIGIT0 + 2, 50], 1) == 1.0
    assert reward("calculator", prompt, [DIGIT0 + 12, 50], 1) == 1.0
    assert reward("calculator", prompt, [DIGIT0 + 4, DIGIT0 + 2], 1) == 0.0  # 4: same parity, wrong digit

    def generate(contexts: list[list[int]], turn: int) -> list[dict[str, Any]]:
        out = {"output_ids": [CALL, 100 + turn], "output_logprobs": [-1.0, -2.0], "cached_tokens": turn}
        return [out | {"weight_versions": [f"step_{turn}"] * 2}] * len(contexts)

    (ep,) = run_episodes("calculator", [prompt], 2, generate)
    assert ep.response == [CALL, 100, RESULT, DIGIT0 + 2, CALL, 101]
    assert ep.mask == [True, True, False, False, True, True]
    assert ep.logprobs == [-1.0, -2.0, 0.0, 0.0, -1.0, -2.0] and ep.cached_tokens == 1
    # each model token carries the version that sampled it; the environment's were not sampled
    assert ep.versions == ["step_0", "step_0", None, None, "step_1", "step_1"]
    assert sampled_versions([ep.versions], [ep.mask]) == ["step_0", "step_0", "step_1", "step_1"]
    assert segments(ep.response, ep.mask) == [
        ("model", [CALL, 100]),
        ("env", [RESULT, 12]),
        ("model", [CALL, 101]),
    ]
    with pytest.raises(ValueError, match="exceeds"):
        Episode([1]).add_env_turn([1] * 9)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ck = save_checkpoint(tmp_path_factory.mktemp("mt") / "ckpt", seed=3)
    save_tokenizer(ck, 2003)
    return ck


def rollout(tmp: Path, ck: Path, name: str, *flags: str) -> tuple[Any, Recording]:
    srv = ServerProc(tmp, name, ["--model-path", str(ck), "--kernels", "ordered", "--dtype", DTYPE, *IDENTITY,
                                 "--num-threads", "1", "--max-running-requests", "4", *flags])  # fmt: skip
    try:
        client = Recording(srv.start_healthy())
        return collect_batch(compose_config(OVERRIDES), client, step=0), client
    finally:
        srv.stop()


def test_token_in_token_out_with_prefix_reuse_over_http(tmp_path: Path, checkpoint: Path) -> None:
    batch, rec = rollout(tmp_path, checkpoint, "on")
    assert len(rec.calls) == TURNS
    for (sent, outs), (nxt, _) in zip(rec.calls, rec.calls[1:], strict=False):
        for ctx, out, later, prompt in zip(sent, outs, nxt, batch.prompts, strict=True):
            # the next turn sends exactly this turn's context + the ids the server sampled + the env's reply
            assert later == ctx + out["output_ids"] + calculator_reply(prompt, out["output_ids"])
    sent, outs = rec.calls[-1]
    for i, (p, r, m, ctx, out) in enumerate(
        zip(batch.prompts, batch.responses, batch.response_masks, sent, outs, strict=True)
    ):
        assert p + r == ctx + out["output_ids"]  # the trainer gets exactly the ids the rollout had
        assert len(m) == len(r) and int(m.sum()) == sum(len(o[i]["output_ids"]) for _, o in rec.calls)
    # every model token's logprob is the server's, in order; the environment's carry none (0.0, masked)
    served = [[lp for _, outs_t in rec.calls for lp in outs_t[i]["output_logprobs"]] for i in range(len(sent))]
    for lps, m, s in zip(batch.rollout_logprobs, batch.response_masks, served, strict=True):
        assert lps[m].tolist() == s and (lps[~m] == 0).all()
    # later turns reuse the earlier turns' K/V: at least the prompt of every sample
    assert all(o["cached_tokens"] >= len(p) for o, p in zip(rec.calls[1][1], batch.prompts, strict=True))
    assert batch.cached_tokens > 0
    # the server's version of every model token (the initial weights), none at the environment's
    for v, m in zip(batch.weight_versions, batch.response_masks, strict=True):
        assert len(v) == len(m) and all((x == "default") if keep else x is None for x, keep in zip(v, m, strict=True))

    # Negative control: a client that decodes the conversation to text and encodes it again (as one that
    # keeps chat messages as text does) would send other ids: the placeholder <tN> of a sampled id
    # splits into digits, and decoding drops special tokens.
    tok = TextTokenizer(checkpoint)
    changed = [
        p + r for p, r in zip(batch.prompts, batch.responses, strict=True) if tok.encode(tok.decode(p + r)) != p + r
    ]
    assert changed, "every sampled conversation survived re-tokenising: the control shows nothing"
    assert tok.encode(tok.decode([942])) != [942]

    # The same conversations with the server's prefix cache off: no reuse, the same bits
    off, rec_off = rollout(tmp_path, checkpoint, "off", "--disable-radix-cache")
    assert off.responses == batch.responses and off.cached_tokens == 0
    assert all(not bits_differ(a, b).any() for a, b in zip(off.rollout_logprobs, batch.rollout_logprobs, strict=True))

    # The gate compares the model's tokens only: with the masks the trainer's own values pass, without
    # them the environment's tokens (no rollout logprob) fail it.
    trainer = [
        torch.where(m, lp, torch.full_like(lp, -4.0))
        for lp, m in zip(batch.rollout_logprobs, batch.response_masks, strict=True)
    ]
    gate = Gate(0)
    ok = gate.rollout_vs_recompute(batch.rollout_logprobs, trainer, batch.response_masks)
    assert ok.passed and ok.report.tokens_scored == batch.model_tokens < sum(len(r) for r in batch.responses)
    assert gate.rollout_vs_recompute(batch.rollout_logprobs, trainer).failed


def test_environment_tokens_carry_no_loss(tmp_path: Path, checkpoint: Path) -> None:
    from support.masked_loss import masked_loss_worker

    from tonpolicy.trainer.process_groups import spawn

    prompts = [[7, 13, 19, 4], [7, 11, 12, 4]]
    responses = [[50, 8, 60, 9, 12, 4, 70, 71], [80, 81, 9, 4, 90, 2]]
    masks = [torch.tensor([1, 1, 1, 0, 0, 0, 1, 1]).bool(), torch.tensor([1, 1, 0, 0, 1, 1]).bool()]
    res = spawn(masked_loss_worker, 1, str(checkpoint), prompts, responses, masks)
    base = res["recomputed"]
    assert res["env_changed"] == base  # the environment's tokens' old logprobs do not enter the loss
    assert res["model_changed"] != base  # a model token's do (the test can fail)
    assert res["env_changed_unmasked"] != base  # and without the mask the environment's would


def test_bad_turn_settings_are_refused_naming_the_key() -> None:
    from tonpolicy.validation.validate import ConfigError, validate

    for overrides, key in [
        (["task=constant", "task.max_turns=2"], "task.max_turns"),
        (["task=calculator", "task.max_turns=0"], "task.max_turns"),
        (["task=calculator", "model=qwen3_moe_tiny", "contract=qwen3_moe_v2"], "task.name"),
    ]:
        with pytest.raises(ConfigError) as e:
            validate(compose_config(overrides), check_hf=False)
        assert any(i.key == key for i in e.value.issues), (overrides, str(e.value))


def test_the_cache_switch_reaches_both_servers() -> None:
    """rollout.disable_radix_cache: the embedded server's engine and released SGLang's flag."""
    from tonpolicy.launch.plan import sglang_argv
    from tonpolicy.rollout.server.args import args_from_config

    cfg = compose_config(["rollout.disable_radix_cache=true"])
    assert args_from_config(cfg)["disable_radix_cache"] is True
    assert args_from_config(compose_config([]))["disable_radix_cache"] is False
    sglang = compose_config(["rollout=sglang", "trainer.device=cpu", "rollout.disable_radix_cache=true"])
    assert "--disable-radix-cache" in sglang_argv(sglang, "/ckpt", "cpu", 30000)
