"""The `triton` kernel set's structure, in Triton's interpreter on this CPU (fp32 and fp16 operands:
the interpreter's bf16 `tl.dot` is wrong). Proven here: row/M, N-shard and TP-shard invariance of the
GEMM (fused and split routes), attention through one kernel for prefill, chunked prefill, paged decode
and ring-CP tiles, per-row invariance of the row-local ops, closeness to the reference formulas, and
the reference gradients under autograd, every member of the GEMM family giving the same bits. Negative
controls: an M-dependent split-K GEMM, a GEMM family member with another BLOCK_K and a
misaligned key tiling fail the same checks. On a GPU, experiments/gpu/triton_check.py proves the bits
of the compiled kernels (bf16 included)."""

from __future__ import annotations

import pytest
import torch

from tonpolicy.kernels import get_kernels
from tonpolicy.kernels import pointwise as ref
from tonpolicy.kernels.invariant.linear import tree_sum
from tonpolicy.kernels.triton import attention as ta
from tonpolicy.kernels.triton import linear as tlin
from tonpolicy.trainer.cp_layout import local_positions
from tonpolicy.trainer.ring_chunks import ChunkAssembler

# Triton 3.6's interpreter converts 1-element arrays to Python ints the way NumPy deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
DTYPES = [torch.float32, torch.float16]
K, N = 256, 160  # 4 canonical shards of 64 (one BLOCK_K each); N spans two column tiles


def _data(m: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, K, generator=g).to(dtype), (torch.randn(N, K, generator=g) / 16).to(dtype)


def _row_invariant(linear, x: torch.Tensor, w: torch.Tensor) -> bool:  # noqa: ANN001
    """Rows computed in calls of M = 1, 3, 130 and 520 (one per batch-size bucket: split-K with the fold in
    the kernel, grouped tiles, persistent TMA tiles) equal one another."""
    full = linear(x, w)
    return all(torch.equal(linear(x[lo:hi], w), full[lo:hi]) for lo, hi in ((0, 1), (5, 8), (390, 520), (0, 130)))


# Row-parallel (canonical shards: split-K for few rows) in fp32, column-parallel (K whole) in fp16; the
# other two pairs are covered by the family check and by the decode row of the TP test below.
@pytest.mark.parametrize("dtype,shards", [(torch.float32, 4), (torch.float16, 1)])
def test_linear_rows_invariant_to_m_and_route(dtype: torch.dtype, shards: int) -> None:
    x, w = _data(520, dtype)
    members = {tlin.tiles_for(m, dtype, torch.device("cpu")) for m in (1, 3, 130, 520)}
    assert len(members) >= 2 and any(t.persistent for t in members)  # the rows cross bucket members
    assert dtype == torch.float32 or any(t.tma for t in members)
    assert _row_invariant(lambda a, b: tlin.linear(a, b, shards, torch.float32), x, w)


