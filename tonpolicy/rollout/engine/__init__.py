"""The embedded rollout engine (`core`), its request/result types (`requests`), the logits-to-token
step (`logits`) and the thread that owns the engine for the server (`loop`)."""

from tonpolicy.rollout.engine.core import Engine
from tonpolicy.rollout.engine.logits import score_logprobs
from tonpolicy.rollout.engine.requests import GenRequest, GenResult, TopLogprobs

__all__ = ["Engine", "GenRequest", "GenResult", "TopLogprobs", "score_logprobs"]
