"""The embedded rollout engine (`core`), one generation's request and result (`generation`), the
logits-to-token step (`logits`) and the thread that owns the engine for the server (`loop`)."""

from tonpolicy.rollout.engine.core import Engine
from tonpolicy.rollout.engine.generation import GenRequest, GenResult, TopLogprobs
from tonpolicy.rollout.engine.logits import score_logprobs

__all__ = ["Engine", "GenRequest", "GenResult", "TopLogprobs", "score_logprobs"]
