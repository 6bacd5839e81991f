"""The ``pull``, ``ls`` and ``rm`` commands."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from llmctl.errors import LlmctlError
from llmctl.hub.download import pull
from llmctl.hub.layout import hub_cache_dir
from llmctl.hub.listing import architecture_runs_here, list_models, partial_downloads, pulled_architecture
from llmctl.hub.progress import fmt_size
from llmctl.hub.removal import remove

if TYPE_CHECKING:  # pragma: no cover
    import typer


def _fmt_params(n: int | None) -> str:
    if n is None:
        return "?"
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


@contextlib.contextmanager
def _cli_errors() -> Iterator[None]:
    import typer
    from rich.console import Console

    try:
        yield
    except LlmctlError as exc:
        message = " ".join(str(exc).split())
        Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/bold red] {escape(message)}", highlight=False)
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        Console(stderr=True, soft_wrap=True).print(
            "[yellow]interrupted[/yellow]: partial downloads are kept; run the same command again to resume",
            highlight=False,
        )
        raise typer.Exit(130) from None


def register_hub_commands(app: typer.Typer) -> None:
    """Add ``pull``, ``ls`` and ``rm`` to a typer app."""
    import typer
    from rich.console import Console
    from rich.table import Table

    @app.command("pull")
    def pull_command(
        model: str = typer.Argument(
            ...,
            metavar="REPO_ID[@REVISION][:TAG]",
            help="Hugging Face model id, e.g. org/name@main; :TAG picks a GGUF file, e.g. org/name-GGUF:Q4_K_M.",
        ),
        token: str | None = typer.Option(
            None, "--token", help="Hugging Face token for gated/private repos (default: HF_TOKEN).", show_default=False
        ),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
        include: str | None = typer.Option(
            None,
            "--include",
            help="The GGUF file to fetch, as a glob (e.g. '*Q4_K_M.gguf'); the same as :TAG.",
            show_default=False,
        ),
    ) -> None:
        """Download a model into the Hugging Face cache: config, tokenizer and safetensors weights, or
        one GGUF file (a repo of GGUF files: its Q4_K_M one unless :TAG or --include says otherwise)."""
        with _cli_errors():
            path = pull(model, token=token, console=Console(stderr=True), progress=not quiet, include=include)
        out = Console(soft_wrap=True)
        out.print(f"[green]✓[/green] {escape(model)} → {escape(str(path))}", highlight=False)
        out.print(_runs_here_line(path), highlight=False)

    @app.command("ls")
    def ls_command() -> None:
        """List the models in the Hugging Face cache (and the GPTQ cache when it holds entries)."""
        from llmctl.models import calibration_store

        with _cli_errors():
            models = list_models()
            partial = partial_downloads()
        gptq = calibration_store.usage()
        out = Console()
        if gptq is not None and gptq.entries:
            out.print(
                f"GPTQ cache (--calibration results): {gptq.entries} entr{'y' if gptq.entries == 1 else 'ies'}, "
                f"{fmt_size(gptq.bytes)} in {escape(str(gptq.folder))} (kept under LLMCTL_GPTQ_CACHE_SIZE, "
                "default 8GiB; delete the folder to clear it)",
                highlight=False,
            )
        if not models and not partial:
            out.print(
                f"No models in the Hugging Face cache ({escape(str(hub_cache_dir()))}). "
                "Download one with `llmctl pull ORG/NAME`.",
                highlight=False,
            )
        if models:
            table = Table(box=None, pad_edge=False, header_style="bold")
            for column, justify in (
                ("NAME", "left"),
                ("REVISION", "left"),
                ("SIZE", "right"),
                ("ARCHITECTURE", "left"),
                ("PARAMS", "right"),
                ("DTYPE", "left"),
                ("BYTES/PARAM", "right"),
            ):
                table.add_column(column, justify=justify, no_wrap=True)  # type: ignore[arg-type]
            for m in models:
                revision = m.revision if m.complete else f"{m.revision} (incomplete)"
                per_param = m.bytes_per_parameter
                table.add_row(
                    escape(m.name),
                    escape(revision),
                    fmt_size(m.size_on_disk),
                    escape(m.architecture or "?") + (" (not supported)" if m.runs_here is False else ""),
                    _fmt_params(m.num_parameters),
                    escape(m.dtype or "?"),
                    "?" if per_param is None else f"{per_param:.2f}",
                )
            out.print(table)
        for repo_id, size in sorted(partial.items()):
            out.print(
                f"partial download: {escape(repo_id)} ({fmt_size(size)}) — `llmctl pull {escape(repo_id)}` resumes it, "
                f"`llmctl rm {escape(repo_id)}` deletes it",
                highlight=False,
            )
        out.print(f"without a download: {', '.join(_local_model_names())}", highlight=False, soft_wrap=True)

    @app.command("rm")
    def rm_command(
        model: str = typer.Argument(
            ..., metavar="REPO_ID[@REVISION]", help="Cached model (all revisions unless @REVISION)."
        ),
    ) -> None:
        """Delete a cached model, or one revision of it."""
        with _cli_errors():
            freed = remove(model)
        Console(soft_wrap=True).print(f"Removed {escape(model)} ({fmt_size(freed)} freed)", highlight=False)


def _local_model_names() -> list[str]:
    """The models every command takes by name with nothing in the cache: the packaged GGUF files
    installed here (``scripts/setup.sh`` installs SmolLM2's) and the embedded random-weight model."""
    from llmctl.config import EMBEDDED_MODEL_NAME
    from llmctl.models.gguf_files import PACKAGED_MODELS, packaged_model_path

    names = [
        f"{name} ({path.name}, {fmt_size(path.stat().st_size)})"
        for name in PACKAGED_MODELS
        if (path := packaged_model_path(name)) is not None
    ]
    return [*names, f"{EMBEDDED_MODEL_NAME} (random weights, built in memory)"]


def _runs_here_line(path: Path) -> str:
    """Whether the pulled model runs here, said at once rather than at the first ``generate``."""
    from llmctl.models import registry

    architecture, gguf = pulled_architecture(path)
    runs = architecture_runs_here(architecture, gguf=gguf)
    if runs is None:
        return "[yellow]architecture unknown[/yellow] (no config.json architectures or GGUF general.architecture)"
    if runs:
        return f"{escape(architecture)}: runs here"
    known = registry.gguf_architectures() if gguf else registry.architectures()
    return f"[yellow]{escape(architecture)}: llmctl does not run it[/yellow] (it runs {escape(', '.join(known))})"
