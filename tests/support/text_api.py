"""A server's text API as a client calls it (shared by tests/server/test_server_text_api.py and
tests/sglang/test_sglang_clients.py): JSON calls with server-sent events read back, and a checkpoint
given a chat template."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}{{ 'say' }}"


def with_chat_template(path: Path) -> Path:
    """The checkpoint at `path` with CHAT_TEMPLATE in its tokenizer_config.json."""
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return path


def call(url: str, path: str, body: Any = None) -> tuple[int, Any]:  # noqa: ANN401 - any JSON body
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read().decode()
            return r.status, (events(raw) if r.headers["Content-Type"] == "text/event-stream" else json.loads(raw))
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def events(raw: str) -> list[Any]:
    """Server-sent events -> their JSON payloads; the stream must end with [DONE]."""
    datas = [line[len("data: ") :] for line in raw.split("\n\n") if line]
    assert datas[-1] == "[DONE]", raw[-300:]
    return [json.loads(d) for d in datas[:-1]]
