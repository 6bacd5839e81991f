"""The native CPU kernels, compiled at install time into ``llmctl_kernels._C`` (setup.py builds
kernels/cpu/: one extension, a submodule per kernel family: ``cpu``, ``quant``, ``kv_quant``,
``gemm``, ``decode_loop``).

Nothing is compiled here: a start only imports what the install built, so it never waits on a
compiler. Where the install could not build them (no C++ compiler, not x86-64 Linux, a compiler
error) the import fails, the reason is kept and said once on stderr, and the engine runs its
pure-torch references.

``NativeKernels(submodule, precondition=..., on_load=...)`` wraps one submodule for a kernel
module: loaded on first use, at most once per process, thread-safe; ``precondition`` says why it
cannot be used on this CPU before it is touched, ``on_load`` configures it (selects its ISA variant).
"""

from __future__ import annotations

import importlib
import platform
import shutil
import sys
import threading
from collections.abc import Callable
from functools import lru_cache
from types import ModuleType

EXTENSION = "llmctl_kernels._C"
FAILURES: dict[str, str] = {}  # submodule -> why it is unavailable (said once on stderr)
_said: set[str] = set()  # reasons already said


@lru_cache(maxsize=1)
def _import_reason() -> tuple[ModuleType | None, str | None]:
    try:
        return importlib.import_module(EXTENSION), None
    except ImportError as exc:
        return None, _explain(exc)


def _explain(exc: ImportError) -> str:
    """Why the extension is missing, as precisely as the run time can tell."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the native kernels are built for x86-64 Linux only (this is {platform.system()} {platform.machine()})"
    if getattr(exc, "name", None) == EXTENSION:
        if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
            return "not built at install time: no C++ compiler was found (install g++, then re-run scripts/setup.sh)"
        return (
            "not built at install time (`pip install -v --no-build-isolation -e .` shows the compiler's "
            "error; scripts/setup.sh re-installs)"
        )
    return f"{EXTENSION} does not import ({exc}); re-install with scripts/setup.sh"


def extension() -> ModuleType | None:
    """The compiled extension, or None (``unavailable_reason`` says why)."""
    return _import_reason()[0]


def unavailable_reason() -> str | None:
    """Why no native kernel is available here at all (None when the extension imports)."""
    return _import_reason()[1]


def _say(message: str) -> None:
    """Said on screen, not only logged: a start that silently runs slower is the bug this avoids.
    stderr: stdout may be a completion being piped somewhere."""
    print(f"llmctl: {message}", file=sys.stderr, flush=True)


class NativeKernels:
    """One submodule of the extension, loaded on first use and at most once per process."""

    def __init__(
        self,
        submodule: str,
        *,
        precondition: Callable[[], str | None] = lambda: None,
        on_load: Callable[[ModuleType], None] | None = None,
    ) -> None:
        self.name, self.precondition, self.on_load = submodule, precondition, on_load
        self.module: ModuleType | None = None  # set once loaded; read directly on hot paths
        self._lock = threading.Lock()
        self._tried = False

    def unavailable_reason(self) -> str | None:
        """Why the kernels cannot be had here (None when they can)."""
        return self.precondition() or unavailable_reason() or FAILURES.get(self.name)

    def load(self) -> ModuleType | None:
        """The submodule, configured; None (the reason said once on stderr) when it cannot be had."""
        with self._lock:
            if self.module is None and not self._tried:
                self._tried = True
                reason = self.unavailable_reason()
                if reason is None:
                    module = getattr(extension(), self.name)
                    if self.on_load is not None:
                        self.on_load(module)
                    self.module = module
                elif self.precondition() is None:  # the CPU's own limits are not news; a missing build is
                    FAILURES[self.name] = reason
                    if reason not in _said:  # once per reason: a missing extension concerns every submodule
                        _said.add(reason)
                        _say(f"native CPU kernels unavailable: {reason}; running on the pure-torch path (slower)")
            return self.module

    def require(self) -> ModuleType:
        """The submodule, or a RuntimeError that says why it is unavailable."""
        module = self.load()
        if module is None:
            raise RuntimeError(self.unavailable_reason() or f"the native {self.name} kernels are unavailable")
        return module
