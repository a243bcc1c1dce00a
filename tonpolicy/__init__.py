"""tonpolicy: truly on-policy RL post-training (bit-identical rollout and trainer logprobs).

Importing the package changes nothing in the process (the CLI tunes glibc's heap: tonpolicy.cpu_memory);
the public API is tonpolicy.api."""
