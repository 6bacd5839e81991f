"""The models view of ``llmctl top`` for a server with several models: the table ``llmctl ps``
draws (loaded or not, memory, requests in flight, idle time, time left before unloading), from
``GET /v1/models/status``, which ``HttpSource`` adds to each snapshot as ``models_status``. Hidden
for a server of one model."""

from __future__ import annotations

from typing import Any

from textual.widgets import Static

from llmctl.server.ps_cli import memory_line, status_table


class ModelsPanel(Static):
    def show(self, snapshot: dict[str, Any]) -> None:
        status = snapshot.get("models_status")
        self.display = bool(status) and len(status["models"]) > 1
        if self.display:
            self.border_title = f"Models · {memory_line(status)}"
            self.update(status_table(status))
