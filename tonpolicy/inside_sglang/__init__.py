"""What runs inside released SGLang's processes, in SGLang's own environment (`.venv-sglang`):

- `model/`: the contract model package (`SGLANG_EXTERNAL_MODEL_PACKAGE=tonpolicy.inside_sglang.model`);
- `plugin`: SGLang's entry point (`sglang.srt.plugins`) that registers the contract sampler in every SGLang
  process serving the package, however SGLang was started;
- `server`: SGLang's HTTP server with the contract sampler, the contract report and the vocab guard
  (`python -m tonpolicy.inside_sglang.server`);
- `vocab_guard`: token ids outside the vocabulary refused with a 400;
- `cpu_standin/sgl_kernel`: the pure-torch stand-in for the CPU ops PyPI's sgl_kernel lacks.

Nothing else in tonpolicy imports this room (tests/test_architecture.py); the launch plan only names it.
"""
