"""A recording (and optionally perturbing) proxy around a kernel set.

Both engines call every numeric op through their kernel set, so wrapping it sees every checkpoint
without editing either model: weighted ops (linears, norms) are identified by the identity of the
weight tensor (mapped to a canonical (layer, role) by `names`), the unweighted ones by the layer of
the last weighted op (`apply_rope_qk` names q and k; `swiglu` is the MLP activation; attention
kernels belong to `attn_out`). The residual stream is the input of the next norm.

Only the selected layers/ops/positions are copied (bounded memory). The proxy exists only while a
dump is taken: an engine that is not dumping runs its plain kernel set, with nothing in between.
`perturb` routes the calls of chosen checkpoints to another kernel set (a test hook that must show up
in the report at exactly that checkpoint).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tonpolicy.align.names import POST_OPS, TP_COLUMN_OPS, Checkpoint, checkpoint, split_gate_up, split_qkv
from tonpolicy.model.kv_cache import convert_layout


@dataclass
class Selection:
    """What to keep. None means everything. Pre/post ops (embed, final_norm, logits, logprobs) are
    kept whatever `layers` says; `ops` filters them too."""

    layers: set[int] | None = None
    positions: set[int] | None = None
    ops: set[str] | None = None

    def wants(self, ck: Checkpoint, num_layers: int) -> bool:
        if self.ops is not None and ck.op not in self.ops:
            return False
        if self.layers is None or not 0 <= ck.layer < num_layers:
            return True
        return ck.layer in self.layers


@dataclass
class Records:
    """Recorded rows per checkpoint: chunks of (absolute positions [n], values [n, F])."""

    chunks: dict[Checkpoint, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    def add(self, ck: Checkpoint, pos: torch.Tensor, val: torch.Tensor) -> None:
        self.chunks.setdefault(ck, []).append((pos, val))

    def collect(self) -> dict[Checkpoint, tuple[torch.Tensor, torch.Tensor]]:
        """One (sorted unique positions, values) per checkpoint; a position recorded twice keeps its
        first value (it never is, for one sequence)."""
        out = {}
        for ck, parts in self.chunks.items():
            pos = torch.cat([p for p, _ in parts])
            val = torch.cat([v for _, v in parts])
            order = torch.argsort(pos, stable=True)
            pos, val = pos[order], val[order]
            keep = torch.ones_like(pos, dtype=torch.bool)
            keep[1:] = pos[1:] != pos[:-1]
            out[ck] = (pos[keep], val[keep])
        return out


@dataclass(frozen=True)
class Role:
    """What a weight computes: one op, or several from one fused matmul (kind: how its output columns
    split: megatron's per-group "qkv", megatron's "gate_up", or an engine's row "concat" of `sizes`)."""

    layer: int
    ops: tuple[str, ...]
    kind: str = "single"
    sizes: tuple[int, ...] = ()


class RecordingKernels:
    """Forwards every KernelSet call to `inner` (or to a perturbing set) and records checkpoints."""

    def __init__(
        self,
        inner: Any,
        num_layers: int,
        heads_per_group: int,
        head_dim: int,
        selection: Selection | None = None,
        perturb: dict[Checkpoint, Any] | None = None,
    ) -> None:
        self.inner = inner
        self.num_layers = num_layers
        self.heads_per_group, self.head_dim = heads_per_group, head_dim
        self.selection = selection or Selection()
        self.perturb = perturb or {}
        self.records = Records()
        self._roles: dict[int, Role] = {}
        self._rows: torch.Tensor | None = None
        self._logit_rows: torch.Tensor | None = None
        self._layer = -1
        self._pending: Role | None = None  # row-parallel linear between partials and combine

    def __getattr__(self, name: str) -> Any:  # name, attention_tile, canonical_shards, kv_cache_dtype(), ...
        return getattr(self.inner, name)

    # --- context ------------------------------------------------------------------------------
    def bind_weights(self, params: dict[str, torch.Tensor], role_of: Any) -> None:
        """Map weight identities to roles with `role_of(name) -> (layer, role) | None`; a role is a
        canonical op, or "qkv"/"gate_up" for megatron's fused projections."""
        for name, p in params.items():
            r = role_of(name)
            if r is not None:
                layer, op = r
                ops = {"qkv": ("q", "k", "v"), "gate_up": ("mlp_gate", "mlp_up")}.get(op, (op,))
                self._roles[id(p)] = Role(layer, ops, op if op in ("qkv", "gate_up") else "single")

    def bind_concat(self, fused: torch.Tensor, parts: list[torch.Tensor]) -> None:
        """`fused` is the row-concatenation of known weights (an engine's fused QKV or gate/up)."""
        roles = [self._roles.get(id(p)) for p in parts]
        if id(fused) in self._roles or any(r is None or len(r.ops) != 1 for r in roles):
            return
        layers = {r.layer for r in roles}
        if len(layers) == 1:
            self._roles[id(fused)] = Role(
                layers.pop(), tuple(r.ops[0] for r in roles), "concat", tuple(p.shape[0] for p in parts)
            )

    def set_rows(self, positions: torch.Tensor, logit_positions: torch.Tensor | None = None) -> None:
        """Absolute positions of the token rows of the forward about to run (and of its logits rows,
        when the engine computes logits for a subset)."""
        self._rows = positions.reshape(-1).long()
        self._logit_rows = None if logit_positions is None else logit_positions.reshape(-1).long()
        self._layer, self._pending = -1, None

    # --- recording ----------------------------------------------------------------------------
    def _ck(self, layer: int, op: str) -> Checkpoint:
        return checkpoint(layer, op, self.num_layers)

    def _record(self, layer: int, op: str, t: torch.Tensor) -> None:
        ck = self._ck(layer, op)
        if self._rows is None or not self.selection.wants(ck, self.num_layers):
            return
        rows = self._rows
        n = t.shape[0] if t.dim() else 1  # both engines keep tokens in the leading dim (batch of one)
        if n != rows.numel():
            # Computed for the logits rows only (the rollout's final norm/logits, every logprob).
            if self._logit_rows is None or n != self._logit_rows.numel():
                raise RuntimeError(f"{ck}: {tuple(t.shape)} fits neither the {rows.numel()} rows nor the logits rows")
            rows = self._logit_rows
        if rows.numel() == 0:  # e.g. a CP rank that holds only padding
            return
        flat = t.detach().reshape(rows.numel(), -1)
        if self.selection.positions is not None:
            keep = torch.tensor([int(p) in self.selection.positions for p in rows], dtype=torch.bool)
            if not keep.any():
                return
            rows, flat = rows[keep], flat[keep]
        self.records.add(ck, rows.to("cpu", copy=True), flat.to("cpu", copy=True))  # off the device: bounded GPU memory

    def _parts(self, role: Role, width: int) -> dict[str, torch.Tensor]:
        """Output columns of each op a fused weight computes (for a single op: all of them)."""
        idx = torch.arange(width)
        if role.kind == "qkv":
            return split_qkv(idx, self.heads_per_group, self.head_dim)
        if role.kind == "gate_up":
            return split_gate_up(idx)
        if role.kind == "concat":
            return dict(zip(role.ops, idx.split(list(role.sizes)), strict=True))
        return {role.ops[0]: idx}

    def _record_weighted(self, role: Role, t: torch.Tensor) -> None:
        if len(role.ops) == 1:
            self._record(role.layer, role.ops[0], t)
            return
        for op, cols in self._parts(role, t.shape[-1]).items():
            self._record(role.layer, op, t.index_select(-1, cols.to(t.device)))

    def _role(self, weight: torch.Tensor) -> Role | None:
        role = self._roles.get(id(weight))
        if role is not None and role.layer < self.num_layers:
            self._layer = role.layer
        return role

    def _kern(self, layer: int, *ops: str) -> Any:
        for op in ops:
            alt = self.perturb.get(Checkpoint(self.num_layers if op in POST_OPS else layer, op))
            if alt is not None:
                return alt
        return self.inner

    def _call(self, role: Role | None, method: str, *args: Any) -> torch.Tensor:
        """Run `method` on the kernel set of `role`'s op; a fused weight whose ops are perturbed only
        in part takes just those ops' columns from the perturbing set (the others stay untouched)."""
        if role is None or len(role.ops) == 1:
            ops = () if role is None else role.ops
            return getattr(self._kern(self._layer, *ops), method)(*args)
        y = getattr(self.inner, method)(*args)
        for op, cols in self._parts(role, y.shape[-1]).items():
            alt = self._kern(role.layer, op)
            if alt is not self.inner:
                y = y.clone()
                y[..., cols] = getattr(alt, method)(*args)[..., cols]
        return y

    # --- linear -------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._linear("linear", x, weight)

    def linear_k_sharded(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self._linear("linear_k_sharded", x, weight)

    def _linear(self, method: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        role = self._role(weight)
        if role is not None and role.ops == ("o_proj",):
            self._record(role.layer, "attn_out", x)
        y = self._call(role, method, x, weight)
        if role is not None:
            self._record_weighted(role, y)
        return y

    def linear_partials(self, x: torch.Tensor, weight: torch.Tensor, num_shards: int) -> torch.Tensor:
        # Row-parallel (o_proj, mlp_down) and LM-head linears: never fused, recorded at the combine.
        role = self._role(weight)
        if role is not None and role.ops == ("o_proj",):
            self._record(role.layer, "attn_out", x)
        self._pending = role
        return self._call(role, "linear_partials", x, weight, num_shards)

    def fold_partials(self, partials: torch.Tensor) -> torch.Tensor | None:
        # Asked between the partials and their combine (kernels/row_parallel): the op's own kernel set
        # decides whether its tree splits at rank boundaries (a perturbing set without the method does not).
        ops = () if self._pending is None else self._pending.ops
        fold = getattr(self._kern(self._layer, *ops), "fold_partials", None)
        return fold(partials) if fold is not None else None

    def combine_partials(self, partials: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        role, self._pending = self._pending, None
        y = self._call(role, "combine_partials", partials, out_dtype)
        if role is not None:
            self._record_weighted(role, y)
        return y

    def lm_head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        y = self._kern(self.num_layers, "logits").lm_head(x, weight)
        self._record(self.num_layers, "logits", y)
        return y

    # --- norms / activations / rotary ----------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        role = self._role(weight)
        if role is not None:
            layer, op = role.layer, role.ops[0]
            # The residual stream is what enters the next norm.
            if op == "input_norm":
                if layer > 0:
                    self._record(layer - 1, "residual", x)
                else:
                    self._record(-1, "embed", x)
            elif op == "post_attn_norm":
                self._record(layer, "attn_residual", x)
            elif op == "final_norm":
                self._record(self.num_layers - 1, "residual", x)
        y = self._call(role, "rms_norm", x, weight, eps)
        if role is not None:
            self._record_weighted(role, y)
        return y

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        y = self._kern(self._layer, "mlp_act").swiglu(gate, up)
        self._record(self._layer, "mlp_act", y)
        return y

    def rope_cos_sin(self, positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.rope_cos_sin(positions, head_dim, theta)

    def apply_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return self.inner.apply_rope(x, cos, sin)  # no role: the engines rotate through apply_rope_qk

    def apply_rope_qk(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for op, x in (("q_rope", q), ("k_rope", k)):
            y = self._kern(self._layer, op).apply_rope(x, cos, sin)
            self._record(self._layer, op, y)
            out.append(y)
        return out[0], out[1]

    # --- attention (recorded as the output projection's input) -----------------------------------
    def attention(self, *args: Any) -> torch.Tensor:
        return self._kern(self._layer, "attn_out").attention(*args)

    def attention_batched(self, *args: Any) -> torch.Tensor:
        return self._kern(self._layer, "attn_out").attention_batched(*args)

    def attention_pooled(
        self, q: torch.Tensor, q_pos: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, *args: Any
    ) -> torch.Tensor:
        k = self._kern(self._layer, "attn_out")
        if k is not self.inner:  # the pool holds the engine's cache dtype and layout; hand the other set its own
            dt = k.kv_cache_dtype(q.dtype)
            k_pool, v_pool = convert_layout(k_pool.to(dt), v_pool.to(dt), self.inner.kv_pool_layout, k.kv_pool_layout)
        return k.attention_pooled(q, q_pos, k_pool, v_pool, *args)

    def attention_tile_partial(self, *args: Any) -> Any:
        return self._kern(self._layer, "attn_out").attention_tile_partial(*args)

    def merge(self, a: Any, b: Any) -> Any:
        return self._kern(self._layer, "attn_out").merge(a, b)

    def finalize(self, p: Any, dtype: torch.dtype) -> torch.Tensor:
        return self._kern(self._layer, "attn_out").finalize(p, dtype)

    # --- logprobs -------------------------------------------------------------------------------
    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, vocab_size: int, temperature: float) -> torch.Tensor:
        y = self._kern(self.num_layers, "logprobs").logprobs(logits, tokens, vocab_size, temperature)
        self._record(self.num_layers, "logprobs", y)
        return y


def is_column_op(ck: Checkpoint) -> bool:
    return ck.op in TP_COLUMN_OPS
