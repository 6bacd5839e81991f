"""The expert-load view of ``llmctl top``: for a mixture-of-experts model, the tokens each expert
took over the engine's last forward passes (summed over the MoE layers) and the share of the
experts' weight bytes a pass read, from the snapshot's ``experts`` section. Hidden otherwise."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widgets import Static

MAX_ROWS = 8  # experts drawn, the busiest first
BAR_WIDTH = 24


def expert_totals(experts: dict[str, Any]) -> list[int]:
    """Tokens per expert, summed over the MoE layers."""
    totals: list[int] = []
    for layer in experts["layers"]:
        for i, count in enumerate(layer["tokens"]):
            if i == len(totals):
                totals.append(0)
            totals[i] += int(count)
    return totals


def _size(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def expert_text(experts: dict[str, Any]) -> Text:
    """A summary line, then one bar per expert (the ``MAX_ROWS`` busiest), its tokens and share."""
    totals = expert_totals(experts)
    layers = experts["layers"]
    steps = max((layer["steps"] for layer in layers), default=0)
    text = Text.assemble(
        ("reads ", "bold"),
        f"{100 * experts['read_share_per_step']:.1f}%",
        f" of {_size(experts['weight_bytes'])} expert weights per pass",
        (f" · {len(totals)} experts × {len(layers)} layers · last {steps} passes", "dim"),
    )
    total = sum(totals)
    if total == 0:
        return text.append("\nno tokens routed yet", "dim")
    mean = total / len(totals)
    text.append(f"\nbusiest / mean {max(totals) / mean:.2f}×", "dim")
    ranked = sorted(range(len(totals)), key=lambda i: (-totals[i], i))[:MAX_ROWS]
    label_width = len(f"e{len(totals) - 1}")
    for i in ranked:
        filled = round(BAR_WIDTH * totals[i] / max(totals))
        text.append(f"\n{f'e{i}':>{label_width}} ")
        text.append("█" * filled, "magenta")
        text.append("·" * (BAR_WIDTH - filled), "grey35")
        text.append(f" {totals[i]:>8,} {100 * totals[i] / total:5.1f}%")
    if len(totals) > MAX_ROWS:
        text.append(f"\n… {len(totals) - MAX_ROWS} more experts", "dim")
    return text


class ExpertPanel(Static):
    """Shown only while the snapshot has an ``experts`` section (a mixture-of-experts model)."""

    def show(self, snapshot: dict[str, Any]) -> None:
        experts = snapshot.get("experts")
        self.display = bool(experts)
        if experts:
            self.border_title = "Expert load"
            self.update(expert_text(experts))
