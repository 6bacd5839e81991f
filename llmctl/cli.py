"""The ``llmctl`` command line. Kept thin: each command parses options and calls into a module."""

from __future__ import annotations

import sys
import time
from typing import Annotated

import typer
from rich.console import Console

from llmctl import __version__
from llmctl.cli_help import SectionedCommand
from llmctl.cli_options import (
    SAMPLING,
    ModelArg,
    config_for_model,
    engine_options,
    exit_on_error,
    given_on_command_line,
    usage_error,
)
from llmctl.config import EngineConfig

app = typer.Typer(
    name="llmctl",
    help="A terminal-first LLM inference engine: paged KV cache, continuous batching, OpenAI-compatible server.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
err = Console(stderr=True, soft_wrap=True)  # long lines stay whole when stderr is not a terminal


def _version(value: bool) -> None:
    if value:
        print(f"llmctl {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """llmctl: pull, chat, serve, bench and watch LLMs on your own machine."""


@app.command()
@engine_options(
    exclude=("max_num_seqs", "enable_prefix_caching", "chat_template"),  # one raw prompt
    helps={"seed": "Seeds the sampling: the same seed, prompt and options give the same text."},
)
def generate(
    ctx: typer.Context,
    model: ModelArg,
    prompt: Annotated[str, typer.Argument(metavar="PROMPT", help="Prompt text; '-' reads it from standard input.")],
    max_tokens: Annotated[
        int,
        typer.Option(
            "--max-tokens", "-n", help="Tokens to generate at most (-n as in llama.cpp).", rich_help_panel=SAMPLING
        ),
    ] = 128,
    temperature: Annotated[
        float, typer.Option("--temperature", "-t", help="0 = greedy.", rich_help_panel=SAMPLING)
    ] = 0.8,
    top_p: Annotated[
        float, typer.Option("--top-p", help="Nucleus sampling; 1 disables.", rich_help_panel=SAMPLING)
    ] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 disables.", rich_help_panel=SAMPLING)] = 0,
    stop: Annotated[
        list[str] | None, typer.Option("--stop", help="Stop string (repeatable).", rich_help_panel=SAMPLING)
    ] = None,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Keep going past the end-of-sequence token.", rich_help_panel=SAMPLING)
    ] = False,
    sample_seed: Annotated[int | None, typer.Option("--sample-seed", hidden=True)] = None,  # older --seed
    *,
    engine_config: EngineConfig,
) -> None:
    """Generate a completion of PROMPT. The text streams to stdout, then a stats line to stderr.

    -n is --max-tokens, the tokens to predict (llama.cpp's -n); one completion is generated (the
    API's n, completions per prompt, is a request field of llmctl serve). --seed makes the
    sampling repeatable.
    """
    from llmctl.engine.llm_engine import LLMEngine
    from llmctl.sampling_params import SamplingParams

    if prompt == "-" and sys.stdin.isatty():  # otherwise it would wait in silence
        err.print("[dim]reading the prompt from standard input: type it, then Ctrl-D[/]")
    if sample_seed is not None:
        if given_on_command_line(ctx, "seed"):
            usage_error("--sample-seed is the older name of --seed: give one of them")
        engine_config.seed = sample_seed
    text = sys.stdin.read().removesuffix("\n") if prompt == "-" else prompt
    with exit_on_error(err):
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop=stop or [],
            ignore_eos=ignore_eos,
        )
        config = config_for_model(engine_config, model)
        loaded = time.perf_counter()
        engine = LLMEngine(config)
        err.print(
            f"[dim]model: {engine.model_label} · {engine.dtype_description} · {engine.kv_description} · "
            f"{engine.device} · "
            f"{engine.runner.decode_path} · "
            f"{engine.weights_description} · "
            f"{engine.block_manager.num_blocks} KV blocks · load {time.perf_counter() - loaded:.2f}s[/]"
        )
        start = time.perf_counter()
        engine.add_request(text, params)
        sys.stdout.write(text)
        first_token = None
        final = None
        while engine.has_unfinished():
            for out in engine.step():
                if first_token is None:
                    first_token = time.perf_counter()
                sys.stdout.write(out.outputs[0].delta_text)
                sys.stdout.flush()
                final = out
        elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    generated = len(final.outputs[0].token_ids)
    decode_time = elapsed - (first_token - start)
    rate = f"{(generated - 1) / decode_time:.1f} tokens/s" if generated > 1 and decode_time > 0 else "n/a tokens/s"
    err.print(
        f"[dim]prompt {tokens(len(final.prompt_token_ids))} · generated {tokens(generated)} "
        f"({final.outputs[0].finish_reason}) · "
        f"TTFT {1000 * (first_token - start):.0f} ms · {rate} · total {elapsed:.2f}s[/]"
    )


def tokens(n: int) -> str:
    """``1 token``, ``2 tokens``."""
    return f"{n} token{'' if n == 1 else 's'}"


def _register_feature_commands() -> None:
    """Each feature package owns its commands; this order is the order of ``--help``."""
    from llmctl.bench.cli import register_commands as register_bench
    from llmctl.chat import register_commands as register_chat
    from llmctl.hub.cli import register_hub_commands
    from llmctl.perplexity import register_commands as register_perplexity
    from llmctl.router import register_commands as register_router
    from llmctl.server.cli import register_commands as register_serve
    from llmctl.server.ps_cli import register_commands as register_ps
    from llmctl.tui.cli import register_commands as register_top

    for register in (
        register_hub_commands,
        register_chat,
        register_serve,
        register_ps,
        register_router,
        register_bench,
        register_perplexity,
        register_top,
    ):
        register(app)
    for command in app.registered_commands:  # plain, sectioned help for every command
        command.cls = SectionedCommand


_register_feature_commands()

if __name__ == "__main__":
    app()
