"""Token ids outside the vocabulary, refused before they reach released SGLang.

SGLang (0.5.23, stock and with the contract package) does not check `input_ids` against the vocabulary:
an id past it raises IndexError inside the model's embedding, in the scheduler process, and the whole
server dies (measured on CPU). This ASGI middleware reads the body of `/generate` and
`/v1/completions`, and answers 400 (SGLang's error shape) when a token id is out of range, as the
embedded server does; every other request passes through untouched (the body is replayed).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

GUARDED = {"/generate": "input_ids", "/v1/completions": "prompt"}

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def out_of_range(body: bytes, field: str, vocab_size: int) -> str | None:
    """The refusal for a body whose token ids leave [0, vocab_size), else None (also for bodies the
    server's own parser should judge: not JSON, text prompts, ...)."""
    try:
        ids = json.loads(body).get(field)
    except (ValueError, AttributeError, RecursionError):
        return None
    prompts = ids if isinstance(ids, list) and ids and isinstance(ids[0], list) else [ids]
    for prompt in prompts:
        if isinstance(prompt, list) and any(
            isinstance(t, int) and not isinstance(t, bool) and not 0 <= t < vocab_size for t in prompt
        ):
            return f"{field} must be in [0, {vocab_size})"
    return None


class VocabGuard:
    def __init__(self, app: Any, vocab_size: int) -> None:
        self.app, self.vocab_size = app, vocab_size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guarded = scope["type"] == "http" and scope["method"] in ("POST", "PUT")  # SGLang has PUT /generate too
        field = GUARDED.get(scope.get("path", "")) if guarded else None
        if field is None:
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        refusal = out_of_range(body, field, self.vocab_size)
        if refusal is not None:
            data = json.dumps({"error": {"message": refusal, "type": "invalid_request_error", "code": 400}}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
            await send({"type": "http.response.start", "status": 400, "headers": headers})
            await send({"type": "http.response.body", "body": data})
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
