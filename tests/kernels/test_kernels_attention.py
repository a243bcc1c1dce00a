"""Split-KV attention invariance: prefill vs one-query decode vs chunked prefill, batched decode of
sequences of different lengths, the tile-by-tile merge (also across a ring-CP style key split), masked
tiles as exact no-ops, thread count. The plain set (SDPA) is the negative control."""

from __future__ import annotations

import random

import pytest
import torch
from support.kernel_utils import DTYPES, num_threads, randn

from tonpolicy.kernels import get_kernels
from tonpolicy.kernels.invariant import attention as invariant_attention
from tonpolicy.kernels.invariant import attention_keys

HEADS = [(8, 4, 32), (4, 4, 64), (16, 2, 128)]  # (Hq, Hkv, D): tiny profile, MHA, wide GQA


def _qkv(n: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int):
    return (
        randn(n, hq, d, dtype=dtype, seed=seed),
        randn(n, hkv, d, dtype=dtype, seed=seed + 1),
        randn(n, hkv, d, dtype=dtype, seed=seed + 2),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tile", [32, 16])
def test_prefill_decode_chunked_equal(dtype, tile, kernel_set):
    k = get_kernels(kernel_set, attention_tile=tile)
    rng = random.Random(tile)
    for ci, (hq, hkv, d) in enumerate(HEADS):
        n = rng.choice([47, 100, 131]) if ci else 161
        q, kk, v = _qkv(n, hq, hkv, d, dtype, seed=ci * 10)
        pos = torch.arange(n)
        scale = d**-0.5
        full = k.attention(q, kk, v, pos, pos, scale)
        assert full.dtype == dtype and full.shape == q.shape
        # one query at a time against the keys [0..i] (decode)
        for i in sorted(rng.sample(range(n), 6)) + [0, n - 1]:
            one = k.attention(q[i : i + 1], kk[: i + 1], v[: i + 1], pos[i : i + 1], pos[: i + 1], scale)
            assert torch.equal(one, full[i : i + 1]), (hq, d, i)
        # chunked prefill with random chunk boundaries (not tile multiples)
        s = 0
        while s < n:
            e = min(n, s + rng.randrange(1, 40))
            part = k.attention(q[s:e], kk[:e], v[:e], pos[s:e], pos[:e], scale)
            assert torch.equal(part, full[s:e]), (hq, d, s, e)
            s = e


@pytest.mark.parametrize("dtype", DTYPES)
def test_query_block_size_is_a_speed_knob(dtype, monkeypatch, kernel_set):
    """Query rows per attention GEMM change no bit as long as every GEMM has a multiple of 4 rows (the
    `row_tile` granule), which is why decode pads one query only to 4 rows, and why the query block is
    sized for speed and memory. Negative control: GEMMs of 1-2 rows (granule 1, no GQA group) take
    another path and differ."""
    rng = random.Random(5)
    for hq, hkv, d in HEADS:
        n = 70
        q, kk, v = _qkv(n, hq, hkv, d, dtype, seed=hq)
        pos = torch.arange(n)
        k = get_kernels(kernel_set)
        ref = k.attention(q, kk, v, pos, pos, d**-0.5)
        for budget in (1, 1 << 12, 1 << 16, 1 << 30):  # blocks of 1-2 queries .. all queries at once
            monkeypatch.setattr(invariant_attention, "SCORE_BUDGET", budget)
            assert torch.equal(k.attention(q, kk, v, pos, pos, d**-0.5), ref), (hq, hkv, budget)
            i = rng.randrange(n)
            one = k.attention(q[i : i + 1], kk[: i + 1], v[: i + 1], pos[i : i + 1], pos[: i + 1], d**-0.5)
            assert torch.equal(one, ref[i : i + 1])
    monkeypatch.undo()
    q, kk, v = _qkv(n, 4, 4, 64, torch.float32, seed=9)
    ref = get_kernels(kernel_set).attention(q, kk, v, pos, pos, 0.125)
    ungrouped = get_kernels(kernel_set, row_tile=1)
    assert torch.equal(ungrouped.attention(q, kk, v, pos, pos, 0.125), ref)  # blocks of 32 rows: same bits
    alone = [
        ungrouped.attention(q[i : i + 1], kk[: i + 1], v[: i + 1], pos[i : i + 1], pos[: i + 1], 0.125)
        for i in range(n)
    ]
    assert torch.equal(torch.cat(alone), ref)  # one query alone, a 1-row GEMM: the contract GEMM's same bits


def _pooled(kern, q, kk, v, pos, scale):  # noqa: ANN001, ANN202
    """`attention_pooled` over a head-layout pool holding keys [0, len(kk)) in slot 1 (the engine's
    decode and chunked-prefill path), then a tile of stale keys; queries at the last len(q) positions."""
    t = kern.attention_tile
    cap = (-(-len(kk) // t) + 1) * t
    stale = torch.full((2, cap, *kk.shape[1:]), 7.0, dtype=kk.dtype)  # slot 0 and the tail: never read
    kp, vp = stale.clone(), stale.clone()
    kp[1, : len(kk)], vp[1, : len(v)] = kk, v
    k_pool = kp.permute(0, 2, 3, 1).contiguous()  # [2, Hkv, D, cap]
    v_pool = vp.permute(0, 2, 1, 3).contiguous()  # [2, Hkv, cap, D]
    q_pos = torch.arange(len(kk) - len(q), len(kk))
    return kern.attention_pooled(q[None], q_pos[None], k_pool, v_pool, torch.tensor([1]), len(kk), scale)[0]


@pytest.mark.parametrize(("span_elements", "stage_keys"), [(None, None), (None, 1), (1, None), (3 * 32 * 64, 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pooled_path_equals_batched_path(dtype, span_elements, stage_keys, monkeypatch, kernel_set):
    """Keys read from a head-layout KV pool (the engine's decode and chunked prefill) and keys given
    token-major (prefill, the trainer, the SGLang package) give the same bits, for random shapes, thread
    counts, and chunks of queries at the end of the keys; also when decode reads the pool in spans of
    fewer tiles (one; about 3 for 32-dim heads) than it sees, as for long contexts, and when every span's
    keys are staged as bf16 before the upcast (`STAGE_KEYS`, long contexts)."""
    if span_elements is not None:
        monkeypatch.setattr(attention_keys, "SPAN_ELEMENTS", span_elements)
        monkeypatch.setattr(attention_keys, "SPAN_MIN_TILES", 1)
    if stage_keys is not None:
        monkeypatch.setattr(attention_keys, "STAGE_KEYS", stage_keys)
    rng = random.Random(11)
    for trial in range(24):
        hq, hkv, d = rng.choice(HEADS)
        n = rng.choice([1, 5, 31, 32, 33, 96, 200, 257])
        nq = rng.choice([1, 2, 7, n])
        q, kk, v = _qkv(n, hq, hkv, d, dtype, seed=trial)
        q = q[n - nq :]
        pos = torch.arange(n)
        k = get_kernels(kernel_set)
        with num_threads(rng.choice([1, 2])):
            batched = k.attention(q, kk, v, pos[n - nq :], pos, d**-0.5)
            assert torch.equal(_pooled(k, q, kk, v, pos, d**-0.5), batched), (hq, hkv, d, n, nq)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_decode_equals_alone(dtype, kernel_set):
    """Sequences of different lengths share one batched call (keys padded past each length)."""
    k = get_kernels(kernel_set)
    hq, hkv, d = 8, 4, 32
    lens = [1, 5, 31, 32, 33, 77, 130]
    nk = 160
    q = randn(len(lens), 1, hq, d, dtype=dtype, seed=1)
    kk = randn(len(lens), nk, hkv, d, dtype=dtype, seed=2)
    v = randn(len(lens), nk, hkv, d, dtype=dtype, seed=3)
    q_pos = torch.tensor(lens)[:, None] - 1
    k_pos = torch.arange(nk)[None].expand(len(lens), nk)
    batched = k.attention_batched(q, kk, v, q_pos, k_pos, d**-0.5)
    for b, n in enumerate(lens):
        alone = k.attention(q[b], kk[b, :n], v[b, :n], q_pos[b], torch.arange(n), d**-0.5)
        assert torch.equal(batched[b], alone), n


@pytest.mark.parametrize("slots", [[0, 1, 2], [2, 0, 1]])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pooled_decode_of_several_slots_equals_each_alone(dtype, slots, kernel_set):
    """One decode call over several pool slots (a run of slots, read as a view, or any order, gathered)
    gives each slot the bits of its own call."""
    k = get_kernels(kernel_set)
    hq, hkv, d, cap = 8, 4, 32, 128
    lens = [5, 77, 128]
    k_pool = randn(3, hkv, d, cap, dtype=dtype, seed=4)
    v_pool = randn(3, hkv, cap, d, dtype=dtype, seed=5)
    q = randn(3, 1, hq, d, dtype=dtype, seed=6)
    q_pos = torch.tensor([lens[s] - 1 for s in slots])[:, None]
    together = k.attention_pooled(q, q_pos, k_pool, v_pool, torch.tensor(slots), cap, d**-0.5)
    for i, s in enumerate(slots):
        alone = k.attention_pooled(q[i : i + 1], q_pos[i : i + 1], k_pool, v_pool, torch.tensor([s]), lens[s], d**-0.5)
        assert torch.equal(together[i], alone[0]), (slots, s)


@pytest.mark.parametrize("dtype", DTYPES)
def test_tile_merge_equals_attention(dtype, kernel_set):
    """attention == finalize(left-to-right merge of attention_tile over key tiles, one tile at a time).
    This is what ring CP does with tiles of remote chunks (chunk boundaries on tile boundaries)."""
    tile = 32
    k = get_kernels(kernel_set, attention_tile=tile)
    for ci, (hq, hkv, d) in enumerate(HEADS):
        n = 150
        q, kk, v = _qkv(n, hq, hkv, d, dtype, seed=ci + 5)
        pos = torch.arange(n)
        full = k.attention(q, kk, v, pos, pos, d**-0.5)
        nt = -(-n // tile)
        padn = nt * tile
        kp = torch.cat([kk, torch.zeros(padn - n, hkv, d, dtype=dtype)])
        vp = torch.cat([v, torch.zeros(padn - n, hkv, d, dtype=dtype)])
        kpos = torch.cat([pos, torch.full((padn - n,), 2**62)])
        state = None
        for t in range(nt):
            sl = slice(t * tile, (t + 1) * tile)
            part = k.attention_tile_partial(q, kp[sl], vp[sl], pos, kpos[sl], d**-0.5)
            state = part if state is None else k.merge(state, part)
        assert torch.equal(k.finalize(state, dtype), full)


def test_masked_tile_is_exact_noop(kernel_set):
    k = get_kernels(kernel_set)
    q, kk, v = _qkv(40, 8, 4, 32, torch.float32, seed=3)
    pos = torch.arange(40)
    a = k.attention_tile_partial(q, kk[:32], v[:32], pos, pos[:32], 0.2)
    # a tile whose keys are all in the future of every query
    masked = k.attention_tile_partial(q, randn(32, 4, 32, seed=9), randn(32, 4, 32, seed=8), pos, pos[:32] + 1000, 0.2)
    assert torch.all(masked.m == float("-inf")) and torch.all(masked.l == 0) and torch.all(masked.acc == 0)
    merged = k.merge(a, masked)
    assert torch.equal(merged.m, a.m) and torch.equal(merged.l, a.l) and torch.equal(merged.acc, a.acc)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_thread_invariance(dtype, kernel_set):
    k = get_kernels(kernel_set)
    q, kk, v = _qkv(200, 16, 2, 128, dtype, seed=4)
    pos = torch.arange(200)
    with num_threads(1):
        a = k.attention(q, kk, v, pos, pos, 0.1)
        a1 = k.attention(q[150:151], kk[:151], v[:151], pos[150:151], pos[:151], 0.1)
    with num_threads(2):
        b = k.attention(q, kk, v, pos, pos, 0.1)
        b1 = k.attention(q[150:151], kk[:151], v[:151], pos[150:151], pos[:151], 0.1)
    assert torch.equal(a, b) and torch.equal(a1, b1) and torch.equal(a1, a[150:151])


@pytest.mark.parametrize("dtype", DTYPES)
def test_contract_attention_is_accurate(dtype, kernel_set):
    k = get_kernels(kernel_set)
    q, kk, v = _qkv(70, 8, 4, 32, dtype, seed=6)
    pos = torch.arange(70)
    got = k.attention(q, kk, v, pos, pos, 32**-0.5).double()
    qd, kd, vd = q.double(), kk.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    s = torch.einsum("qhd,khd->hqk", qd, kd) * 32**-0.5
    s = s.masked_fill(torch.ones(70, 70, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vd)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got - ref).abs().max() < tol


def test_plain_attention_prefill_differs_from_decode():
    """Negative control: SDPA's causal row i differs from query i decoded alone."""
    k = get_kernels("plain")
    mismatches = 0
    for dtype in DTYPES:
        q, kk, v = _qkv(100, 8, 4, 32, dtype, seed=7)
        pos = torch.arange(100)
        full = k.attention(q, kk, v, pos, pos, 32**-0.5)
        for i in range(0, 100, 9):
            one = k.attention(q[i : i + 1], kk[: i + 1], v[: i + 1], pos[i : i + 1], pos[: i + 1], 32**-0.5)
            mismatches += int(not torch.equal(one, full[i : i + 1]))
    assert mismatches > 0


def test_query_seeing_no_key_gives_zero_not_nan(kernel_set):
    k = get_kernels(kernel_set)
    q, kk, v = _qkv(5, 8, 4, 32, torch.float32, seed=1)
    out = k.attention(q, kk, v, torch.tensor([-1, 0, 1, 2, 3]), torch.arange(5), 0.2)
    assert torch.all(out[0] == 0) and not torch.isnan(out).any()


def test_attention_backward_matches_reference(kernel_set):
    """The trainer differentiates through the contract attention (skipped tiles included)."""
    k = get_kernels(kernel_set)
    for n in (5, 70):
        q, kk, v = (t.requires_grad_() for t in _qkv(n, 8, 4, 32, torch.float32, seed=n))
        pos = torch.arange(n)
        out = k.attention(q, kk, v, pos, pos, 0.18)
        g = randn(*out.shape, seed=1)
        (out * g).sum().backward()
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, kk, v))
        s = torch.einsum("qhd,khd->hqk", qd, kd.repeat_interleave(2, 1)) * 0.18
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vd.repeat_interleave(2, 1))
        (ref * g.double()).sum().backward()
        for a, b in ((q, qd), (kk, kd), (v, vd)):
            assert (a.grad - b.grad).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", DTYPES)
def test_pooled_plan_is_shared_only_by_calls_of_the_same_geometry(dtype, kernel_set):
    """`attention_pooled` plans once for the positions and slots of a decode step and reuses the plan for
    every layer's pools; a call with other positions (even in the same tensor, changed in place) plans
    anew, and other slots (or the same tensor's slots changed in place) read their own slots with the
    plan of their geometry, so each call gives the bits of a fresh kernel set."""
    hq, hkv, d, cap = 8, 4, 32, 128
    pools = [
        (randn(3, hkv, d, cap, dtype=dtype, seed=s), randn(3, hkv, cap, d, dtype=dtype, seed=s + 1)) for s in (1, 3)
    ]
    q = randn(2, 1, hq, d, dtype=dtype, seed=7)
    q_pos, slots = torch.tensor([[40], [90]]), torch.tensor([0, 2])
    shared = get_kernels(kernel_set)
    calls = [(pools[0], 91), (pools[1], 91)]  # two layers of one step
    for (kp, vp), n in calls:
        fresh = get_kernels(kernel_set).attention_pooled(q, q_pos, kp, vp, slots, n, d**-0.5)
        assert torch.equal(shared.attention_pooled(q, q_pos, kp, vp, slots, n, d**-0.5), fresh)
    q_pos.add_(1)  # the next step, in the same tensor
    fresh = get_kernels(kernel_set).attention_pooled(q, q_pos, *pools[1], slots, 92, d**-0.5)
    assert torch.equal(shared.attention_pooled(q, q_pos, *pools[1], slots, 92, d**-0.5), fresh)
    stale = get_kernels(kernel_set).attention_pooled(q, q_pos - 1, *pools[1], slots, 92, d**-0.5)
    assert not torch.equal(stale, fresh)  # the check can fail: the positions change the result
    other = torch.tensor([2, 0])  # not a run of slots: gathered by index
    fresh = get_kernels(kernel_set).attention_pooled(q, q_pos, *pools[1], other, 92, d**-0.5)
    assert torch.equal(shared.attention_pooled(q, q_pos, *pools[1], other, 92, d**-0.5), fresh)
    assert not torch.equal(shared.attention_pooled(q, q_pos, *pools[1], slots, 92, d**-0.5), fresh)  # slots matter
    slots.copy_(other)  # the first slot tensor, changed in place to the other's values
    assert torch.equal(shared.attention_pooled(q, q_pos, *pools[1], slots, 92, d**-0.5), fresh)


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_plan_is_shared_only_by_calls_of_the_same_geometry(dtype, kernel_set):
    """`attention_batched` (prefill, the trainer) keeps the plan of its last positions for every layer of
    a forward; other positions (even in the same tensor, changed in place), other shapes, or a call that
    is differentiated plan anew: each call gives the bits (and gradients) of a fresh kernel set."""
    hq, hkv, d, n = 8, 4, 32, 70
    layers = [_qkv(n, hq, hkv, d, dtype, seed=s) for s in (1, 5)]
    pos = torch.arange(n)[None].repeat(2, 1)
    pos[1] += 9  # a second sequence further on: its own causal offsets

    def call(kern, qkv, q_pos, k_pos):
        q, k, v = (t[None].expand(2, *t.shape) for t in qkv)
        return kern.attention_batched(q, k, v, q_pos, k_pos, d**-0.5)

    shared = get_kernels(kernel_set)
    for qkv in layers:  # two layers of one forward
        assert torch.equal(call(shared, qkv, pos, pos), call(get_kernels(kernel_set), qkv, pos, pos))
    k_pos = pos.clone()
    pos[:, :10] = pos[:, 60:].clone()  # queries moved, in the same tensor: some now see more keys
    fresh = call(get_kernels(kernel_set), layers[0], pos, k_pos)
    assert torch.equal(call(shared, layers[0], pos, k_pos), fresh)
    assert not torch.equal(call(get_kernels(kernel_set), layers[0], k_pos, k_pos), fresh)  # positions matter
    q, k, v = (t[None, :40].clone() for t in layers[1])
    short = torch.arange(40)[None]
    assert torch.equal(
        shared.attention_batched(q, k, v, short, short, d**-0.5),
        get_kernels(kernel_set).attention_batched(q, k, v, short, short, d**-0.5),
    )
    grads = []
    for kern in (shared, get_kernels(kernel_set)):
        qg = q.clone().float().requires_grad_()
        kern.attention_batched(qg, k.float(), v.float(), short, short, d**-0.5).sum().backward()
        grads.append(qg.grad)
    assert torch.equal(*grads)


@pytest.mark.parametrize("dtype", DTYPES)
def test_trimmed_decode_rows_give_the_padded_bits(dtype, monkeypatch, kernel_set):
    """Decode queries (1-3 rows per KV head) scored from their real rows only give the bits of the padded
    computation, pooled and batched, one query or a few, GQA or not, fp32 and bf16."""
    for hq, hkv, d in HEADS:
        n = 75
        q, kk, v = _qkv(n, hq, hkv, d, dtype, seed=hq + d)
        pos = torch.arange(n)
        kern = get_kernels(kernel_set)
        for nq in (1, 2, 3):
            trimmed = _pooled(kern, q[-nq:], kk, v, pos, d**-0.5)
            assert all(plan.trim for _, plan in kern._pooled.values())  # the trimmed path was taken
            monkeypatch.setattr(invariant_attention, "trim_rows", lambda *a: False)
            padded = _pooled(get_kernels(kernel_set), q[-nq:], kk, v, pos, d**-0.5)
            monkeypatch.undo()
            assert torch.equal(trimmed, padded), (hq, hkv, d, nq)
