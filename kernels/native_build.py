"""Build a C++ torch extension once, and never hang a start over it.

torch's own extension builder caches by source hash under one per-user folder and guards a build
with a lock file that outlives a killed build: every later start then waits on it forever. Here:

* the cache key covers everything the binary depends on: the sources (and headers), the compiler
  and its version, the flags, torch's version and location, and the interpreter. Two installs
  never rebuild each other's kernels; a changed toolchain never loads a stale binary. No
  ``-march=native``: per-ISA variants live in the sources and are picked at run time, so a cache
  that moves to another CPU stays valid;
* a build writes a private temporary file and renames it into place, so a killed build leaves no
  half-written module behind;
* builders serialise on an ``flock`` lock, which the kernel drops when its holder dies: a lock file
  left by a killed build is simply taken over. A live build is waited for, with a message, for at
  most ``LLMCTL_NATIVE_BUILD_TIMEOUT`` seconds (300); then the caller runs without the extension
  and says so;
* a build at start says so on stderr, with its elapsed time every few seconds.

``build_extension(name, sources, extra_cflags)`` returns the imported module, or None (the
reason is logged and kept in ``FAILURES[name]``). ``LazyExtension`` wraps it for the kernel
modules: built on first use, at most once per process, thread-safe, with its own switches.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from functools import lru_cache
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)
FAILURES: dict[str, str] = {}  # extension name -> why it is not available
DEFAULT_TIMEOUT_S = 300.0
PROGRESS_EVERY_S = 10.0


def cache_dir() -> Path:
    """``LLMCTL_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/llmctl/kernels`` (``~/.cache/...``)."""
    explicit = os.environ.get("LLMCTL_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmctl" / "kernels"


def compiler() -> str | None:
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


@lru_cache(maxsize=4)
def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def unavailable_reason() -> str | None:
    """Why no extension can be built here at all (None when it can)."""
    if platform.system() != "Linux":
        return f"native kernels are built on Linux only (this is {platform.system()})"
    if compiler() is None:
        return "no C++ compiler found (install g++, or set CXX)"
    return None


def _torch_flags(module_name: str) -> tuple[list[str], list[str]]:
    """Compile and link flags of a torch extension, as torch's own builder passes them."""
    from torch.utils import cpp_extension

    cflags = [f"-DTORCH_EXTENSION_NAME={module_name}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    for helper in ("_get_pybind11_abi_build_flags", "_get_glibcxx_abi_build_flags"):
        if hasattr(cpp_extension, helper):  # present in some torch versions only (some deprecated)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                cflags += list(getattr(cpp_extension, helper)())
    cflags += [f"-isystem{path}" for path in cpp_extension.include_paths()]
    cflags += [f"-isystem{sysconfig.get_paths()['include']}", "-fPIC", "-std=c++20"]
    ldflags = ["-shared", *(f"-L{path}" for path in cpp_extension.library_paths()),
               "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]
    return cflags, ldflags


def cache_key(sources: Sequence[Path], headers: Sequence[Path], flags: Sequence[str]) -> str:
    digest = hashlib.sha256()
    cxx = compiler() or ""
    for part in (cxx, _compiler_version(cxx), torch.__version__, str(Path(torch.__file__).parent),
                 sys.executable, sys.version, platform.machine(), *flags):
        digest.update(part.encode() + b"\0")
    for path in (*sources, *headers):
        digest.update(Path(path).read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def module_name_for(name: str, sources: Sequence[str | Path], extra_cflags: Sequence[str] = (),
                    extra_ldflags: Sequence[str] = (), headers: Sequence[str | Path] = ()) -> str:
    """``name`` plus the cache key: the file stem of the built module and of its lock."""
    flags = [*extra_cflags, "|", *extra_ldflags]
    return f"{name}_{cache_key([Path(s) for s in sources], [Path(h) for h in headers], flags)}"


def build_extension(name: str, sources: Sequence[str | Path], extra_cflags: Sequence[str] = (),
                    extra_ldflags: Sequence[str] = (), headers: Sequence[str | Path] = (),
                    timeout_s: float | None = None) -> ModuleType | None:
    """The extension ``name`` compiled from ``sources`` (``headers``: files they include, for the
    cache key), built at most once per key; None when it cannot be had (see ``FAILURES[name]``)."""
    reason = unavailable_reason()
    if reason is not None:
        return _fail(name, reason)
    source_paths = [Path(s) for s in sources]
    module_name = module_name_for(name, sources, extra_cflags, extra_ldflags, headers)
    folder = cache_dir()
    target = folder / f"{module_name}.so"
    if target.exists():
        module = _import(module_name, target)
        if module is not None:
            return module
    if timeout_s is None:
        timeout_s = float(os.environ.get("LLMCTL_NATIVE_BUILD_TIMEOUT", DEFAULT_TIMEOUT_S))
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with BuildLock(folder / f"{module_name}.lock", name) as lock:
            if not lock.wait(timeout_s):
                return _fail(name, f"another process (pid {lock.holder() or '?'}) is still building the {name} "
                                   f"kernels after {timeout_s:.0f} s (LLMCTL_NATIVE_BUILD_TIMEOUT)")
            _remove_orphans(folder, module_name)
            if not target.exists():  # else a process we waited for has just built it
                error = _compile(name, module_name, source_paths, extra_cflags, extra_ldflags, target)
                if error:
                    return _fail(name, error)
    except OSError as exc:
        return _fail(name, f"cannot use the kernel cache {folder}: {exc}")
    return _import(module_name, target) or _fail(name, f"{target} was built but does not import")


def _fail(name: str, reason: str) -> None:
    """Said on screen, not only logged: a start that silently runs slower is the bug this avoids."""
    FAILURES[name] = reason
    _say(f"native {name} kernels unavailable: {reason}; running on the pure-torch path (slower)")
    return None


def _import(module_name: str, path: Path) -> ModuleType | None:
    if module_name in sys.modules:
        return sys.modules[module_name]
    try:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as exc:  # truncated by a full disk, or built against another libtorch
        log.warning("%s does not import (%s); rebuilding it", path, exc)
        path.unlink(missing_ok=True)
        return None
    sys.modules[module_name] = module
    return module


def _say(message: str) -> None:
    """Build progress goes to stderr: stdout may be a completion being piped somewhere."""
    print(f"llmctl: {message}", file=sys.stderr, flush=True)


def _compile(name: str, module_name: str, sources: list[Path], extra_cflags: Sequence[str],
             extra_ldflags: Sequence[str], target: Path) -> str | None:
    """Compile into a private file, then rename it into place; None on success, else the reason."""
    cflags, ldflags = _torch_flags(module_name)
    partial = target.with_name(f"{target.stem}.{os.getpid()}.partial.so")
    command = [compiler(), *cflags, *extra_cflags, *map(str, sources), *ldflags, *extra_ldflags, "-o", str(partial)]
    _say(f"building the native {name} kernels (once per install and toolchain; about a minute on 2 cores)...")
    start = time.monotonic()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        try:
            next_report = start + PROGRESS_EVERY_S
            while proc.poll() is None:
                time.sleep(0.2)
                if time.monotonic() >= next_report:
                    _say(f"  ... still building the {name} kernels ({time.monotonic() - start:.0f} s)")
                    next_report += PROGRESS_EVERY_S
        except BaseException:  # Ctrl-C: stop the compiler too, leave nothing half-written
            proc.kill()
            partial.unlink(missing_ok=True)
            raise
        output = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        errors = [line for line in output.splitlines() if "error" in line] or output.splitlines()[-1:]
        return f"the compiler failed: {errors[0].strip() if errors else f'exit status {proc.returncode}'}"
    os.replace(partial, target)
    _say(f"built the native {name} kernels in {time.monotonic() - start:.0f} s ({target})")
    return None


def disabled_by(*variables: str) -> str | None:
    """The first of these environment switches set to ``0``, as a reason (None when none is)."""
    for variable in variables:
        if os.environ.get(variable, "1") == "0":
            return f"disabled by {variable}=0"
    return None


class LazyExtension:
    """One native kernel module, built (or loaded from the cache) on first use and at most once per
    process. ``precondition`` says why it cannot be used here (switches, CPU features) before any
    build is tried; ``on_load`` configures a fresh module (e.g. selects its ISA variant)."""

    def __init__(self, name: str, sources: Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str] = (),
                 *, headers: Sequence[Path] = (), precondition: Callable[[], str | None] = lambda: None,
                 on_load: Callable[[ModuleType], None] | None = None) -> None:
        self.name, self.sources, self.headers = name, list(sources), list(headers)
        self.cflags, self.ldflags = list(cflags), list(ldflags)
        self.precondition, self.on_load = precondition, on_load
        self.module: ModuleType | None = None  # set once loaded; read directly on hot paths
        self._lock = threading.Lock()
        self._tried = False

    def unavailable_reason(self) -> str | None:
        """Why the module cannot be had here (None when it can, or may still be built)."""
        return self.precondition() or unavailable_reason() or FAILURES.get(self.name)

    def load(self) -> ModuleType | None:
        """The module, building it on first call; None (the reason said once on stderr) when it
        cannot be had here."""
        with self._lock:
            if self.module is None and not self._tried and self.unavailable_reason() is None:
                self._tried = True
                module = build_extension(self.name, self.sources, self.cflags, self.ldflags, headers=self.headers)
                if module is not None and self.on_load is not None:
                    self.on_load(module)
                self.module = module
            return self.module

    def require(self) -> ModuleType:
        """The module, or a RuntimeError that says why it is unavailable."""
        module = self.load()
        if module is None:
            raise RuntimeError(self.unavailable_reason() or f"the native {self.name} kernels are unavailable")
        return module


class BuildLock:
    """An exclusive ``flock`` on ``path``: released by the kernel when its holder exits or dies,
    so a lock file left behind by a killed build never blocks anyone."""

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = path, what
        self.fd: int | None = None

    def __enter__(self) -> BuildLock:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None:
            os.close(self.fd)  # drops the lock; the file stays for the next builder
            self.fd = None

    def holder(self) -> int | None:
        try:
            return int(self.path.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def _try(self) -> bool:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            if exc.errno == errno.ENOLCK:  # a filesystem without locks: the atomic rename still keeps
                return True                # the result whole; two builders only duplicate work
            raise
        return True

    def wait(self, timeout_s: float) -> bool:
        """Take the lock, waiting up to ``timeout_s`` for a live holder; False on time-out."""
        previous = self.holder()
        deadline = time.monotonic() + timeout_s
        said = False
        while not self._try():
            if time.monotonic() >= deadline:
                return False
            if not said:
                _say(f"waiting for pid {self.holder() or '?'}, which is building the native {self.what} kernels "
                     f"(at most {timeout_s:.0f} s; LLMCTL_NATIVE_BUILD_TIMEOUT)")
                said = True
            time.sleep(0.5)
        if previous is not None and previous != os.getpid() and not _alive(previous):
            log.info("took over the %s build lock left by pid %d (no longer running)", self.what, previous)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        return True


def _remove_orphans(folder: Path, module_name: str) -> None:
    """Partial outputs of builds that were killed (SIGKILL leaves no chance to clean up)."""
    for partial in folder.glob(f"{module_name}.*.partial.so"):
        pid = partial.name.split(".")[-3]
        if pid.isdigit() and not _alive(int(pid)):
            partial.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
