"""The trainer's parallel layout, built once from the config (as torchtitan's `ParallelDims`): its sizes,
its label, the sizes derived from it and the rules a config must meet for it. Torch-free, so validation,
the launch plan, the memory estimate, Megatron's arguments, the schedule and the trainer's process groups
all read this one object instead of restating its arithmetic.

A new kind of parallelism is a field here: its share of the world size, its part of the label, its
Megatron size name (`megatron_sizes`, which both the process groups and the TransformerConfig take) and
its rules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from tonpolicy.config.errors import ConfigIssue
from tonpolicy.config.model import pipeline_stage_layers
from tonpolicy.config.schema import Config, ParallelConfig, value_at

# The derived micro batch size's bound: per-microbatch overhead is paid once per this many samples
# while a microbatch's activations stay small.
DERIVED_MICRO_BATCH_MAX = 8


@dataclass(frozen=True)
class Layout:
    """Trainer parallel sizes. cp_type: 'ulysses' (all-to-all over heads), 'ring' (zigzag), or 'none'
    (cp 1). Expert parallelism adds no ranks: Megatron carves its ep groups out of the cp*dp ranks."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_type: str = "none"
    pp_layers: tuple[int, ...] | None = None  # layers per pipeline stage; None: an even split
    dp: int = 1  # data-parallel replicas (megatron derives DP from the world size)
    ep: int = 1
    num_microbatches: int | None = None  # per replica per PPO minibatch; None: derived

    @classmethod
    def from_config(cls, cfg: Config) -> Layout:
        return cls.of(cfg.parallel)

    @classmethod
    def of(cls, p: ParallelConfig | Any) -> Layout:
        """From the `parallel` config group, by field name (its rollout sizes stay there; a field added
        here is read from the key of its name). Also a DictConfig, as Hydra's `${layout:${parallel}}`
        resolver passes it, where keys added later may be absent."""
        sizes = {f.name: getattr(p, f.name, f.default) for f in fields(cls)}
        layers = sizes["pp_layers"]
        return cls(**{**sizes, "pp_layers": tuple(int(n) for n in layers) if layers else None})

    def to_parallel(self) -> ParallelConfig:
        """The `parallel` config group of this layout, named by its label."""
        return ParallelConfig(
            name=self.label,
            tp=self.tp,
            pp=self.pp,
            cp=self.cp,
            cp_type=self.cp_type if self.cp > 1 else "none",
            dp=self.dp,
            ep=self.ep,
            pp_layers=list(self.pp_layers) if self.pp_layers else None,
            num_microbatches=self.num_microbatches,
        )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def label(self) -> str:
        """tp{N} / pp{N}[_{layers}] / cp{N}_{type} / dp{N} / ep{N}, joined by '_', sizes of 1 left out (tp1
        if all are); dp is left out too where it only holds the EP ranks (dp == ep, cp 1: `ep2` is dp2
        ep2). The shipped options' names are exactly their labels."""
        parts = []
        if self.tp > 1 or self.pp == self.cp == self.dp == 1:
            parts.append(f"tp{self.tp}")
        if self.pp > 1:
            layers = "_" + "-".join(str(n) for n in self.pp_layers) if self.pp_layers else ""
            parts.append(f"pp{self.pp}{layers}")
        if self.cp > 1:
            parts.append(f"cp{self.cp}_{self.cp_type}")
        if self.dp > 1 and not (self.ep > 1 and self.dp == self.ep and self.cp == 1):
            parts.append(f"dp{self.dp}")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        return "_".join(parts)

    def __str__(self) -> str:
        return self.label

    @property
    def megatron_sizes(self) -> dict[str, int]:
        """The sizes by Megatron's names, as both `initialize_model_parallel` and TransformerConfig take
        them (data parallelism is what the world leaves)."""
        return {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "context_parallel_size": self.cp,
            "expert_model_parallel_size": self.ep,
        }

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers per pipeline stage (declared, else an even split)."""
        return pipeline_stage_layers(num_layers, self.pp, self.pp_layers)

    def pad_multiple(self, attention_tile: int) -> int:
        """The smallest multiple a training sequence is padded to: ring CP cuts it into 2*cp chunks of
        whole attention tiles, Ulysses into cp; no CP, none."""
        if self.cp == 1:
            return 1
        return 2 * self.cp * attention_tile if self.cp_type == "ring" else self.cp

    def replica_share(self, batch: int, minibatches: int) -> int:
        """Samples one data-parallel replica trains on per PPO minibatch; 0 when they do not split evenly."""
        replicas = max(minibatches, 1) * max(self.dp, 1)
        return batch // replicas if batch % replicas == 0 else 0

    def micro_batch_size(self, batch: int, minibatches: int, requested: int | None = None) -> int:
        """`requested` (trainer.micro_batch_size) when set; else the replica's share cut into
        num_microbatches when that is set, else the largest size up to DERIVED_MICRO_BATCH_MAX that cuts it
        into whole microbatches, at least pp of them (so the pipeline fills); 1 when no size does (the
        rules then say why)."""
        if requested is not None:
            return requested
        share, wanted = self.replica_share(batch, minibatches), self.num_microbatches
        if wanted is not None:
            return share // wanted if wanted >= 1 and share % wanted == 0 and share >= wanted else 1
        for size in range(min(DERIVED_MICRO_BATCH_MAX, share), 1, -1):
            if share % size == 0 and share // size >= max(self.pp, 1):
                return size
        return 1

    def microbatches_per_replica(self, batch: int, minibatches: int, micro_batch_size: int) -> int:
        """Megatron's num_microbatches per PPO minibatch: batch / (minibatches * dp * micro_batch_size)."""
        return batch // (minibatches * self.dp * micro_batch_size)

    def issues(self, cfg: Config) -> list[ConfigIssue]:
        """Every rule of this layout `cfg` breaks (against its model, batch, sequence padding and
        declared ranks), each naming the key, its value and the rule. Sizes below 1 are the caller's to
        report: then the divisibility rules are skipped."""
        found: list[ConfigIssue] = []

        def bad(key: str, rule: str) -> None:
            found.append(ConfigIssue(key, value_at(cfg, key), rule))

        m = cfg.model
        if min(m.num_attention_heads, m.num_kv_heads, self.tp, self.pp, self.cp, cfg.trainer.nnodes) < 1:
            return found
        for rule in RULES:
            rule(self, cfg, bad)
        return found


