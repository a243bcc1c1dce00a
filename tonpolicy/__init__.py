"""tonpolicy: truly on-policy RL post-training (bit-identical rollout and trainer logprobs)."""

from tonpolicy.cpu_memory import tune_malloc
from tonpolicy.cpu_numerics import pin_cpu_numerics

# Before any GEMM of this process: the libraries read these settings once (see tonpolicy.cpu_numerics).
pin_cpu_numerics()
# Before the first large tensor: heap-served temporaries (see tonpolicy.cpu_memory).
tune_malloc()
