"""tonpolicy: truly on-policy RL post-training (bit-identical rollout and trainer logprobs)."""

from tonpolicy.cpu_memory import tune_malloc

# Before the first large tensor: heap-served temporaries (see tonpolicy.cpu_memory).
tune_malloc()
