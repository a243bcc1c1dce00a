"""Released-SGLang servers shared by the modules of this folder.

A start costs about half a minute here, so the fp32 TP 1 contract server and the stock (off-policy)
server on one checkpoint are started once for the folder and queried by every test that needs that
exact server (test_sglang_real.py, test_sglang_differential.py). Both run with the tokenizer on: the
differential stream sends text. An idle server sleeps (the launch plan renders --sleep-on-idle on a
CPU), so keeping them until the folder ends takes no core from the tests in between.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.sglang_proc import SGLangServer, save_checkpoint, sglang_env_python

SHARED_DTYPE = "float32"
SHARED = [f"contract.dtype={SHARED_DTYPE}", "rollout.skip_tokenizer_init=false", "rollout.chunked_prefill_size=64"]


@pytest.fixture(scope="package")
def sglang_py() -> str:
    return sglang_env_python()


@pytest.fixture(scope="package")
def fp32_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny dense checkpoint both shared servers serve."""
    return save_checkpoint(tmp_path_factory.mktemp("shared_ckpt") / "tiny", SHARED_DTYPE, seed=5)


@pytest.fixture(scope="package")
def _shared_servers(
    tmp_path_factory: pytest.TempPathFactory, sglang_py: str, fp32_ckpt: Path
) -> Iterator[dict[str, SGLangServer]]:
    """Both shared servers, started side by side: most of a start is one process importing SGLang, so two
    starts together take little longer than one."""
    tmp, servers = tmp_path_factory.mktemp("shared_servers"), {}
    try:
        for name, contract in (("contract_fp32", "contract=qwen3_dense_v2"), ("stock_fp32", "contract=off_policy")):
            servers[name] = SGLangServer(tmp, name, fp32_ckpt, [*SHARED, contract])
        for server in servers.values():
            server.start_healthy()
        yield servers
    finally:
        for server in servers.values():
            server.stop()


@pytest.fixture(scope="package")
def contract_fp32_server(_shared_servers: dict[str, SGLangServer]) -> SGLangServer:
    """SGLang on tonpolicy's contract package (qwen3_dense_v2), fp32, TP 1."""
    return _shared_servers["contract_fp32"]


@pytest.fixture(scope="package")
def stock_fp32_server(_shared_servers: dict[str, SGLangServer]) -> SGLangServer:
    """Stock SGLang (its own Qwen3 and kernels, no contract) on the same checkpoint: the negative control."""
    return _shared_servers["stock_fp32"]