Bad = Callable[[str, str], None]


def _tensor_parallel(layout: Layout, cfg: Config, bad: Bad) -> None:
    # Megatron shards query groups, so TP divides both head counts.
    m, tp = cfg.model, layout.tp
    if m.num_attention_heads % tp:
        bad("parallel.tp", f"must divide model.num_attention_heads={m.num_attention_heads}")
    if m.num_kv_heads % tp:
        bad("parallel.tp", f"must divide model.num_kv_heads={m.num_kv_heads} (Megatron query groups)")


def _pipeline(layout: Layout, cfg: Config, bad: Bad) -> None:
    m, declared = cfg.model, cfg.parallel.pp_layers
    if declared is not None:
        if len(declared) != layout.pp:
            bad("parallel.pp_layers", f"must list one layer count per stage (parallel.pp={layout.pp})")
        if sum(declared) != m.num_layers or min(declared, default=0) < 1:
            bad("parallel.pp_layers", f"stages must each hold >= 1 layer and sum to model.num_layers={m.num_layers}")
        if len(set(declared[1:-1])) > 1:
            bad(
                "parallel.pp_layers",
                "Megatron sizes uneven stages by the first and the last: the stages between "
                "them must hold equal layer counts",
            )
    elif m.num_layers % layout.pp:
        bad("parallel.pp", f"must divide model.num_layers={m.num_layers} (or declare parallel.pp_layers)")


