"""Model shapes the benchmarks (bench/) and the GPU checks (gpu/) share."""

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

# The same width at 4 layers: the GPU checks' wider model (gpu/triton_check.py, gpu/graph_check.py).
WIDE_4L = replace(CPU_1024, name="wide_1024", num_layers=4)

# Hidden 256 x 2 layers, 4 query heads per KV head: a second GQA shape for bit checks (bench/bench_engine.py --bits).
CPU_256 = replace(
    ModelConfig(),
    name="cpu_256",
    num_layers=2,
    hidden_size=256,
    num_attention_heads=8,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=768,
    vocab_size=4000,
)

# Qwen3-4B's layer shapes at 2 layers and its full vocabulary: the GPU speed table's trainer step
# (gpu/gemm_speed.py).
QWEN3_4B_2L = replace(
    ModelConfig(),
    name="qwen3_4b_layers2",
    num_layers=2,
    hidden_size=2560,
    num_attention_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=9728,
    vocab_size=151936,
)
