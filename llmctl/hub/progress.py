"""Rich progress bars for ``pull``, driven by the tqdm-like objects huggingface_hub instantiates."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rich.markup import escape

if TYPE_CHECKING:  # pragma: no cover
    from rich.console import Console


def fmt_size(n: int) -> str:
    from rich.filesize import decimal

    return decimal(n)


def bar_class(on_progress: Callable[[int], None] | None) -> type:
    """A tqdm stand-in for huggingface_hub's ``tqdm_class`` hooks.

    ``http_get`` creates it with ``total=``/``initial=`` (the resumed byte count) and calls
    ``update(len(chunk))`` per chunk written, ``update(-n)`` when a server ignored a Range request.
    The Xet downloader sees ``update_transfer`` and reports written bytes through ``update`` too.
    ``on_progress`` receives the absolute number of bytes of the file on disk.
    """

    class _Bar:
        def __init__(self, *args: Any, total: int | None = None, initial: int = 0, **kwargs: Any) -> None:
            self.n = 0
            self.total = total
            self.disable = on_progress is None
            if initial:
                self.update(initial)

        def update(self, n: int | float | None = 1) -> None:
            if n:
                self.n += int(n)
                if on_progress is not None:
                    on_progress(self.n)

        def update_transfer(self, n: int | float | None = 1) -> None:  # network bytes: not shown
            pass

        def set_postfix_str(self, *args: Any, **kwargs: Any) -> None:
            pass

        set_transfer_postfix_str = set_description = set_description_str = set_postfix_str

        def refresh(self, *args: Any, **kwargs: Any) -> None:
            pass

        def close(self) -> None:
            pass

        def __enter__(self) -> _Bar:
            return self

        def __exit__(self, *exc: Any) -> bool:
            return False

    return _Bar


class PullProgress:
    """One rich bar per file plus an overall bar, in real bytes."""

    def __init__(self, console: Console, enabled: bool, title: str, total: int) -> None:
        self._done: dict[str, int] = {}
        self._progress = None
        self._overall = None
        self._tasks: dict[str, Any] = {}
        self._current: str | None = None
        if not enabled:
            return
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description}", markup=True),
            BarColumn(bar_width=28),
            TaskProgressColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
            refresh_per_second=8,
        )
        self._overall = self._progress.add_task(f"[bold]{escape(title)}", total=total or None, completed=0)

    def __enter__(self) -> PullProgress:
        if self._progress is not None:
            self._progress.start()
            # http_get logs "Error while downloading ... Trying to resume download..." when a connection
            # drops and it retries with a Range request: show that in the bars instead of raw log lines.
            self._logger = logging.getLogger("huggingface_hub.file_download")
            self._logger.addFilter(self._log_filter)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._logger.removeFilter(self._log_filter)
            self._progress.stop()

    def _log_filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.levelno < logging.WARNING or not message.startswith("Error while downloading"):
            return True
        assert self._progress is not None
        name = self._current or "a file"
        reason = message.split(": ", 1)[-1].splitlines()[0]
        done = self._done.get(name, 0)
        if "Trying to resume" in message:
            self._progress.console.print(
                f"[yellow]connection dropped[/yellow] while downloading {escape(name)} ({escape(reason)}); "
                f"resuming with a Range request from byte {done}",
                highlight=False,
                soft_wrap=True,
            )
            self.describe(name, f"{escape(name)} [yellow](resuming)[/yellow]")
        return False

    def start_file(self, name: str, size: int | None) -> Callable[[int], None] | None:
        if self._progress is None:
            return None
        task = self._progress.add_task(f"  {escape(name)}", total=size or None, completed=0)
        self._tasks[name] = task
        self._current = name

        def on_progress(done: int) -> None:
            self._done[name] = done
            assert self._progress is not None
            self._progress.update(task, completed=done)
            self._progress.update(self._overall, completed=sum(self._done.values()))

        return on_progress

    def describe(self, name: str, text: str) -> None:
        if self._progress is not None and name in self._tasks:
            self._progress.update(self._tasks[name], description=f"  {text}")

    def finish_file(self, name: str, size: int | None) -> None:
        if self._progress is not None and name in self._tasks:
            if size is not None:
                self._done[name] = size
                self._progress.update(self._tasks[name], completed=size, total=size)
                self._progress.update(self._overall, completed=sum(self._done.values()))
            self._progress.update(self._tasks[name], description=f"  [green]✓[/green] {escape(name)}")
