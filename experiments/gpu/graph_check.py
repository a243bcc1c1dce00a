"""GPU check of the embedded engine's decode in CUDA graphs, one process on one GPU
(run under torchrun: the trainer's full forward needs a process group).

For each shape (tiny; a 1024-wide one) and dtype (bf16, fp32), with contract=qwen3_dense_triton_v1's
kernels, it generates with batch sizes 1, 2, 3, 4, 6, 8 (buckets 1, 2, 4, 4, 8, 8: 3 and 6 rows are
padded) and reports per batch size: tokens; graph decode vs eager decode mismatches; graph decode vs
the Megatron trainer's full forward (the same TrainerWorker as gpu/triton_check.py's `model` stage);
the plain-kernel control (plain engine vs plain full forward: expected nonzero); capture seconds per
bucket; generate tokens/s with graphs on and off (a warm second run of each; prefill step included).
Sampling and the sampled token's logprob run outside the graph (host generators need the logits on
the host); `host_tail_s` measures that part. Each part is caught on its own and its traceback recorded;
the JSON is written after every part. Usage: experiments/gpu_check.sh, or
  python3 -m torch.distributed.run --standalone --nproc-per-node 1 experiments/gpu/graph_check.py --out X.json
--smoke: CPU, Triton's interpreter, one tiny fp32 case, graphs replaced by their eager padded path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (1, 2)]  # experiments/ (shared helpers), repo root

REPORT: dict[str, Any] = {}
OUT = Path("gpu_graph.json")
SIZES = (1, 2, 3, 4, 6, 8)
MAX_RUNNING = 8
TEMPERATURE = 0.8


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _write() -> None:
    OUT.write_text(json.dumps(REPORT, indent=1, default=str))


def _requests(cfg: Any, n: int, new_tokens: int, seed: int) -> list:
    from tonpolicy.rollout.engine import GenRequest

    g = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(n):
        plen = int(torch.randint(3, 90, (1,), generator=g))
        ids = torch.randint(0, cfg.vocab_size, (plen,), generator=g).tolist()
        reqs.append(
            GenRequest(
                prompt_ids=ids, max_new_tokens=new_tokens, temperature=TEMPERATURE, seed=seed * 100 + i, ignore_eos=True
            )
        )
    return reqs


def _mismatched(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    return sum(
        int((x.float().view(torch.int32) != y.float().view(torch.int32)).sum()) for x, y in zip(a, b, strict=True)
    )


def _timed_generate(engine: Any, reqs: list) -> tuple[list, float]:
    _sync()
    t0 = time.perf_counter()
    res = engine.generate(reqs)
    _sync()
    return res, time.perf_counter() - t0


def case(name: str, cfg: Any, dt: torch.dtype, dtype_name: str, root: Path, dev: str, capture: bool, new: int) -> None:
    from tonpolicy.align import harness
    from tonpolicy.kernels import get_kernels
    from tonpolicy.model.checkpoint import init_state_dict, load_hf, save_hf
    from tonpolicy.model.qwen3 import Qwen3
    from tonpolicy.rollout.engine import Engine, score_logprobs
    from tonpolicy.rollout.engine.graphs import DecodeGraphs
    from tonpolicy.trainer.process_groups import Layout
    from tonpolicy.trainer.worker import TrainerWorker

    out: dict[str, Any] = {"ok": False}
    REPORT[name] = out
    t_case = time.perf_counter()
    try:
        ck = str(root / name)
        save_hf(init_state_dict(cfg, dt, 7), cfg, ck)
        c, sd = load_hf(ck)
        model = Qwen3(c, get_kernels("triton", attention_tile=64), dt, sd).to(dev)
        plain = Qwen3(c, get_kernels("plain"), dt, sd).to(dev)
        trainer = TrainerWorker(
            harness.make_config(Layout(), dtype_name, "triton", TEMPERATURE, ck), ck, spec="kernels"
        )
        graphs = DecodeGraphs(model, MAX_RUNNING, capture=capture)
        eager_engine = Engine(model, max_running_requests=MAX_RUNNING, prefix_cache=False)
        graph_engine = Engine(model, max_running_requests=MAX_RUNNING, prefix_cache=False, decode_graphs=graphs)
        plain_engine = Engine(
            plain,
            max_running_requests=MAX_RUNNING,
            prefix_cache=False,
            decode_graphs=DecodeGraphs(plain, MAX_RUNNING, capture=False),
        )
        # Speed reference: the plain kernels (cuBLAS, SDPA) through the same graph runner. Its attention
        # gathers the whole pool per row, so this flatters the contract less than it flatters plain.
        plain_graph_engine = Engine(
            plain,
            max_running_requests=MAX_RUNNING,
            prefix_cache=False,
            decode_graphs=DecodeGraphs(plain, MAX_RUNNING, capture=capture),
        )
        sizes: dict[str, Any] = {}
        out["sizes"] = sizes
        for n in SIZES:
            row: dict[str, Any] = {"bucket": graphs.bucket(n)}
            sizes[str(n)] = row
            try:
                reqs = _requests(c, n, new, seed=n)
                eager_engine.generate(reqs)  # warm: Triton compiles for these shapes
                eager, t_eager = _timed_generate(eager_engine, reqs)
                first, t_first = _timed_generate(graph_engine, reqs)  # captures this bucket (once per pool)
                steps0 = graph_engine.graph_steps
                graphed, t_graph = _timed_generate(graph_engine, reqs)  # replays
                lps = [r.output_logprobs for r in graphed]
                tokens = sum(len(r.output_ids) for r in graphed)
                same_ids = all(a.output_ids == b.output_ids for a, b in zip(eager, graphed, strict=True))
                prompts = [q.prompt_ids for q in reqs]
                responses = [r.output_ids for r in graphed]
                full = trainer.logprobs(prompts, responses)
                engine_full = [
                    score_logprobs(model, p, r, TEMPERATURE) for p, r in zip(prompts, responses, strict=True)
                ]
                plain_res = plain_engine.generate(reqs)
                plain_full = [
                    score_logprobs(plain, q.prompt_ids, r.output_ids, TEMPERATURE)
                    for q, r in zip(reqs, plain_res, strict=True)
                ]
                row.update(
                    tokens=tokens,
                    graph_steps=graph_engine.graph_steps - steps0,
                    same_token_ids_graph_vs_eager=same_ids,
                    mismatched_graph_vs_eager=_mismatched(lps, [r.output_logprobs for r in eager])
                    if same_ids
                    else None,
                    mismatched_graph_vs_first_graph_run=_mismatched(lps, [r.output_logprobs for r in first]),
                    mismatched_graph_vs_trainer=_mismatched(lps, [torch.as_tensor(x) for x in full]),
                    mismatched_graph_vs_engine_full_forward=_mismatched(lps, engine_full),
                    plain_control_mismatched=_mismatched([r.output_logprobs for r in plain_res], plain_full),
                    tokens_per_s_graphs=tokens / t_graph,
                    tokens_per_s_eager=tokens / t_eager,
                    speedup_graphs_over_eager=t_eager / t_graph,
                    first_graph_run_s=t_first,
                )
                row["ok"] = (
                    same_ids
                    and row["mismatched_graph_vs_eager"] == 0
                    and row["mismatched_graph_vs_trainer"] == 0
                    and row["graph_steps"] > 0
                )
            except Exception:  # noqa: BLE001 - recorded per batch size
                row["error"] = traceback.format_exc()[-3000:]
                row["ok"] = False
            try:  # apart from the row's verdict: a speed reference only
                plain_graph_engine.generate(reqs)  # captures this bucket
                _, t_plain = _timed_generate(plain_graph_engine, reqs)
                row["tokens_per_s_plain_graphs"] = row.get("tokens", 0) / t_plain
                row["contract_over_plain_graphs_time"] = t_graph / t_plain
            except Exception as e:  # noqa: BLE001 - recorded, not fatal
                row["plain_graphs_error"] = f"{type(e).__name__}: {e}"[:500]
            _write()
        # The host tail outside the graph (sampling + logprob of the sampled token), one decode step of 8.
        out["capture_s"] = {str(k): v for k, v in graphs.capture_s.items()}
        out["replays_per_bucket"] = {str(k): v for k, v in graphs.replays.items()}
        out["host_tail_s_per_step"] = _host_tail(model, dev)
        out["forward_ms_per_bucket"] = _forward_times(graphs, graph_engine._pool)
        out["ok"] = all(r.get("ok") for r in sizes.values()) and all(
            r.get("plain_control_mismatched", 0) > 0 for r in sizes.values() if r.get("tokens", 0) >= 16
        )
    except Exception:  # noqa: BLE001 - the report says which part failed and why
        out["error"] = traceback.format_exc()[-4000:]
    out["wall_s"] = time.perf_counter() - t_case
    _write()


def _forward_times(graphs: Any, pool: Any, reps: int = 20) -> dict[str, Any]:
    """The model part of a decode step per bucket, eager (the same padded static-buffer call) vs graph
    replay, in ms. Both rewrite the last step's keys/values with the same bits."""
    out: dict[str, Any] = {}
    for size, g in sorted(graphs._graphs.items()):
        if g.graph is None:  # --smoke: no capture
            continue
        try:
            times = {}
            for kind, fn in (("eager", lambda g=g: graphs._step(g, pool)), ("graph", g.graph.replay)):
                fn()
                _sync()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                _sync()
                times[kind] = (time.perf_counter() - t0) / reps * 1e3
            out[str(size)] = {**times, "speedup": times["eager"] / times["graph"]}
        except Exception as e:  # noqa: BLE001 - recorded per bucket
            out[str(size)] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _host_tail(model: Any, dev: str) -> float:
    """Seconds of what a decode step of 8 rows does outside the graph: logits to the host, seeded
    sampling, the kernel set's logprob of each sampled token."""
    from tonpolicy.rollout.engine.logits import make_generator, sample_token

    logits = torch.randn(MAX_RUNNING, model.padded_vocab, device=dev)
    gens = [make_generator(i) for i in range(MAX_RUNNING)]
    _sync()
    t0 = time.perf_counter()
    reps = 5
    for _ in range(reps):
        rows = logits.cpu()
        for j in range(MAX_RUNNING):
            tok = sample_token(rows[j], model.cfg.vocab_size, TEMPERATURE, 1.0, -1, gens[j])
            model.kernels.logprobs(logits[j : j + 1], torch.tensor([tok], device=dev), model.cfg.vocab_size, 1.25)
    _sync()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    global OUT, SIZES
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_graph.json")
    ap.add_argument("--smoke", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny fp32 (script check)")
    ap.add_argument("--shapes", default="tiny,wide")
    a = ap.parse_args()
    OUT = Path(a.out)
    from shapes import WIDE_4L

    from tonpolicy.config.model import ModelConfig

    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        dist.init_process_group("gloo")
        dev = "cpu"
    else:
        dist.init_process_group("nccl")
        torch.cuda.set_device(0)
        dev = "cuda"
    import triton

    REPORT["env"] = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "gpu": torch.cuda.is_available() and torch.cuda.get_device_name(),
    }
    shapes = {
        "tiny": ModelConfig(),
        "wide": WIDE_4L,
    }
    dtypes = (("bfloat16", torch.bfloat16), ("float32", torch.float32))
    root = Path(tempfile.mkdtemp())
    t0 = time.perf_counter()
    if a.smoke:
        SIZES = (1, 3)
        small = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_kv_heads=2, head_dim=32,
                            intermediate_size=128, vocab_size=300, max_position_embeddings=256)  # fmt: skip
        case("smoke_float32", small, torch.float32, "float32", root, dev, capture=False, new=3)
    else:
        for shape in a.shapes.split(","):
            for dtype_name, dt in dtypes:
                case(f"{shape}_{dtype_name}", shapes[shape], dt, dtype_name, root, dev, capture=True, new=24)
    REPORT["env"]["sizes"] = SIZES
    REPORT["wall_s"] = time.perf_counter() - t0
    _write()
    print("gpu_graph_check summary:", flush=True)
    for name, part in REPORT.items():
        if name in ("env", "wall_s") or not isinstance(part, dict):
            continue
        print(
            f"  {name}: ok={part.get('ok')} capture_s={part.get('capture_s')}"
            f" host_tail_s={part.get('host_tail_s_per_step')}"
        )
        print(f"    model forward ms per bucket (eager vs graph): {part.get('forward_ms_per_bucket')}")
        if "error" in part:
            print("    ERROR:", part["error"].strip().splitlines()[-1])
        for n, r in part.get("sizes", {}).items():
            if "error" in r:
                print(f"    rows={n}: ERROR {r['error'].strip().splitlines()[-1]}")
                continue
            print(
                f"    rows={n} bucket={r['bucket']} tokens={r['tokens']}"
                f" graph_vs_eager={r['mismatched_graph_vs_eager']}"
                f" vs_trainer={r['mismatched_graph_vs_trainer']} plain_control={r['plain_control_mismatched']}"
                f" tok/s graphs={r['tokens_per_s_graphs']:.0f} eager={r['tokens_per_s_eager']:.0f}"
                f" ({r['speedup_graphs_over_eager']:.2f}x)"
                f" plain graphs={r.get('tokens_per_s_plain_graphs', 0):.0f}"
                f" contract/plain time={r.get('contract_over_plain_graphs_time', float('nan')):.2f}x"
                f"{' ' + r['plain_graphs_error'] if 'plain_graphs_error' in r else ''}"
            )
    print(f"gpu_graph_check: all ok = {all(p.get('ok') for k, p in REPORT.items() if k not in ('env', 'wall_s'))}"
          f", wall {REPORT['wall_s']:.0f} s", flush=True)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
