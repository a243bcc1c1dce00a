"""Rollout side, one sub-room per role:

- `wire/`: SGLang's HTTP wire format, request (`request`) and response (`response`) sides; no torch,
  so the trainer's client reads answers without the engine;
- `engine/`: the embedded engine (continuous batching, sampling, per-token fp32 logprobs) and the
  thread that owns it;
- `server/`: the embedded HTTP server (`python -m tonpolicy.rollout.server`): args, shared state,
  native and OpenAI routes;
- `client`: the trainer's HTTP client for any SGLang-protocol server; `weight_group`: both ends of
  the weight-update process group.

The code that runs inside released SGLang's processes is `tonpolicy/inside_sglang/`, never imported here.
"""
