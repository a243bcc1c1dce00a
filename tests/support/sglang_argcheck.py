"""Parse argv lists (JSON on stdin) with released SGLang's own argument parser.

SGLang's import wants triton (GPU only); a stand-in is installed after torch has decided there is
no triton, which is enough for `ServerArgs.add_cli_args`. Exit 0 only when every argv parses.
"""

import argparse
import json
import sys
from unittest import mock

import torch  # noqa: F401  (imported before the stand-in so torch sees no triton)

stub = mock.MagicMock(name="triton")
stub.__spec__ = None
stub.jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
sys.modules["triton"] = stub
sys.modules["triton.language"] = stub.language

from sglang.srt.server_args import ServerArgs  # noqa: E402

results = []
for argv in json.load(sys.stdin):
    parser = argparse.ArgumentParser(exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    try:
        ns, unknown = parser.parse_known_args(argv)
        results.append(
            {"ok": not unknown, "unknown": unknown, "tp_size": ns.tp_size, "attention_backend": ns.attention_backend}
        )
    except (argparse.ArgumentError, SystemExit) as exc:
        results.append({"ok": False, "error": str(exc)})
print(json.dumps(results))
