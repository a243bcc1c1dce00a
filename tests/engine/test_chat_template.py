"""The checkpoint's chat template renders here exactly as transformers' `apply_chat_template` renders it
(SGLang calls that one), tools included: its `tojson` keeps key order and non-ASCII text and escapes no
HTML, loop controls, `{% generation %}` blocks, `raise_exception`, and template kwargs such as
enable_thinking. Control: Jinja's own `tojson` (sorted, HTML-escaped) renders the tools differently."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tonpolicy.model.tokenizer import load_text_tokenizer, save_tokenizer

# A template in the style of the Qwen family's (written for this test): tools as JSON lines, a
# reversed scan with a namespace, tool calls, tool responses, a thinking switch.
TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- set ns = namespace(last_user=0) %}
{%- for message in messages[::-1] %}{% if message.role == 'user' %}
{%- set ns.last_user = messages|length - 1 - loop.index0 %}{% break %}{% endif %}{% endfor %}
{%- for message in messages %}
{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
{{- raise_exception('unknown role ' + message.role) }}{% endif %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% generation %}{{ message.content }}{% for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}{% endgeneration %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "Météo <now> & 'later'",
            "parameters": {
                "type": "object",
                "properties": {"z_city": {"type": "string"}, "a_unit": {"type": "string"}},
            },
        },
    }
]
CONVERSATIONS = [
    [{"role": "user", "content": "first 3 :"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say 4"}],
    [
        {"role": "user", "content": "weather in Zürich?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"z_city": "Zürich"}}}],
        },
        {"role": "tool", "content": '{"temp": 3}'},
    ],
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chat")
    save_tokenizer(path, 64)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return path


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no_tools", "tools"])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}], ids=["default", "no_thinking"])
def test_prompts_render_as_transformers_renders_them(checkpoint: Path, tools: list | None, kwargs: dict) -> None:
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(checkpoint)
    ours = load_text_tokenizer(checkpoint)
    for messages in CONVERSATIONS:
        expected = theirs.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
        )
        assert ours.apply_chat_template(messages, tools, **kwargs) == expected


def test_jinjas_own_tojson_would_render_the_tools_otherwise(checkpoint: Path) -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    ours = load_text_tokenizer(checkpoint).apply_chat_template(CONVERSATIONS[0], TOOLS)
    assert '"z_city": {"type": "string"}, "a_unit"' in ours and "Météo <now> & 'later'" in ours
    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    template = TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    theirs = plain.from_string(template).render(messages=CONVERSATIONS[0], tools=TOOLS, add_generation_prompt=True)
    assert theirs != ours and "\\u003c" in theirs  # sorted keys, HTML escaped


def test_a_template_that_raises_names_its_message(checkpoint: Path) -> None:
    from jinja2.exceptions import TemplateError

    with pytest.raises(TemplateError, match="unknown role robot"):
        load_text_tokenizer(checkpoint).apply_chat_template([{"role": "robot", "content": "x"}])
