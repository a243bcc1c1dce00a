"""Evaluation on held-out prompts (data.val_files): every trainer.eval_every steps and after the last,
rank 0 decodes each prompt greedily through the rollout server (the weights just pushed) and scores it
with the user's reward function; eval.jsonl gets the reward mean, the pass rate (the share of prompts
with a positive reward) and the responses, W&B gets `eval/reward_mean` and `eval/pass_rate`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tonpolicy.config.schema import Config
from tonpolicy.loop.records import append_jsonl
from tonpolicy.rl.prompt_data import PromptData

EVAL_FILE = "eval.jsonl"


class Evaluation:
    def __init__(self, cfg: Config, data: PromptData, score: Any, run_dir: Path) -> None:
        self.cfg, self.data, self.score, self.path = cfg, data, score, run_dir / EVAL_FILE

    def due(self, completed: int) -> bool:
        every = self.cfg.trainer.eval_every
        return completed == self.cfg.experiment.steps or (every > 0 and completed % every == 0)

    def run(self, client: Any, step: int, logger: Any) -> dict[str, Any]:
        e = self.cfg.experiment
        greedy = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": e.max_new_tokens}
        greedy["stop_token_ids"] = list(self.data.stop_ids)
        params = [{**greedy, "sampling_seed": i} for i in range(len(self.data.ids))]
        outs = client.generate(self.data.ids, params)
        responses = [o["output_ids"] for o in outs]
        rows = self.data.rows
        rewards, failed = self.score(self.data.ids, responses, [r.label for r in rows], [r.extra for r in rows])
        result = {
            "step": step,
            "reward_mean": sum(rewards) / len(rewards),
            "pass_rate": sum(r > 0 for r in rewards) / len(rewards),
            "reward_errors": failed,
            "rewards": rewards,
            "responses": responses,
        }
        append_jsonl(self.path, result)
        logger.log({"step": step, "eval/reward_mean": result["reward_mean"], "eval/pass_rate": result["pass_rate"]})
        return result
