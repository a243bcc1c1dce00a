"""Each trainer rank's lines carry `[rankK]: `; the launcher's root-cause reader still finds the error."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

from tonpolicy.launch.job import root_cause
from tonpolicy.launch.rank_prefix import PrefixedStream, prefix_rank_output


def test_every_line_is_prefixed_across_partial_writes() -> None:
    out = io.StringIO()
    s = PrefixedStream(out, "[rank1]: ")
    s.write("step 0: tok")
    s.write("ens=4\nstep 1")
    s.write(": ok\n\n")
    assert out.getvalue() == "[rank1]: step 0: tokens=4\n[rank1]: step 1: ok\n[rank1]: \n"


def test_one_rank_is_not_prefixed() -> None:
    assert prefix_rank_output({"RANK": "0", "WORLD_SIZE": "1"}) is None
    assert prefix_rank_output({}) is None


def test_two_ranks_in_one_log_and_the_root_cause(tmp_path: Path) -> None:
    log = tmp_path / "trainer.log"
    code = (
        "from tonpolicy.launch.rank_prefix import prefix_rank_output; prefix_rank_output(); "
        "from tonpolicy.log_setup import configure_process; configure_process(); "  # as trainer_main does
        "import logging; logging.getLogger('tonpolicy.loop.run').info('logged'); "
        "logging.getLogger('tonpolicy.loop.run').debug('hidden'); "
        "print('hello'); raise ValueError('bad shard')"
    )
    with log.open("w") as f:
        for rank in (0, 1):
            env = {"RANK": str(rank), "WORLD_SIZE": "2", "PATH": "/usr/bin:/bin"}
            subprocess.run([sys.executable, "-c", code], stdout=f, stderr=subprocess.STDOUT, env=env, check=False)
    lines = log.read_text().splitlines()
    assert "[rank0]: hello" in lines and "[rank1]: hello" in lines
    assert "[rank0]: logged" in lines and "[rank1]: logged" in lines  # INFO by default, prefixed
    assert not any("hidden" in ln for ln in lines)
    assert all(ln.startswith(("[rank0]: ", "[rank1]: ")) for ln in lines)
    assert root_cause(log) == "ValueError: bad shard"