def test_every_gemm_family_member_gives_the_same_bits() -> None:
    """The family check run at a GPU's first GEMM, here under the interpreter: every member, K whole and
    sharded, fold in registers and split-K, agrees. Negative control: a member with another BLOCK_K (a
    different chain) is refused, with the rule in the error."""
    cpu = torch.device("cpu")
    tlin.check_family(cpu, torch.float32)
    other_k = tlin.Tiles(64, 64, 4, 3, block_k=tlin.BLOCK_K // 2)
    with pytest.raises(tlin.GemmFamilyMismatch, match=f"BLOCK_K={tlin.BLOCK_K}.*refusing"):
        tlin.check_family(cpu, torch.float32, (tlin.FAMILY[0], other_k))


def test_negative_control_m_dependent_split_breaks_row_invariance() -> None:
    """cuBLAS-style: split K and reduce by a tree for short inputs only. The same check catches it."""
    x, w = _data(520, torch.float32)

    def m_dependent(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if a.shape[0] <= 16:
            return tree_sum(tlin.partials(a, b, 4))
        return tlin.linear(a, b, 4, torch.float32)

    assert not _row_invariant(m_dependent, x, w)
    assert (m_dependent(x[:1], w) != tlin.linear(x, w, 4, torch.float32)[:1]).any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_column_shards_and_tp_shards(dtype: torch.dtype) -> None:
    x, w = _data(70, dtype, 1)
    full = tlin.linear(x, w, 4, dtype)
    for lo, hi in ((0, 64), (64, 160), (32, 97)):  # N-shards, aligned to the tile or not
        assert torch.equal(tlin.linear(x, w[lo:hi], 4, dtype), full[:, lo:hi])
    for tp in (1, 2, 4):  # each rank: its K columns, its share of the canonical shards; rank order
        ks = K // tp
        stack = torch.cat(
            [tlin.partials(x[:, r * ks : (r + 1) * ks], w[:, r * ks : (r + 1) * ks], 4 // tp) for r in range(tp)]
        )
        assert torch.equal(tlin.fold(stack, dtype), full), tp
    assert torch.allclose(full.float(), x.float() @ w.float().T, atol=2e-2 if dtype == torch.float16 else 1e-4)
    if dtype == torch.float32:  # the interpreter upcasts fp16 exactly: one dtype proves these routes
        whole = tlin.linear(x, w, 1, dtype)  # column-parallel: a TP rank's columns are the full GEMM's columns
        assert torch.equal(tlin.linear(x, w[32:97], 1, dtype), whole[:, 32:97])
        # A decode row's TP=2 partials fold to the bits of the split-K route (one row) and of the prefill rows.
        halves = [tlin.partials(x[:1, r * 128 : (r + 1) * 128], w[:, r * 128 : (r + 1) * 128], 2) for r in (0, 1)]
        assert torch.equal(tlin.fold(torch.cat(halves), dtype), full[:1])
        assert torch.equal(tlin.linear(x[:1], w, 4, dtype), full[:1])


def _attn_data(n: int, dtype: torch.dtype, hq: int = 4, hkv: int = 2, d: int = 32):
    g = torch.Generator().manual_seed(n)
    return tuple(torch.randn(n, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))


def _reference_attention(q, k, v, scale):  # noqa: ANN001, ANN202
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float().repeat_interleave(g, 1)) * scale
    n = q.shape[0]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v.float().repeat_interleave(g, 1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_prefill_chunked_decode_one_structure(dtype: torch.dtype) -> None:
    """150 keys: two chunks, three tiles. Prefill (one program walks the chunks), chunked prefill, decode
    at batch 1, 3 and 8 (split-KV: a program per chunk, then the fold) and batched sequences agree."""
    kern = get_kernels("triton", attention_tile=64)
    n, scale = 150, 0.2
    assert ta.CHUNK < n <= 2 * ta.CHUNK and ta.TILES_PER_CHUNK > 1
    q, k, v = _attn_data(n, dtype)
    pos = torch.arange(n)
    full = kern.attention(q, k, v, pos, pos, scale)
    assert not ta.split_kv(1, n, 4, 2, 32, n)
    assert torch.allclose(
        full.float(), _reference_attention(q, k, v, scale), atol=2e-3 if dtype == torch.float16 else 1e-5
    )
    # Chunked prefill: queries [100, 150) over every key.
    assert torch.equal(kern.attention(q[100:], k, v, pos[100:], pos, scale), full[100:])
    # Paged decode from a 2-slot pool (slot 1 holds this sequence; stale NaN rows past its end), batched
    # with another sequence of a different length (slot 0, 40 keys, its query at 39).
    kp = torch.full((2, 256, 2, 32), float("nan")).to(dtype)
    vp = kp.clone()
    kp[1, :n], vp[1, :n] = k, v
    kp[0, :40], vp[0, :40] = k[:40] * 2, v[:40]
    other = {}
    for at in ([149], [-1, 127, 64], [0, -1, 63, 64, 127, 128, 149, 100]):  # batch 1, 3, 8; -1: slot 0
        assert ta.split_kv(len(at), 1, 4, 2, 32, n)  # decode takes split-KV, prefill above does not
        slots = torch.tensor([0 if i < 0 else 1 for i in at])
        qpos = torch.tensor([[39] if i < 0 else [i] for i in at])
        q2 = torch.stack([q[39] if i < 0 else q[i] for i in at])[:, None]
        out = kern.attention_pooled(q2, qpos, kp, vp, slots, n, scale)
        for row, i in enumerate(at):
            if i < 0:
                other.setdefault("slot0", out[row, 0])
                assert torch.equal(out[row, 0], other["slot0"]), len(at)
            else:
                assert torch.equal(out[row, 0], full[i]), (len(at), i)
    # Batched sequences: the same rows whatever the batch holds.
    qb, kb, vb = (torch.stack([t, t.flip(0)]) for t in (q, k, v))
    out = kern.attention_batched(qb, kb, vb, torch.stack([pos, pos]), torch.stack([pos, pos]), scale)
    assert torch.equal(out[0], full)


def test_attention_ring_chunks_merge_to_the_single_device_result() -> None:
    """CP2 zigzag (blocks of 64 keys): rank 0's queries get its blocks, then rank 1's; each 128-key
    chunk straddles two blocks of two ranks and is computed once whole. Negative control: the same keys
    merged per 64-key tile (a split size other than the contract's) give other bits."""
    kern = get_kernels("triton", attention_tile=64)
    n, scale, cp = 256, 0.3, 2
    q, k, v = _attn_data(n, torch.float32)
    pos = torch.arange(n)
    mine = local_positions(n, cp, 0, "ring")[56:72]  # a few of rank 0's queries, from both its blocks
    want = kern.attention(q[mine], k, v, mine, pos, scale)
    chunks = ChunkAssembler(kern.attention_chunk, n, int(mine.max()))
    parts = {}
    for src in (0, 1):  # ring order at rank 0: its own blocks, then rank 1's
        kpos = local_positions(n, cp, src, "ring")
        for c, kc, vc, pc in chunks.add(k[kpos], v[kpos], kpos):
            parts[c] = kern.attention_chunk_partial(q[mine], kc, vc, mine, pc, scale)
    chunks.check_complete()
    assert sorted(parts) == [0, 1]
    assert torch.equal(kern.finalize(kern.merge(parts[0], parts[1]), q.dtype), want)
    tiles = [
        kern.attention_tile_partial(q[mine], k[t : t + 64], v[t : t + 64], mine, pos[t : t + 64], scale)
        for t in range(0, n, 64)
    ]
    acc = tiles[0]
    for p in tiles[1:]:
        acc = kern.merge(acc, p)
    per_tile = kern.finalize(acc, q.dtype)
    assert torch.allclose(per_tile, want, atol=1e-5) and not torch.equal(per_tile, want)


def test_negative_control_misaligned_key_tiles_change_bits() -> None:
    """Keys folded in 48-key pieces (tiles not aligned to the contract's 64) give other bits."""
    n, scale = 192, 0.3
    q, k, v = _attn_data(n, torch.float32)
    pos = torch.arange(n)
    aligned = ta.attention_indexed(q[None], pos[None], k, v, pos[None], pos[None], torch.tensor([n]), scale)[0]
    acc = None
    for t in range(0, n, 48):
        idx = torch.arange(48)[None]
        p = ta.attention_indexed(
            q[None],
            pos[None],
            k[t : t + 48],
            v[t : t + 48],
            idx,
            pos[None, t : t + 48],
            torch.tensor([48]),
            scale,
            partial=True,
        )
        acc = p if acc is None else ta.merge(acc, p)
    misaligned = ta.finalize(acc[1], acc[2], torch.float32)[0]
    assert torch.allclose(misaligned, aligned, atol=1e-5)
    assert not torch.equal(misaligned, aligned)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_local_ops_match_reference_and_are_row_invariant(dtype: torch.dtype) -> None:
    kern = get_kernels("triton", attention_tile=64)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 96, generator=g).to(dtype)
    w = (1 + torch.randn(96, generator=g) / 10).to(dtype)
    y = kern.rms_norm(x, w, 1e-6)
    assert torch.equal(kern.rms_norm(x[5:6], w, 1e-6), y[5:6])
    assert torch.allclose(y.float(), ref.rms_norm(x, w, 1e-6).float(), atol=1e-2 if dtype == torch.float16 else 1e-6)
    inter = torch.randn(9, 2 * 96, generator=g).to(dtype)
    gate, up = inter.chunk(2, dim=-1)
    s = kern.swiglu(gate, up)
    assert torch.equal(kern.swiglu(gate[2:3], up[2:3]), s[2:3])
    assert torch.allclose(s.float(), ref.swiglu(gate, up).float(), atol=1e-2 if dtype == torch.float16 else 1e-6)
    qk = torch.randn(12, 6, 32, generator=g).to(dtype)
    cos, sin = kern.rope_cos_sin(torch.arange(12), 32, 1e6)
    r = kern.apply_rope(qk, cos, sin)
    assert torch.equal(kern.apply_rope(qk[4:5], cos[4:5], sin[4:5]), r[4:5])
    assert torch.equal(r, ref.apply_rope(qk, cos, sin))  # IEEE * and + in both (no FMA), one rounding
    logits = torch.randn(7, 3000, generator=g) * 3
    tok = torch.randint(0, 2003, (7,), generator=g)
    for t in (1.0, 0.7):
        lp = kern.logprobs(logits, tok, 2003, t)
        assert torch.equal(kern.logprobs(logits[3:4], tok[3:4], 2003, t), lp[3:4])
        assert torch.allclose(lp, ref.logprobs(logits, tok, 2003, t), atol=1e-5)


def test_row_local_ops_backward_is_the_reference_gradient() -> None:
    kern = get_kernels("triton", attention_tile=64)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 64, generator=g, requires_grad=True)
    w = (1 + torch.randn(64, generator=g) / 10).requires_grad_()
    cot = torch.randn(5, 64, generator=g)
    got = torch.autograd.grad(kern.rms_norm(x, w, 1e-6), (x, w), cot)
    want = torch.autograd.grad(ref.rms_norm(x, w, 1e-6), (x, w), cot)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    logits = torch.randn(3, 600, generator=g, requires_grad=True)
    tok = torch.tensor([1, 5, 300])
    got = torch.autograd.grad(kern.logprobs(logits, tok, 500, 0.9).sum(), logits)[0]
    want = torch.autograd.grad(ref.logprobs(logits, tok, 500, 0.9).sum(), logits)[0]
    assert torch.equal(got, want)


def test_trainer_flash_backward_agrees_with_the_textbook_backward() -> None:
    """The trainer's attention with this set: the forward is the contract kernel's bits (logprobs stay
    exact), the gradients (FlashAttention's recurrence from the saved output and log-sum-exp) agree with
    the written-out softmax backward to fp32 rounding; gradients are not under the contract, so allclose.
    Control: the same tolerance tells these gradients from those of attention without the causal mask."""
    from tonpolicy.trainer.cp_attention import batched_attention
    from tonpolicy.trainer.kernel_autograd import attention_grads

    kern = get_kernels("triton", attention_tile=64)
    g = torch.Generator().manual_seed(7)
    b, n, scale = 2, 70, 0.3
    q, cot = (torch.randn(b, n, 2, 16, generator=g) for _ in range(2))  # two batch rows, two blocks, GQA 2
    k, v = (torch.randn(b, n, 1, 16, generator=g) for _ in range(2))
    pos = torch.arange(n).repeat(b, 1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = batched_attention(kern, *leaves, pos, scale)
    assert torch.equal(out.detach(), kern.attention_batched(q, k, v, pos, pos, scale))
    got = torch.autograd.grad(out, leaves, cot)
    want = attention_grads(q, k, v, pos, cot, scale)
    assert all(torch.allclose(a, w, rtol=1e-4, atol=1e-5) for a, w in zip(got, want, strict=True))
    unmasked = attention_grads(q, k, v, torch.zeros_like(pos), cot, scale)
    assert not any(torch.allclose(a, u, rtol=1e-4, atol=1e-5) for a, u in zip(got, unmasked, strict=True))


def test_trainer_row_local_fused_backward_agrees_with_the_textbook_backward() -> None:
    """The trainer's RMSNorm and SwiGLU with this set: one fused backward launch each, gradients allclose
    to kernel_autograd's textbook formulas (not under the contract); the forward is the kernel's either way.
    Control: the same tolerance tells the RMSNorm gradient from the one with eps changed."""
    from tonpolicy.trainer.kernel_autograd import KernelRMSNorm, KernelSwiGLU

    kern = get_kernels("triton", attention_tile=64)
    g = torch.Generator().manual_seed(9)
    x, cot = torch.randn(19, 96, generator=g), torch.randn(19, 96, generator=g)
    w = 1 + torch.randn(96, generator=g) / 10

    def grads(fn, eps: float = 1e-6):  # noqa: ANN001, ANN202
        leaves = [x.clone().requires_grad_(), w.clone().requires_grad_()]
        return torch.autograd.grad(KernelRMSNorm.apply(*leaves, eps, fn), leaves, cot)

    fused, text = grads(kern.rms_norm), grads(lambda a, b, e: kern.rms_norm(a, b, e))  # a lambda: no fused one
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(fused, text, strict=True))
    assert not torch.allclose(grads(lambda a, b, e: kern.rms_norm(a, b, e), 0.5)[0], fused[0], rtol=1e-5, atol=1e-5)
    inter = torch.randn(7, 2 * 80, generator=g)
    gate, up = (t.clone().requires_grad_() for t in inter.chunk(2, dim=-1))
    cot2 = torch.randn(7, 80, generator=g)
    fused = torch.autograd.grad(KernelSwiGLU.apply(gate, up, kern.swiglu), (gate, up), cot2)
    text = torch.autograd.grad(KernelSwiGLU.apply(gate, up, lambda a, b: kern.swiglu(a, b)), (gate, up), cot2)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(fused, text, strict=True))
