"""Run under the SGLang environment's Python (it has the `openai` package): drive a server with the
official OpenAI client and print what it got as one JSON line.

    python tests/support/openai_client_check.py BASE_URL
"""

from __future__ import annotations

import json
import sys

from openai import OpenAI


def main() -> None:
    client = OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    args = {"model": model, "prompt": "copy 1 2 3", "max_tokens": 5, "temperature": 0}
    plain = client.completions.create(**args, logprobs=2, extra_body={"ignore_eos": True})
    streamed = client.completions.create(**args, stream=True, extra_body={"ignore_eos": True})
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "copy 1 2"}], max_tokens=3, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = plain.choices[0]
    print(
        json.dumps(
            {
                "model": model,
                "text": choice.text,
                "finish_reason": choice.finish_reason,
                "token_logprobs": choice.logprobs.token_logprobs,
                "top_logprobs": choice.logprobs.top_logprobs,
                "usage": plain.usage.model_dump(),
                "streamed_text": "".join(c.choices[0].text for c in streamed if c.choices),
                "chat": chat.choices[0].message.content,
            }
        )
    )


if __name__ == "__main__":
    main()
