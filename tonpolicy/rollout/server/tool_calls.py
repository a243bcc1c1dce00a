"""Tool calls in a chat reply, as SGLang's `--tool-call-parser qwen25` (Hermes format) reads them:
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in the generated text, anything
before the first block being the message's content. OpenAI's shape: `tool_calls` entries
`{id, type: "function", function: {name, arguments (a JSON string)}}`, finish_reason "tool_calls".

The text is only read here: the tokens the model produced stay what the route returns
(`response_token_ids`), so a trainer keeps training on exactly the sampled ids.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, tools: list[dict[str, Any]], rid: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a reply; a block that is not JSON naming one of `tools` stays text."""
    names = {t.get("function", {}).get("name") for t in tools if isinstance(t, dict)}
    calls: list[dict[str, Any]] = []
    first = None
    for n, m in enumerate(_BLOCK.finditer(text)):
        try:
            call = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(call, dict) or call.get("name") not in names:
            continue
        first = m.start() if first is None else first
        args = call.get("arguments", {})
        calls.append(
            {
                "id": f"call_{rid}_{n}",
                "type": "function",
                "function": {"name": call["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
        )
    if not calls:
        return text, []
    content = text[:first].strip()
    return content or None, calls


def check_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The request's `tools` (for the chat template; None: none). Raises ValueError for what the engine
    cannot honour (a forced call needs constrained decoding)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function", {}).get("name"), str)
        for t in tools
    ):
        raise ValueError('tools must be a list of {"type": "function", "function": {"name": ...}} objects')
    if choice not in (None, "auto", "none"):
        raise ValueError(f'tool_choice {choice!r} needs constrained decoding: only "auto" or "none"')
    if body.get("stream"):
        raise ValueError("tools with stream=true are not supported: set stream=false")
    return tools
