"""Model profile schema: the architecture numbers of one Qwen3 model, dense or mixture of experts."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class ModelConfig:
    name: str = "qwen3_tiny"
    family: str = "qwen3"
    architecture: str = "Qwen3ForCausalLM"
    num_layers: int = 4
    hidden_size: int = 128
    num_attention_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 32
    intermediate_size: int = 384
    vocab_size: int = 2003
    max_position_embeddings: int = 1024
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    # Mixture of experts (Qwen3-MoE, config.json's names); num_experts=0 is a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    # True: routing weights are the softmax over the k selected logits (the renormalised top-k).
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)  # layers that keep the dense MLP
    router_aux_loss_coef: float = 0.0  # the load-balancing loss; off the forward path
    # Path to a Hugging Face config.json to cross-check against this profile (optional).
    hf_config: str | None = None
    # Path to an HF checkpoint directory (config.json + safetensors); None means random init from seed.
    checkpoint: str | None = None
    # The tokenizer a random-init checkpoint carries (a directory with tokenizer.json, and optionally
    # tokenizer_config.json, chat_template.jinja, generation_config.json): its vocabulary must fit
    # vocab_size. None: the tiny models' word-level tokenizer. A checkpoint carries its own.
    tokenizer: str | None = None
    init_seed: int = 1234
    init_std: float = 0.02

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` routes to experts (transformers' Qwen3-MoE rule)."""
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and self.decoder_sparse_step > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )


def pipeline_stage_layers(num_layers: int, pp: int, pp_layers: list[int] | tuple[int, ...] | None = None) -> list[int]:
    """Layers per pipeline stage: `pp_layers` as declared, else an even split. One function for the
    model build, the weight conversion both ways and validation. Megatron places uneven stages by
    first/last stage sizes, so stages between the first and the last must be equal."""
    if pp_layers:
        layers = [int(n) for n in pp_layers]
        if len(layers) != pp or sum(layers) != num_layers or min(layers) < 1:
            raise ValueError(f"pp_layers={layers} must give each of {pp} stages >= 1 layer, {num_layers} in all")
        if len(set(layers[1:-1])) > 1:
            raise ValueError(f"pp_layers={layers}: the stages between the first and the last must be equal")
        return layers
    if num_layers % pp:
        raise ValueError(f"{num_layers} layers do not split evenly into {pp} pipeline stages")
    return [num_layers // pp] * pp


# ModelConfig fields that are labels or provenance, not architecture: a checkpoint may differ in them.
_NOT_ARCHITECTURE = {"name", "family", "hf_config", "checkpoint", "tokenizer", "init_seed", "init_std"}
# The rest: what a checkpoint's config.json states (tonpolicy.config.hf_qwen3 reads and writes each).
ARCHITECTURE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(ModelConfig) if f.name not in _NOT_ARCHITECTURE)
# Those only a mixture of experts states (the MoE adapter, tonpolicy.config.hf_qwen3_moe, adds them).
MOE_FIELDS: tuple[str, ...] = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "decoder_sparse_step",
    "mlp_only_layers",
    "router_aux_loss_coef",
)


def check_same_architecture(expected: ModelConfig, loaded: ModelConfig, path: str) -> None:
    """Refuse a checkpoint whose architecture is not the expected one, naming every differing field.
    Both engines call this on what they load, so a wrong path can never serve or train another model."""
    diff = {
        f.name: (getattr(expected, f.name), getattr(loaded, f.name))
        for f in fields(expected)
        if f.name in ARCHITECTURE_FIELDS and getattr(expected, f.name) != getattr(loaded, f.name)
    }
    if diff:
        raise ValueError(
            f"checkpoint {path} has another architecture than model {expected.name} "
            f"(field: (profile, checkpoint)): {diff}"
        )
