"""Fault check: SIGINT, SIGTERM and SIGKILL of the launcher at many random instants of a job (startup,
steps, shutdown); counts the instants after which a process of the run outlived its launcher by 10 s,
or a record file did not parse. The test suite draws a few instants per run; this draws many.

    .venv/bin/python experiments/orphan_check.py [--per-signal 30] [--horizon 14] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support.orphans import random_instants  # noqa: E402

JOB = ("parallel=tp2", "experiment.steps=3")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-signal", type=int, default=30)
    ap.add_argument("--horizon", type=float, default=14.0, help="instants drawn in [0, horizon) seconds")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = random_instants(Path(tmp), args.per_signal, args.horizon, seed, *JOB)
    dirty = [o for o in outcomes if not o.clean]
    for o in dirty:
        print(json.dumps(o.__dict__))
    print(f"seed {seed}: {len(outcomes) - len(dirty)} of {len(outcomes)} instants clean")
    return 1 if dirty else 0


if __name__ == "__main__":
    sys.exit(main())
