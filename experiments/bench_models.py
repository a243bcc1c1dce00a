"""Model shapes the benchmarks share (run them from this folder's scripts, which import it)."""

from __future__ import annotations

from dataclasses import replace

from tonpolicy.config.model import ModelConfig

# Hidden 1024 x 8 layers: big enough that the GEMMs, not Python, dominate on a CPU.
CPU_1024 = replace(
    ModelConfig(),
    name="cpu_1024",
    num_layers=8,
    hidden_size=1024,
    num_attention_heads=16,
    num_kv_heads=8,
    head_dim=64,
    intermediate_size=3072,
    vocab_size=32000,
)
