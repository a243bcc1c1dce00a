"""Compile a C++ source into a shared library once and keep it in a cache (for ctypes).

The cache file's name carries a sha256 of everything the build depends on: the source text, the compiler
(its path and its `--version` line), the flags and whatever the caller adds (the CPU's flags for a
`-march=native` build). A changed source or flag is a new name, so a stale build is never loaded. The
build goes to a temporary folder in the cache and is published with an atomic rename: builders racing in
other processes each publish a whole file.

Cache: TONPOLICY_KERNEL_CACHE, default ~/.cache/tonpolicy/kernels. Compiler: CXX, else g++ on PATH.
`PathLibraries` builds and loads one library per instruction-set path on first use (the ordered kernels'
loaders); `cpu_flags` is what a path needs from the CPU, and part of a `-march=native` build's key.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Generic, TypeVar

L = TypeVar("L")
E = TypeVar("E", bound=Exception)


class NativeBuildError(RuntimeError):
    """No compiler, or the compiler failed (the message ends with its stderr)."""


class NoCompilerError(NativeBuildError):
    """No C++ compiler: CXX unset and no g++ on PATH, or the one named cannot be run."""


@functools.cache  # the CPU does not change under a process
def cpu_flags_line() -> str:
    """The first flags line of /proc/cpuinfo ("flags" on x86, "Features" on Arm); '' where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def cpu_flags() -> frozenset[str]:
    """This CPU's flags, by Linux's names (empty where they cannot be read)."""
    return frozenset(cpu_flags_line().partition(":")[2].split())


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


class PathLibraries(Generic[L, E]):
    """One loaded library per instruction-set path of one C++ source, built on first use as `name`_path
    with `flags[path]` (its keys are the paths `library` accepts: ValueError otherwise); `load(path, so)`
    wraps it, `runnable(path)` says whether this CPU runs one (`error` otherwise). No compiler or a failed
    build raises `error` naming `what` (and `note`: what still runs without it). A failure is remembered,
    so a missing compiler or a failed build is not retried on every call."""

    def __init__(
        self,
        name: str,
        source: Path,
        flags: Mapping[str, Sequence[str]],
        load: Callable[[str, Path], L],
        runnable: Callable[[str], bool],
        error: type[E],
        what: str,
        note: str = "",
    ) -> None:
        self.name, self.source, self.flags, self.load, self.runnable = name, source, flags, load, runnable
        self.error, self.what, self.note = error, what, note
        self.known = tuple(flags)
        self.lock = threading.Lock()

    def build(self, path: str) -> Path:
        """The library of one path (from the cache, or built now); `error` on failure."""
        try:
            return build(f"{self.name}_{path}", self.source, self.flags[path])
        except NoCompilerError as e:
            raise self.error(f"{self.what}: a C++ compiler is needed, set CXX or install g++{self.note} ({e})") from e
        except NativeBuildError as e:
            raise self.error(f"{self.what}: the {path} build failed{self.note}: {e}") from e

    def library(self, path: str, libs: dict[str, L | E]) -> L:
        """The library of `path`, from `libs` (the caller's memo: tests replace it to forget) or loaded now."""
        got = libs.get(path)
        if got is None:
            with self.lock:
                got = libs.get(path)
                if got is None:
                    if path not in self.known:
                        raise ValueError(f"unknown path {path!r}: one of {', '.join(self.known)}")
                    if not self.runnable(path):
                        raise self.error(f"this CPU cannot run the {path} path")
                    try:
                        got = self.load(path, self.build(path))
                    except self.error as e:
                        got = e
                    libs[path] = got
        if isinstance(got, self.error):
            raise got
        return got

    def build_paths(self, paths: Iterable[str]) -> None:
        """Build several paths at once (the compilers run outside the GIL); `library` raises their errors."""

        def one(path: str) -> None:
            try:
                self.build(path)
            except self.error:
                pass

        threads = [threading.Thread(target=one, args=(p,)) for p in paths]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
