"""Model-level invariance under `invariant`: a sequence's logits rows are the same in a full forward,
a prefix forward, and a mixed flat batch of cached prefill chunks and decode tokens of other sequences."""

from __future__ import annotations

import random

import pytest
import torch
from support.kernel_utils import DTYPES

from tonpolicy.config.model import ModelConfig
from tonpolicy.kernels import get_kernels
from tonpolicy.model import KVPool, Qwen3, Segment


def _model(kernels: str, dtype: torch.dtype) -> Qwen3:
    return Qwen3(ModelConfig(), get_kernels(kernels), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_and_segment_batches(dtype):
    m = _model("ordered", dtype)
    cfg = m.cfg
    rng = random.Random(0)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in (45, 70, 13)]
    refs = [m(s) for s in seqs]
    assert refs[0].shape == (45, m.padded_vocab) and refs[0].dtype == torch.float32
    assert torch.equal(m(seqs[1][:37]), refs[1][:37])
    kern = m.kernels
    pool = KVPool(
        cfg.num_layers,
        3,
        80,
        cfg.num_kv_heads,
        cfg.head_dim,
        kern.kv_cache_dtype(dtype),
        kern.attention_tile,
        layout=kern.kv_pool_layout,
    )
    done = [0, 0, 0]
    while any(d < len(s) for d, s in zip(done, seqs, strict=True)):
        ids, segs, rows, want = [], [], [], []
        for i, s in enumerate(seqs):
            if done[i] >= len(s):
                continue
            take = 1 if done[i] and rng.random() < 0.5 else rng.randrange(1, 30)
            take = min(take, len(s) - done[i])
            segs.append(Segment(take, start=done[i], slot=i))
            ids.append(s[done[i] : done[i] + take])
            rows.extend(range(sum(len(x) for x in ids) - take, sum(len(x) for x in ids)))
            want.append(refs[i][done[i] : done[i] + take])
            done[i] += take
        out = m.forward_segments(torch.cat(ids), segs, pool, torch.tensor(rows))
        assert torch.equal(out, torch.cat(want))


def test_plain_prefix_forward_differs():
    """Negative control: under plain kernels a prefix forward does not reproduce the full forward rows."""
    bad = 0
    for dtype in DTYPES:
        m = _model("plain", dtype)
        s = torch.randint(0, m.cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(1))
        bad += int(not torch.equal(m(s[:33]), m(s)[:33]))
    assert bad > 0