def _batch(layout: Layout, cfg: Config, bad: Bad) -> None:
    # Megatron's batch arithmetic: batch = dp * num_microbatches * micro_batch_size, per PPO minibatch.
    batch = cfg.experiment.prompts_per_step * cfg.experiment.samples_per_prompt
    k, dp = cfg.trainer.ppo_minibatches, layout.dp
    mbs = layout.micro_batch_size(batch, k, cfg.trainer.micro_batch_size)
    # Blame the key the user set; a derived size fails only where dp does not split the batch, or the
    # batch is too small to fill the pipeline.
    explicit = cfg.trainer.micro_batch_size is not None
    mbs_key = "trainer.micro_batch_size" if explicit else "parallel.dp"
    pp_key = mbs_key if explicit else "experiment.prompts_per_step"
    if not explicit and layout.num_microbatches is not None:
        pp_key = "parallel.num_microbatches"
    if k >= 1 and batch % k:
        bad(
            "trainer.ppo_minibatches",
            f"must divide the step's batch (experiment.prompts_per_step*samples_per_prompt={batch}): "
            "every minibatch holds the same number of samples",
        )
    elif dp >= 1 and mbs >= 1 and k >= 1:
        if (batch // k) % (dp * mbs):
            of = (
                "the batch" if k == 1 else f"each of the trainer.ppo_minibatches={k} minibatches ({batch // k} samples)"
            )
            bad(
                mbs_key,
                f"parallel.dp*micro_batch_size={dp * mbs} must divide {of} "
                f"(experiment.prompts_per_step*samples_per_prompt={batch}): every replica runs whole microbatches",
            )
        else:
            n_mb = layout.microbatches_per_replica(batch, k, mbs)
            if layout.num_microbatches is not None and layout.num_microbatches != n_mb:
                bad(
                    "parallel.num_microbatches",
                    f"is batch/({'ppo_minibatches*' if k > 1 else ''}dp*micro_batch_size)={n_mb} here: "
                    "set that, or null to derive it",
                )
            if layout.pp > 1 and n_mb < layout.pp:
                bad(
                    pp_key,
                    f"leaves {n_mb} microbatches per replica, fewer than parallel.pp="
                    f"{layout.pp} stages: the pipeline never fills",
                )


def _context_parallel(layout: Layout, cfg: Config, bad: Bad) -> None:
    m, cp, tile = cfg.model, layout.cp, cfg.contract.attention_tile
    if cfg.trainer.pack_sequences and cp > 1:
        bad(
            "trainer.pack_sequences",
            "packed rows are not split for context parallelism (each sample would need "
            "its own zigzag): use padded rows (false) with parallel.cp > 1",
        )
    if cp > 1 and layout.cp_type == "none":
        bad("parallel.cp_type", f"parallel.cp={cp} needs a CP type: ulysses or ring")
    if cp == 1 and layout.cp_type != "none":
        bad("parallel.cp_type", "must be none when parallel.cp=1")
    if cp > 1 and layout.cp_type == "ulysses":
        for key, heads in (("num_attention_heads", m.num_attention_heads), ("num_kv_heads", m.num_kv_heads)):
            if heads % (layout.tp * cp):
                bad("parallel.cp", f"Ulysses CP needs model.{key}={heads} divisible by tp*cp={layout.tp * cp}")
    pad = cfg.trainer.seq_pad_multiple
    if cp > 1 and layout.cp_type == "ring" and pad is not None and pad % (2 * cp * tile):
        bad(
            "trainer.seq_pad_multiple",
            f"ring CP needs sequences padded to a multiple of 2*cp*attention_tile={2 * cp * tile}",
        )


def _world(layout: Layout, cfg: Config, bad: Bad) -> None:
    t, ws = cfg.trainer, layout.world_size
    if t.nproc_per_node is not None and t.nproc_per_node * t.nnodes != ws:
        bad("trainer.nproc_per_node", f"nnodes*nproc_per_node must equal tp*pp*cp*dp={ws}")
    if ws % t.nnodes:
        bad("trainer.nnodes", f"must divide the world size tp*pp*cp*dp={ws}")


# The layout's rules, in the order their errors are listed.
RULES: tuple[Callable[[Layout, Config, Bad], None], ...] = (
    _tensor_parallel,
    _pipeline,
    _batch,
    _context_parallel,
    _world,
)
