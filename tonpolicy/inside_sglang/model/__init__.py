"""tonpolicy's model package for released SGLang: Qwen3 on the contract kernels inside SGLang.

Loaded by SGLang through `SGLANG_EXTERNAL_MODEL_PACKAGE=tonpolicy.inside_sglang.model` (SGLang imports
every module here and registers each `EntryClass` under its class name, ahead of its own Qwen3), in
any SGLang process: `python -m sglang.launch_server`, `sglang.Engine(...)` or tonpolicy's server entry
`python -m tonpolicy.inside_sglang.server`. The contract sampler comes from tonpolicy's SGLang plugin
(`tonpolicy.inside_sglang.plugin`), which SGLang runs in each of its processes before it creates its
sampler. Importing the package refuses an SGLang release other than the tested one
(tonpolicy.config.sglang_release): the package uses SGLang's internals.

SGLang keeps its scheduler, continuous batching, chunked prefill, radix cache and HTTP server; every
numerical op of the model is a call into the contract kernel set:

- `qwen3.py`: the model, TP-sharded over SGLang's TP group (column shards; row-parallel layers as
  canonical K-shard partials combined across ranks in the fixed tree, `kernels/row_parallel.py`);
- `qwen3_moe.py`: Qwen3-MoE on the same pieces, its experts sharded over SGLang's TP group (and its
  `--ep-size`), routes fed to SGLang's routed-experts capturer;
- `attention.py`: split-KV attention reading SGLang's own paged KV pool (the `triton` set reads it
  inside its kernel, and a decode step does no host work, so SGLang can capture it in CUDA graphs);
- `heads.py`: the fp32 LM head over the TP-independent padded vocab, and the sampler that reports
  the kernel set's fp32 log_softmax(logits / T) of the sampled token;
- `report.py`: the runtime identity each TP rank computes from the kernel set it built.

The contract to run comes from the environment variable TONPOLICY_CONTRACT (JSON written by the
launch plan); nothing here is imported outside an SGLang process.
"""

from tonpolicy.config.sglang_release import require_sglang_release

# Before SGLang loads a model class of this package: its internals are those of the tested release.
require_sglang_release()
