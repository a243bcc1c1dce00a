"""The ASGI guard in front of released SGLang: out-of-vocabulary token ids get a 400; every other body
reaches the app unchanged (replayed), whatever its chunking."""

from __future__ import annotations

import asyncio
import json

from tonpolicy.inside_sglang.vocab_guard import VocabGuard, out_of_range


def test_out_of_range_finds_bad_ids_only() -> None:
    assert out_of_range(b'{"input_ids": [1, 2]}', "input_ids", 10) is None
    assert out_of_range(b'{"input_ids": [[1], [2, 10]]}', "input_ids", 10) == "input_ids must be in [0, 10)"
    assert out_of_range(b'{"input_ids": [-1]}', "input_ids", 10) is not None
    assert out_of_range(b'{"prompt": [3, 99]}', "prompt", 10) is not None
    for left_to_the_server in (b'{"prompt": "text"}', b"not json", b"[1, 2]", b'{"input_ids": [true, 1.5]}'):
        assert out_of_range(left_to_the_server, "input_ids", 10) is None


def run(path: str, chunks: list[bytes]) -> tuple[list[dict], bytes | None]:
    seen: dict[str, bytes] = {}

    async def app(scope, receive, send) -> None:  # noqa: ANN001 - an ASGI app that echoes the body
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        seen["body"] = body
        await send({"type": "http.response.start", "status": 200, "headers": []})

    incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict] = []

    async def receive() -> dict:
        return incoming.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path}
    asyncio.run(VocabGuard(app, vocab_size=10)(scope, receive, send))
    return sent, seen.get("body")


def test_the_guard_refuses_or_replays() -> None:
    sent, reached = run("/generate", [b'{"input_ids": ', b"[1, 99]}"])
    assert sent[0]["status"] == 400 and reached is None
    assert json.loads(sent[1]["body"])["error"]["message"] == "input_ids must be in [0, 10)"
    body = b'{"input_ids": [1, 9], "sampling_params": {}}'
    sent, reached = run("/generate", [body[:7], body[7:]])
    assert sent[0]["status"] == 200 and reached == body
    sent, reached = run("/flush_cache", [b"{}"])  # not guarded: passed through as is
    assert reached == b"{}"
