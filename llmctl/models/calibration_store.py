"""Where the GPTQ cache (``llmctl/models/calibration_cache.py``) keeps its entries, how it names
them, how big it may grow and how it prunes itself: the folder's side only, without torch, so
that ``llmctl ls`` can show it.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path

from llmctl import envs
from llmctl.config import parse_size
from llmctl.errors import ConfigError

KEY_CHARS = 40  # hex digits of the key in an entry's name
ENTRY_NAME = re.compile(rf"[0-9a-f]{{{KEY_CHARS}}}(?:\.safetensors|(\.[0-9]+\.tmp))")  # group 1: a writer's temp file
STALE_TMP_SECONDS = 3600  # a temporary file this old belongs to a writer that is gone


def cache_dir() -> Path | None:
    """``LLMCTL_GPTQ_CACHE`` (None: ``0``, no cache)."""
    return envs.LLMCTL_GPTQ_CACHE


def cache_size_limit() -> int:
    """``LLMCTL_GPTQ_CACHE_SIZE`` in bytes (a clear error for a value it cannot read)."""
    setting = envs.LLMCTL_GPTQ_CACHE_SIZE
    try:
        return parse_size(setting)
    except ConfigError as exc:
        raise ConfigError(f"LLMCTL_GPTQ_CACHE_SIZE: {exc}") from None


@dataclass(frozen=True)
class CacheUsage:
    folder: Path
    entries: int
    bytes: int


def _scan(folder: Path) -> tuple[list[tuple[float, int, Path]], list[tuple[float, Path]]]:
    """The folder's entries as (last use, bytes, path) and writers' temporary files as (mtime, path).
    Only files named as this module names them count (``LLMCTL_GPTQ_CACHE`` may point at a folder
    that holds other files); a folder that does not exist, or a file gone meanwhile, holds nothing."""
    entries, temps = [], []
    try:
        paths = list(folder.iterdir())
    except OSError:
        return entries, temps
    for path in paths:
        kind = ENTRY_NAME.fullmatch(path.name)
        if kind is None:
            continue
        try:
            stat = path.stat()
        except OSError:
            continue
        if kind.group(1):
            temps.append((stat.st_mtime, path))
        else:
            entries.append((stat.st_mtime, stat.st_size, path))
    return entries, temps


def usage() -> CacheUsage | None:
    """The cache's folder, its entries and their bytes (None: the cache is off)."""
    folder = cache_dir()
    if folder is None:
        return None
    entries, _ = _scan(folder)
    return CacheUsage(folder, len(entries), sum(size for _, size, _ in entries))


def prune(folder: Path, keep: Path, limit: int) -> tuple[int, int]:
    """Deletes the least recently used entries of ``folder`` (never ``keep``) until the entries
    take at most ``limit`` bytes, and temporary files older than ``STALE_TMP_SECONDS``; returns how
    many entries it deleted and their bytes. Files it cannot delete (another process got there
    first) are skipped."""
    entries, temps = _scan(folder)
    now = time.time()
    for mtime, path in temps:
        if now - mtime > STALE_TMP_SECONDS:
            try:
                path.unlink()
            except OSError:
                pass
    total = sum(size for _, size, _ in entries)
    deleted = freed = 0
    for _, size, path in sorted(entries, key=lambda entry: entry[0]):  # oldest use first
        if total <= limit:
            break
        if path == keep:
            continue
        try:
            path.unlink()
        except OSError:
            continue
        total -= size
        deleted, freed = deleted + 1, freed + size
    return deleted, freed
