"""Each command takes only the options that mean something to it: options given where they do
nothing are one-line errors naming both flags (exit status 2, nothing loaded), older flag names
still work, and MODEL reaches the engine the same way in every command."""

from __future__ import annotations

import dataclasses
import re

import pytest
import typer
from typer.testing import CliRunner

import llmctl.bench.session as bench_session
import llmctl.engine.llm_engine as llm_engine
import llmctl.tui.cli as tui_cli
from llmctl.cli import app
from llmctl.cli_options import ENGINE, GROUP_OF_FIELD, REQUIREMENTS, USAGE_ERROR, engine_option_list, engine_options
from llmctl.config import EngineConfig
from llmctl.errors import ConfigError

GENERATE = ["generate", "tiny-random-llama", "hi"]


def run(args: list[str]) -> typer.testing.Result:
    return CliRunner().invoke(app, args)


def one_line_error(result) -> str:
    """The whole output of a refused command line: exactly one line, ``error: ...``."""
    assert result.exit_code == USAGE_ERROR, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    return lines[0]


@pytest.mark.parametrize(
    ("args", "flags"),
    [
        (["--kv-quant-group-size", "64"], ("--kv-quant-group-size", "--kv-cache-dtype kivi2 | kivi4", "auto")),
        (
            ["--kv-residual-length", "64", "--kv-cache-dtype", "int8"],
            ("--kv-residual-length", "--kv-cache-dtype kivi2 | kivi4", "int8"),
        ),
        (["--quantization-group-size", "32"], ("--quantization-group-size", "--quantization int4", "auto")),
        (
            ["--quantization-group-size", "32", "--quantization", "int8"],
            ("--quantization-group-size", "--quantization int4", "int8"),
        ),
        (["--calibration", "builtin"], ("--calibration", "--quantization int8 | int4 | fp8", "auto")),
        (["--num-speculative-tokens", "3"], ("--num-speculative-tokens", "--speculative-model")),
        (["--ngram-prompt-lookup-max", "3"], ("--ngram-prompt-lookup-max", "--speculative-model ngram")),
        (
            ["--ngram-prompt-lookup-min", "1", "--speculative-model", "tiny-random-llama"],
            ("--ngram-prompt-lookup-min", "--speculative-model ngram", "tiny-random-llama"),
        ),
        (["--memory-fraction", "0.5", "--kv-cache-memory", "1GiB"], ("--memory-fraction", "--kv-cache-memory")),
        (["--memory-fraction", "0.5", "--device", "cpu"], ("--memory-fraction", "--device auto | cuda", "cpu")),
        (["--seed", "1", "--sample-seed", "2"], ("--sample-seed", "--seed")),
        (["--kernel-backend", "torch", "--attention-backend", "torch"], ("--attention-backend", "--kernel-backend")),
    ],
)
def test_options_that_need_another_are_one_line_errors(args, flags):
    message = one_line_error(run([*GENERATE, *args]))
    for flag in flags:
        assert flag in message


def test_options_that_do_something_together_pass_the_check(monkeypatch):
    seen = []

    def capture(config):
        seen.append(config)
        raise ConfigError("stopped before loading")

    monkeypatch.setattr(llm_engine, "LLMEngine", capture)
    result = run(
        [
            *GENERATE,
            "--kv-cache-dtype",
            "kivi4",
            "--kv-quant-group-size",
            "64",
            "--kv-residual-length",
            "32",
            "--quantization",
            "int4",
            "--quantization-group-size",
            "32",
            "--speculative-model",
            "ngram",
            "--ngram-prompt-lookup-max",
            "3",
            "--num-speculative-tokens",
            "2",
            "--kernel-backend",
            "torch",
        ]
    )
    assert result.exit_code == 1 and "kivi2/kivi4 cannot be combined with --speculative-model" in result.output
    result = run(
        [
            *GENERATE,
            "--kv-cache-dtype",
            "kivi2",
            "--kv-quant-group-size",
            "64",
            "--quantization",
            "int4",
            "--quantization-group-size",
            "32",
            "--attention-backend",
            "torch",
            "--sample-seed",
            "7",
        ]
    )
    assert result.exit_code == 1 and "stopped before loading" in result.output, result.output
    config = seen[-1]
    assert (config.kv_quant_group_size, config.quantization_group_size) == (64, 32)
    assert config.kernel_backend == "torch" and config.seed == 7  # the older names set the same fields


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--kv-cache-memory", "1GiB"], "--kv-cache-memory"),
        (["--tp", "2"], "--tensor-parallel-size"),
        (["--speculative-model", "ngram"], "--speculative-model"),
        (["--dtype", "float32"], "--dtype"),  # the server's dtype is its own; with --baseline it is the baseline's
    ],
)
def test_bench_url_refuses_engine_options(args, flag):
    message = one_line_error(run(["bench", "--url", "http://127.0.0.1:9", *args]))
    assert flag in message and "--url" in message


