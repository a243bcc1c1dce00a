"""Released SGLang's HTTP server with tonpolicy's contract model package.

    SGLANG_EXTERNAL_MODEL_PACKAGE=tonpolicy.inside_sglang.model TONPOLICY_CONTRACT='{...}' \\
        python -m tonpolicy.inside_sglang.server --model-path CKPT ...

Takes exactly `python -m sglang.launch_server`'s flags and runs SGLang's own server; it adds:
- the contract sampler, registered for the sampling backends at import time as well as by tonpolicy's
  SGLang plugin (tonpolicy.inside_sglang.plugin): SGLang starts its scheduler processes with the `spawn`
  method, which imports this module again in each of them, so the sampler is known wherever SGLang
  builds one even where the plugin is not installed;
- `GET /tonpolicy/contract`: the runtime identity every TP rank computed from the kernel set it
  built (tonpolicy.inside_sglang.model.report), which the trainer checks before training;
- a 400 for token ids outside the vocabulary (tonpolicy.inside_sglang.vocab_guard), which would otherwise
  kill SGLang's scheduler and with it the server;
- on a host without CUDA, SGLang's host-side buffers (the routed-experts capturer's,
  `--enable-return-routed-experts`) as plain memory: SGLang pins them with cudaHostRegister, which
  fails there (its own MoE models hit the same wall on CPU).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from tonpolicy.inside_sglang.model.heads import register_contract_sampler
from tonpolicy.inside_sglang.model.report import REPORT_DIR_ENV, merged_report
from tonpolicy.inside_sglang.vocab_guard import VocabGuard


def _plain_host_buffers_without_cuda() -> None:
    if torch.cuda.is_available():
        return
    from sglang.srt.mem_cache.pool_host import common

    def plain(dims, dtype, device, pin_memory, allocator, registration_granularity_bytes=None):  # noqa: ANN001, ANN202
        return torch.zeros(dims, dtype=dtype, device="cpu")

    common.ALLOC_MEMORY_FUNCS["cpu"] = plain


# At import: SGLang's scheduler processes are spawned and import this module again.
register_contract_sampler()
_plain_host_buffers_without_cuda()


def add_contract_route(app, report_dir: str) -> None:  # noqa: ANN001 - SGLang's FastAPI app
    from fastapi.responses import ORJSONResponse

    @app.get("/tonpolicy/contract")
    async def tonpolicy_contract() -> ORJSONResponse:
        status, body = merged_report(report_dir)
        return ORJSONResponse(body, status_code=status)


def main(argv: list[str]) -> None:
    from sglang.launch_server import run_server
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    # Inherited by SGLang's model processes; a fresh folder so no stale report is ever served.
    report_dir = tempfile.mkdtemp(prefix="tonpolicy-sglang-")
    os.environ[REPORT_DIR_ENV] = report_dir
    add_contract_route(app, report_dir)
    server_args = prepare_server_args(argv)
    vocab_size = json.loads((Path(server_args.model_path) / "config.json").read_text())["vocab_size"]
    app.add_middleware(VocabGuard, vocab_size=vocab_size)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


if __name__ == "__main__":
    main(sys.argv[1:])
