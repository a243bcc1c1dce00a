"""The rollout engine's models (Qwen3 dense and Qwen3-MoE), HF checkpoint I/O, the tokenizer and the KV cache pool."""

from tonpolicy.model.checkpoint import init_state_dict, load_hf, save_hf
from tonpolicy.model.kv_cache import KVPool
from tonpolicy.model.qwen3 import Qwen3, Segment

__all__ = ["KVPool", "Qwen3", "Segment", "init_state_dict", "load_hf", "save_hf"]