def test_bench_url_keeps_the_options_it_uses(monkeypatch):
    seen = []
    monkeypatch.setattr(bench_session, "run_bench", lambda options, out, err: seen.append(options))
    result = run(["bench", "--url", "http://127.0.0.1:9", "--threads", "1", "--dtype", "float32", "--baseline", "hf"])
    assert result.exit_code == 0, result.output
    assert seen[0].engine_config.num_threads == 1 and seen[0].engine_config.dtype == "float32"
    assert seen[0].url == "http://127.0.0.1:9"


@pytest.mark.parametrize(
    ("args", "flags"),
    [
        (["--kv-cache-memory", "1GiB"], ("--kv-cache-memory", "--local")),
        (["--seed", "3"], ("--seed", "--local")),
        (["tiny-random-llama"], ("MODEL", "--local")),
        (["--model", "tiny-random-llama"], ("--model", "--local")),
        (["--rate", "5"], ("--rate", "--local")),
        (["--local", "--url", "http://127.0.0.1:9"], ("--url", "--local")),
        (["--local", "--api-key", "k"], ("--api-key", "--local")),
        (["--local", "tiny-random-llama", "--model", "tiny-random-llama"], ("--model", "MODEL")),
    ],
)
def test_top_without_local_refuses_engine_options(args, flags, tmp_path):
    message = one_line_error(run(["top", *args]))
    for flag in flags:
        assert flag in message


def test_top_replay_refuses_url(tmp_path):
    replay = tmp_path / "s.jsonl"
    replay.write_text("{}\n")
    message = one_line_error(run(["top", "--replay", str(replay), "--url", "http://127.0.0.1:9"]))
    assert "--url" in message and "--replay" in message


@pytest.mark.parametrize("model_args", [["tiny-random-llama"], ["--model", "tiny-random-llama"], []])
def test_top_local_takes_model_as_an_argument(monkeypatch, model_args):
    seen = {}

    def local_source(model, rate, engine_config):
        seen.update(model=model, rate=rate, config=engine_config)
        return object()

    monkeypatch.setattr(tui_cli, "_local_source", local_source)
    monkeypatch.setattr(tui_cli, "run_app", lambda dashboard: seen.update(shown=True))
    result = run(["top", "--local", *model_args, "--rate", "5", "--kv-cache-memory", "8MiB"])
    assert result.exit_code == 0, result.output
    assert seen["model"] == "tiny-random-llama" and seen["rate"] == 5 and seen["shown"]
    assert seen["config"].kv_cache_memory == 8 << 20


def test_top_without_local_watches_a_server_whatever_the_environment(monkeypatch):
    """LLMCTL_API_KEY in the environment is not a flag the user typed: no conflict with --local."""
    seen = {}
    monkeypatch.setattr(tui_cli, "run_app", lambda dashboard: seen.update(source=dashboard.source))
    result = CliRunner().invoke(app, ["top", "--url", "http://127.0.0.1:9"], env={"LLMCTL_API_KEY": "k"})
    assert result.exit_code == 0, result.output
    assert type(seen["source"]).__name__ == "HttpSource"


@pytest.mark.parametrize("flag", ["--speculative-model", "--num-speculative-tokens", "--seed", "--chat-template"])
def test_perplexity_has_no_sampling_options(flag, tmp_path):
    result = run(["perplexity", "tiny-random-llama", "--text", str(tmp_path / "t.txt"), flag, "1"])
    assert result.exit_code == USAGE_ERROR and "No such option" in result.output


def test_every_engine_option_has_a_group():
    """A new EngineConfig option must be placed in a group: the group decides which commands get it."""
    unplaced = [o.name for o in engine_option_list() if o.group == ENGINE]
    assert not unplaced, f"add these EngineConfig fields to GROUP_OF_FIELD in llmctl/cli_options.py: {unplaced}"
    assert set(GROUP_OF_FIELD) == {o.name for o in engine_option_list()}


def test_every_requirement_names_engine_options():
    names = {o.name for o in engine_option_list()}
    for requirement in REQUIREMENTS:
        assert {*requirement.fields, requirement.needs} <= names


def test_decorator_gives_a_command_only_its_groups():
    """A command built with engine_options(groups=...) has exactly those groups' options, and its
    hidden older flags only where the option they alias is offered."""
    probe = typer.Typer()
    seen = []

    @probe.command()
    @engine_options(groups=("KV cache",))
    def kv_only(engine_config: EngineConfig) -> None:
        seen.append(engine_config)

    assert CliRunner().invoke(probe, ["--kv-cache-memory", "4MiB"]).exit_code == 0
    assert seen[0].kv_cache_memory == 4 << 20
    for flag in ("--dtype", "--attention-backend", "--tp", "--speculative-model"):
        result = CliRunner().invoke(probe, [flag, "1"])
        assert result.exit_code == USAGE_ERROR and "No such option" in result.output
    help_text = CliRunner().invoke(probe, ["--help"], env={"COLUMNS": "200"}).output
    assert "--kv-cache-dtype" in help_text and not re.search(r"--(dtype|quantization|seed)\b", help_text)


def test_defaults_of_offered_options_are_the_config_defaults():
    defaults = EngineConfig()
    for option in engine_option_list():
        assert option.default == getattr(defaults, option.name) or option.cli.parse is not None
    assert dataclasses.fields(EngineConfig)  # the options come from the dataclass itself
