"""Compile a C++ source into a shared library once and keep it in a cache (for ctypes).

The cache file's name carries a sha256 of everything the build depends on: the source text, the compiler
(its path and its `--version` line), the flags and whatever the caller adds (the CPU's flags for a
`-march=native` build). A changed source or flag is a new name, so a stale build is never loaded. The
build goes to a temporary folder in the cache and is published with an atomic rename: builders racing in
other processes each publish a whole file.

Cache: TONPOLICY_KERNEL_CACHE, default ~/.cache/tonpolicy/kernels. Compiler: CXX, else g++ on PATH.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path


class NativeBuildError(RuntimeError):
    """No compiler, or the compiler failed (the message ends with its stderr)."""


class NoCompilerError(NativeBuildError):
    """No C++ compiler: CXX unset and no g++ on PATH, or the one named cannot be run."""


def compiler() -> str | None:
    """The C++ compiler to use: $CXX, else g++ on PATH, else None."""
    return os.environ.get("CXX") or shutil.which("g++")


def cache_dir() -> Path:
    return Path(os.environ.get("TONPOLICY_KERNEL_CACHE", Path.home() / ".cache" / "tonpolicy" / "kernels"))


@functools.lru_cache(maxsize=8)
def compiler_identity(cxx: str) -> str:
    """The first line of `cxx --version` ('' if it does not answer): part of the cache key."""
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return ""
    return (done.stdout.splitlines() or [""])[0]


def library_name(name: str, source: str, flags: Sequence[str], extra_key: Sequence[str], cxx: str) -> str:
    key = "\0".join([source, cxx, compiler_identity(cxx), *flags, "\1", *extra_key])
    return f"{name}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def build(name: str, source: Path, flags: Sequence[str], extra_key: Sequence[str] = (), cxx: str | None = None) -> Path:
    """The shared library built from `source` with `flags` (cached; built now if missing). Raises
    NativeBuildError when there is no compiler or the build fails."""
    cxx = cxx or compiler()
    if not cxx:
        raise NoCompilerError(f"{name}: no C++ compiler (CXX is unset and there is no g++ on PATH)")
    text = Path(source).read_text()
    cache = cache_dir()
    lib = cache / library_name(name, text, flags, extra_key, cxx)
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src = Path(tmp) / Path(source).name
        src.write_text(text)  # the text the key was computed from, not a file edited since
        out = Path(tmp) / lib.name
        try:
            done = subprocess.run([cxx, *flags, str(src), "-o", str(out)], capture_output=True, text=True)
        except OSError as e:
            raise NoCompilerError(f"{name}: cannot run the C++ compiler {cxx!r} (CXX or g++): {e}") from e
        if done.returncode:
            cmd = " ".join([cxx, *flags, src.name])
            raise NativeBuildError(f"{name}: `{cmd}` failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        os.replace(out, lib)
    return lib
