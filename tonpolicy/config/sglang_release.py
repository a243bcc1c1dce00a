"""The released SGLang tonpolicy is tested with, and the check that the one running is that release.

The model package and the server entry use SGLang's internals (its sampler, logits processor, KV pools
and forward batch), which change between releases without notice, so another release is refused before
it serves a token rather than trusted to give the contract's bits. Kept with the pins in pyproject.toml
(the `sglang` extra) and scripts/setup_sglang.sh (tests/api/test_sglang_pin.py compares them).
"""

from __future__ import annotations

from importlib import metadata

SGLANG_VERSION = "0.5.23"


def sglang_release_problem(found: str | None) -> str | None:
    """What is wrong with SGLang release `found` (None: not installed); None when it is the tested one."""
    if found == SGLANG_VERSION:
        return None
    where = f"sglang {found} is installed" if found is not None else "sglang is not installed"
    return (
        f"tonpolicy's SGLang model package needs sglang=={SGLANG_VERSION} (the release it is tested with); "
        f"{where} in {_environment()}: run `bash scripts/setup_sglang.sh`, or "
        f"`pip install sglang=={SGLANG_VERSION}` in that environment"
    )


def installed_sglang() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def require_sglang_release() -> None:
    """Raise RuntimeError naming the found and the required release unless this environment has it."""
    problem = sglang_release_problem(installed_sglang())
    if problem is not None:
        raise RuntimeError(problem)


def _environment() -> str:
    import sys

    return sys.prefix
