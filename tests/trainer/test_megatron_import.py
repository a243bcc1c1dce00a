"""The trainer imports megatron-core without its import-time `torch.compile` decorations."""

import subprocess
import sys

PROBE = """
import sys
import tonpolicy.trainer.worker
from megatron.core import jit
from megatron.core.fusions import fused_bias_swiglu
assert jit.jit_fuser is jit.noop_decorator, jit.jit_fuser
assert not hasattr(fused_bias_swiglu.swiglu, "_torchdynamo_orig_callable"), "swiglu was compiled"
print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo")
"""


def test_the_trainer_imports_megatron_without_dynamo() -> None:
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", PROBE], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "no dynamo", out.stdout + out.stderr
