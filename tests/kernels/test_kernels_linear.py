"""Invariance of the contract linear: batch composition / token count / row position, column shards,
canonical K-shards at TP=1/2/4, thread count. The plain set is the negative control."""

from __future__ import annotations

import random

import pytest
import torch
from support.kernel_utils import CONTRACT_SETS, DTYPES, num_threads, randn

from tonpolicy.kernels import get_kernels, padded_vocab_size
from tonpolicy.kernels.invariant.linear import SUM_BLOCK, _tree, tree_sum

# (K, N) pairs: the tiny profile, the hidden-1024 bench profile, and larger/odd widths.
SHAPES = [(128, 256), (128, 2048), (384, 128), (1024, 1024), (1024, 3072), (3072, 1024), (256, 96), (512, 4096)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_row_invariance(dtype, kernel_set):
    """A row's result never depends on which other rows share the call, nor where it sits."""
    k = get_kernels(kernel_set)
    rng = random.Random(0)
    for si, (kk, n) in enumerate(SHAPES):
        x = randn(300, kk, dtype=dtype, seed=si)
        w = randn(n, kk, dtype=dtype, seed=100 + si, std=kk**-0.5)
        full = k.linear(x, w)
        assert full.dtype == dtype
        for _ in range(6):
            m = rng.choice([1, 2, 7, 16, 17, 33, rng.randrange(1, 300)])
            off = rng.randrange(0, 300 - m + 1)
            assert torch.equal(k.linear(x[off : off + m], w), full[off : off + m]), (kk, n, m, off)
        # leading dims are just rows
        assert torch.equal(k.linear(x[:60].view(4, 15, kk), w), full[:60].view(4, 15, n))


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_column_shards(dtype, kernel_set):
    """Column-parallel shards (any TP dividing the width) equal the matching columns bitwise."""
    k = get_kernels(kernel_set)
    for si, (kk, n) in enumerate(SHAPES):
        x = randn(37, kk, dtype=dtype, seed=si)
        w = randn(n, kk, dtype=dtype, seed=50 + si, std=kk**-0.5)
        full = k.linear(x, w)
        for tp in (2, 4, 8):
            if n % (tp * 32):
                continue
            c = n // tp
            for r in range(tp):
                shard = w[r * c : (r + 1) * c].contiguous()
                assert torch.equal(k.linear(x, shard), full[:, r * c : (r + 1) * c]), (kk, n, tp, r)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_parallel_canonical_shards(dtype, kernel_set):
    """TP ranks computing their canonical K-shards, gathered in rank order and tree-combined, give the
    TP=1 bits (also for the fp32 logits path)."""
    k = get_kernels(kernel_set, canonical_shards=4)
    for si, (kk, n) in enumerate(SHAPES):
        x = randn(23, kk, dtype=dtype, seed=si)
        w = randn(n, kk, dtype=dtype, seed=70 + si, std=kk**-0.5)
        ref = k.linear_k_sharded(x, w)
        ref32 = k.combine_partials(k.linear_partials(x, w, 4), torch.float32)
        for tp in (1, 2, 4):
            c = kk // tp
            parts = [
                k.linear_partials(
                    x[:, r * c : (r + 1) * c].contiguous(), w[:, r * c : (r + 1) * c].contiguous(), 4 // tp
                )
                for r in range(tp)
            ]
            gathered = torch.cat(parts, dim=0)
            # every partial is the contract GEMM's fp32 result, summed in fp32
            assert gathered.shape == (4, 23, n) and gathered.dtype == torch.float32
            assert torch.equal(k.combine_partials(gathered, dtype), ref), (kk, n, tp)
            assert torch.equal(k.combine_partials(gathered, torch.float32), ref32)
            # strided (non-contiguous) rank slices give the same partials
            strided = [
                k.linear_partials(x[:, r * c : (r + 1) * c], w[:, r * c : (r + 1) * c], 4 // tp) for r in range(tp)
            ]
            assert torch.equal(torch.cat(strided), gathered)
            assert torch.equal(
                torch.cat(
                    [
                        k.linear_partials(x[:1, r * c : (r + 1) * c], w[:, r * c : (r + 1) * c], 4 // tp)
                        for r in range(tp)
                    ]
                ),
                gathered[:, :1],
            )


def _row_parallel_rank(cases: list[tuple[str, torch.dtype, int]]) -> list[bool]:
    """One TP rank of a row-parallel linear over gloo, per (kernel set, dtype, canonical shards): its
    consecutive K-shards' partials combined across the group; whether every rank got the TP=1 bits."""
    import torch.distributed as dist

    from tonpolicy.kernels.row_parallel import combine_row_parallel

    dist.init_process_group("gloo")
    tp, rank = dist.get_world_size(), dist.get_rank()
    ok = []
    for kernel_set, dtype, shards in cases:
        k = get_kernels(kernel_set, canonical_shards=shards) if kernel_set != "plain" else get_kernels(kernel_set)
        same = True
        for si, (kk, n) in enumerate(SHAPES[:4]):
            x = randn(19, kk, dtype=dtype, seed=si)
            w = randn(n, kk, dtype=dtype, seed=90 + si, std=kk**-0.5)
            c = kk // tp
            mine = k.linear_partials(x[:, rank * c : (rank + 1) * c], w[:, rank * c : (rank + 1) * c], shards // tp)
            same &= torch.equal(combine_row_parallel(k, mine, dtype, dist.group.WORLD), k.linear_k_sharded(x, w))
        every: list[bool] = [False] * tp
        dist.all_gather_object(every, same)
        ok.append(all(every))
    return ok


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_combine_across_gloo_ranks(tp):
    """The row-parallel combine over real gloo ranks (each rank its subtree sum, then one all-reduce at
    TP=2 or a gather of the subtree sums at TP=4) gives every rank the TP=1 bits, bf16 and fp32; with
    8 canonical shards too (2 per rank at TP=4). Negative control: the plain kernels do not keep TP=1's
    bits across ranks."""
    from tonpolicy.trainer.process_groups import spawn

    cases = [(s, d, 4) for s in CONTRACT_SETS for d in DTYPES]
    cases += [("ordered", torch.float32, 8), ("plain", torch.float32, 4)]
    assert spawn(_row_parallel_rank, tp, cases) == [True] * (len(cases) - 1) + [False]


def test_fold_partials_splits_the_tree_at_power_of_two_groups(kernel_set):
    """A rank's `fold_partials` (its subtree of the pairwise tree) stands in for its partials in
    `combine_partials`, for 8 shards over 2, 4 and 8 ranks; 3 shards per rank do not split the tree (None).
    Negative control: a left-to-right sum of the same partials (another order) differs from the tree."""
    k = get_kernels(kernel_set)
    parts = randn(8, 64, 512, dtype=torch.float32, seed=5) * randn(8, 1, 1, dtype=torch.float32, seed=6).exp()
    whole = k.combine_partials(parts, torch.float32)
    for ranks in (2, 4, 8):
        g = 8 // ranks
        folds = torch.stack([k.fold_partials(parts[r * g : (r + 1) * g]) for r in range(ranks)])
        assert torch.equal(k.combine_partials(folds, torch.float32), whole), ranks
    assert k.fold_partials(parts[:3]) is None
    left = parts[0].clone()
    for p in parts[1:]:
        left += p
    assert not torch.equal(left, whole)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tree_sum_in_row_blocks_keeps_the_bits(dtype):
    """A long sum runs in row blocks (`SUM_BLOCK`; prefill-sized partials): every element the same as
    the whole-tensor tree, for 2, 3, 4 and 8 partials, ragged last blocks and leading dims, rounded to
    bf16 or kept fp32. Negative control: a left-to-right sum of the same fp32 partials differs."""
    n = 256
    rows = 3 * (SUM_BLOCK // n) + 37  # blocked (over two blocks), last block ragged
    for c in (2, 3, 4, 8):
        parts = randn(c, rows, n, seed=c) * randn(c, 1, 1, seed=20 + c).exp()
        parts = parts.to(dtype)
        whole = _tree(parts, False)
        for out_dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(tree_sum(parts, out_dtype), whole.to(out_dtype)), (c, out_dtype)
        lead = parts.view(c, 1, rows, n)
        assert torch.equal(tree_sum(lead), whole.view(1, rows, n)), c
        if dtype == torch.float32 and c > 3:  # 2, 3 partials: the tree is a left fold; sums of bf16 are exact
            left = parts[0].clone()
            for p in parts[1:]:
                left += p
            assert not torch.equal(left, whole), c


def test_combine_tree_order(kernel_set):
    k = get_kernels(kernel_set)
    p = torch.tensor([[1e8], [1.0], [-1e8], [1.0]], dtype=torch.float32)
    # ((1e8 + 1) + (-1e8 + 1)) in fp32 = 1e8 - 1e8 = 0 exactly; a left fold would give 1.0.
    assert k.combine_partials(p, torch.float32).item() == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_thread_invariance(dtype, kernel_set):
    k = get_kernels(kernel_set)
    for si, (kk, n) in enumerate(SHAPES):
        x = randn(70, kk, dtype=dtype, seed=si)
        w = randn(n, kk, dtype=dtype, seed=10 + si, std=kk**-0.5)
        with num_threads(1):
            a = k.linear(x, w)
            a1 = k.linear(x[5:6], w)
        with num_threads(2):
            b = k.linear(x, w)
            b1 = k.linear(x[5:6], w)
        assert torch.equal(a, b) and torch.equal(a1, b1) and torch.equal(a1, a[5:6])


def test_linear_accuracy_fp32_accumulation(kernel_set):
    k = get_kernels(kernel_set)
    x = randn(9, 1024, dtype=torch.bfloat16, seed=1)
    w = randn(512, 1024, dtype=torch.bfloat16, seed=2, std=0.03)
    exact = x.double() @ w.double().T
    got = k.linear(x, w).double()
    # one bf16 rounding of an fp32-accumulated result: within half a bf16 ulp plus fp32 noise
    assert ((got - exact).abs() <= exact.abs() * 2**-8 + 1e-5).all()


def test_plain_linear_is_not_row_invariant():
    """Negative control: plain F.linear results for a row depend on the batch (1 row vs 64, fp32, on some
    shape; on every CPU measured one row alone takes a GEMV path)."""
    k = get_kernels("plain")
    mismatches = 0
    for si, (kk, n) in enumerate(SHAPES):
        x = randn(64, kk, seed=si)
        w = randn(n, kk, seed=9 + si, std=kk**-0.5)
        mismatches += int(not torch.equal(k.linear(x[:1], w), k.linear(x, w)[:1]))
    assert mismatches > 0


def test_padded_vocab_size():
    assert padded_vocab_size(2003, 4) == 2048
    assert padded_vocab_size(151936, 4) == 152064 and 152064 % 512 == 0
    assert padded_vocab_size(512, 4) == 512 and padded_vocab_size(513, 2) == 768


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_autograd_and_weight_updates(dtype, kernel_set):
    """The trainer differentiates through the contract linear; no stale copy survives a weight update."""
    k = get_kernels(kernel_set)
    for m in (3, 40, 300):
        x = randn(m, 128, dtype=dtype, seed=1).requires_grad_()
        w = randn(64, 128, dtype=dtype, seed=2, std=0.1).requires_grad_()
        y = k.linear(x, w)
        with torch.no_grad():  # the untracked path (rollout) gives the tracked path's (trainer's) bits
            assert torch.equal(y.detach(), k.linear(x.detach(), w.detach()))
            assert torch.equal(k.linear_k_sharded(x, w), k.linear_k_sharded(x.detach(), w.detach()))
        assert torch.equal(k.linear_k_sharded(x, w).detach(), k.linear_k_sharded(x.detach(), w.detach()))
        if dtype == torch.bfloat16:
            continue
        y.square().sum().backward()
        ref_gx = 2 * (x @ w.T) @ w
        assert x.grad is not None and w.grad is not None
        assert (x.grad - ref_gx).abs().max() < 1e-4
    wb = randn(64, 128, dtype=torch.bfloat16, seed=3)
    xb = randn(5, 128, dtype=torch.bfloat16, seed=4)
    before = k.linear(xb, wb)
    with torch.no_grad():
        wb.mul_(2)  # an in-place update (weight sync) is seen at once
    assert torch.equal(k.linear(xb, wb), k.linear(xb, wb.clone()))  # a fresh tensor is never cached
    assert not torch.equal(k.linear(xb, wb), before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_weights_equal_separate(dtype, kernel_set):
    """The model runs Q/K/V and gate/up as one wide linear; each block equals its own linear."""
    k = get_kernels(kernel_set)
    layouts = [
        (128, [256, 128, 128]),
        (128, [384, 384]),
        (1024, [1024, 512, 512]),
        (1024, [3072, 3072]),
        (2560, [4096, 1024, 1024]),
        (256, [96, 32, 32]),
    ]
    for li, (kk, widths) in enumerate(layouts):
        ws = [randn(n, kk, dtype=dtype, seed=li * 10 + j, std=kk**-0.5) for j, n in enumerate(widths)]
        for m in (1, 19):
            x = randn(m, kk, dtype=dtype, seed=li)
            fused = k.linear(x, torch.cat(ws))
            assert torch.equal(fused, torch.cat([k.linear(x, w) for w in ws], dim=-1)), (kk, widths, m)


def test_linear_qwen3_4b_shapes(kernel_set):
    """Row, TP-shard and thread invariance at Qwen3-4B widths (hidden 2560, intermediate 9728)."""
    k = get_kernels(kernel_set)
    for kk, n in [(2560, 9728), (9728, 2560), (2560, 4096)]:
        x = randn(40, kk, dtype=torch.bfloat16, seed=kk)
        w = randn(n, kk, dtype=torch.bfloat16, seed=n, std=kk**-0.5)
        full = k.linear(x, w)
        assert torch.equal(k.linear(x[17:18], w), full[17:18])
        assert torch.equal(k.linear(x[3:36], w), full[3:36])
        c = kk // 2
        parts = torch.cat(
            [k.linear_partials(x[:, r * c : (r + 1) * c], w[:, r * c : (r + 1) * c], 2) for r in range(2)]
        )
        assert torch.equal(k.combine_partials(parts, torch.bfloat16), k.linear_k_sharded(x, w))
        assert torch.equal(k.linear(x, w[: n // 2]), full[:, : n // 2])
        with num_threads(1):
            assert torch.equal(k.linear(x, w), full)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_operand_layout_invariance(dtype, kernel_set):
    """Column-major (transposed-storage) inputs or weights give the same bits: operands are normalised
    to row-major, because a transposed GEMM operand selects a different kernel."""
    k = get_kernels(kernel_set)
    x = randn(21, 256, dtype=dtype, seed=1)
    w = randn(384, 256, dtype=dtype, seed=2, std=0.06)
    ref = k.linear(x, w)
    assert torch.equal(k.linear(x.t().contiguous().t(), w), ref)
    assert torch.equal(k.linear(x, w.t().contiguous().t()), ref)
    assert torch.equal(k.linear(x[:1].t().contiguous().t(), w.t().contiguous().t()), ref[:1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_long_prefill_rows(dtype, kernel_set):
    """A 1100-row prefill gives every row the bits of that row alone or in any slice, at 1 thread too."""
    k = get_kernels(kernel_set)
    x = randn(1100, 1024, dtype=dtype, seed=5)
    w = randn(1024, 1024, dtype=dtype, seed=6, std=1 / 32)
    full = k.linear(x, w)
    for off, m in [(0, 1), (130, 1), (639, 2), (650, 50), (100, 300), (3, 1090)]:
        assert torch.equal(k.linear(x[off : off + m], w), full[off : off + m])
    sharded = k.linear_k_sharded(x, w)
    with num_threads(1):
        assert torch.equal(k.linear_k_sharded(x[500:1100], w), sharded[500:1100])


def test_bf16_logits_option(kernel_set):
    """logits_dtype=bfloat16: the LM head is the bf16 linear, upcast (no fp32 weight copy); the default
    fp32 head differs from it by bf16 rounding, and its vocab shards still equal its columns."""
    k16 = get_kernels(kernel_set, logits_dtype="bfloat16")
    k32 = get_kernels(kernel_set)
    x = randn(9, 256, dtype=torch.bfloat16, seed=1)
    w = randn(2004, 256, dtype=torch.bfloat16, seed=2, std=1 / 16)
    logits = k16.lm_head(x, w)
    assert logits.dtype == torch.float32 and torch.equal(logits, k16.linear(x, w).float())
    assert torch.equal(k16.lm_head(x, w[:1002]), logits[:, :1002])
    diff = (k32.lm_head(x, w) - logits).abs().max().item()
    assert 0 < diff < 0.05
    with pytest.raises(ValueError, match="logits_dtype"):
        get_kernels("plain", logits_dtype="bfloat16")
