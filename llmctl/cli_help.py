"""``--help`` that reads at 80 columns and when piped.

click's plain definition lists never cut a flag: a long one puts its help on the next line, as
argparse does in vLLM (typer's rich tables cut ``--max-num-batched-tokens`` to ``--max-num-batc…``
at 80 columns). Options come grouped, one section per ``rich_help_panel``, and help text wraps
at spaces only, so ``--memory-fraction`` or ``tiny-random-llama`` is never split at a hyphen.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable
from typing import Any

from typer.core import TyperCommand

ARGUMENTS = "Arguments"
OPTIONS = "Options"
_Context: Any = TyperCommand.context_class  # typer's vendored click, reached through public attributes
_Formatter: Any = _Context.formatter_class


class HelpFormatter(_Formatter):
    """click's formatter, wrapping at spaces only."""

    def write_text(self, text: str) -> None:
        width = max(self.width - self.current_indent, 11)
        paragraphs = [
            "\n".join(f"{'':>{self.current_indent}}{line}" for line in _wrap(p, width)) for p in text.split("\n\n")
        ]
        self.write("\n\n".join(paragraphs) + "\n")

    def write_dl(self, rows: Iterable[tuple[str, str]], col_max: int = 30, col_spacing: int = 2) -> None:
        rows = list(rows)
        first_col = min(max((len(term) for term, _ in rows), default=0), col_max) + col_spacing
        indent = " " * (self.current_indent + first_col)
        for term, text in rows:
            lines = _wrap(text, max(self.width - first_col - 2, 10)) or [""]
            if len(term) <= first_col - col_spacing:
                self.write(f"{'':>{self.current_indent}}{term:<{first_col}}{lines[0]}\n")
            else:  # a long flag keeps its line; its help starts on the next
                self.write(f"{'':>{self.current_indent}}{term}\n{indent}{lines[0]}\n")
            for line in lines[1:]:
                self.write(f"{indent}{line}\n")


def _wrap(text: str, width: int) -> list[str]:
    return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False, break_long_words=False)


class HelpContext(_Context):
    formatter_class = HelpFormatter


class SectionedCommand(TyperCommand):
    """A typer command whose help lists arguments, general options, then each panel's options."""

    context_class = HelpContext

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        """``[OPTIONS] MODEL [PROMPT]``: brackets mark what may be left out, as in every man page."""
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if param.param_type_name == "argument":
                name = param.metavar or param.name.upper()
                pieces.append(name if param.required else f"[{name}]")
        return pieces

    def format_options(self, ctx: Any, formatter: Any) -> None:
        sections: dict[str, list[tuple[str, str]]] = {ARGUMENTS: [], OPTIONS: []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            title = ARGUMENTS if param.param_type_name == "argument" else getattr(param, "rich_help_panel", None)
            sections.setdefault(title or OPTIONS, []).append(record)
        for title, rows in sections.items():
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)
