"""SIGINT, SIGTERM and SIGKILL of the launcher at random instants of startup, steps and shutdown: no
process of the run is alive 10 s after the launcher ended, and the records written so far parse.
The instants are seeded (the seed is in the failure message); experiments/orphan_check.py draws more."""

from __future__ import annotations

import random
from pathlib import Path

from support.orphans import random_instants

# The job as the fault tests run it (server, torchrun and two ranks), a few steps so that the draws
# land in startup, in steps and in the shutdown.
JOB = ("parallel=tp2", "experiment.steps=3")
HORIZON_S = 14.0
PER_SIGNAL = 3


def test_signals_at_random_instants_leave_no_process_behind(tmp_path: Path) -> None:
    seed = random.SystemRandom().randrange(2**32)
    outcomes = random_instants(tmp_path, PER_SIGNAL, HORIZON_S, seed, *JOB)
    dirty = [o for o in outcomes if not o.clean]
    assert not dirty, f"seed {seed}: {dirty}"
