"""LoRA adapters in ``llmctl serve --config``: a model entry's ``lora_modules`` (a mapping or a list
of NAME=PATH), ``max_loras`` and ``max_lora_rank`` become its engine options; malformed entries,
ranks below 1 and names served twice are refused before anything loads, naming the model."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from llmctl.cli import app
from llmctl.config import EngineConfig
from llmctl.errors import ConfigError
from llmctl.server.model_manager import read_config_file


def _write(tmp_path, text: str):
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return str(path)


def test_adapters_and_lora_limits_per_model(tmp_path) -> None:
    config = _write(
        tmp_path,
        "models:\n"
        "  - name: a\n    model: /m/a\n    max-lora-rank: 32\n    max_loras: 2\n"
        "    lora_modules: {sql: /adapters/sql, chat: /adapters/chat}\n"
        "  - name: b\n    model: /m/b\n    lora_modules: [qa=/adapters/qa]\n"
        "  - name: c\n    model: /m/c\n",
    )
    specs, _ = read_config_file(config)
    a, b, c = specs
    assert a.adapters == {"sql": "/adapters/sql", "chat": "/adapters/chat"} and b.adapters == {"qa": "/adapters/qa"}
    engine = a.config(EngineConfig())
    assert (engine.max_lora_rank, engine.max_loras, engine.lora_enabled) == (32, 2, True)
    assert engine.lora_modules == ("sql=/adapters/sql", "chat=/adapters/chat")
    assert b.config(EngineConfig(max_lora_rank=64)).max_lora_rank == 64  # the command line's, unless given
    assert c.adapters == {} and not c.config(EngineConfig()).lora_enabled


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("    max_lora_rank: 0\n", r"models\[0\] \(a\): max_lora_rank must be an integer of at least 1, got 0"),
        ("    max_loras: two\n", r"models\[0\] \(a\): max_loras must be an integer of at least 1, got 'two'"),
        ("    max_loras: true\n", "max_loras must be an integer"),
        ("    lora_modules: [sql]\n", r"models\[0\] \(a\): lora_modules 'sql': expected NAME=PATH"),
        ("    lora_modules: {sql: }\n", "lora_modules 'sql': expected NAME=PATH"),
        ("    lora_modules: /adapters/sql\n", "lora_modules must map names to adapter directories"),
        ("    lora_modules: [sql=/x, sql=/y]\n", "lora_modules sql: the name is given twice"),
        ("    lora_modules: {b: /x}\n", r"LoRA adapter b of model a: the name is already served \(a model\)"),
        ("    lora_modules: {qa: /x}\n", r"LoRA adapter qa of model b: the name is already served \(an adapter of"),
    ],
)
def test_bad_lora_entries_are_refused(tmp_path, entry: str, message: str) -> None:
    second = "  - name: b\n    model: /m/b\n    lora_modules: [qa=/q]\n"
    config = _write(tmp_path, f"models:\n  - name: a\n    model: /m/a\n{entry}{second}")
    with pytest.raises(ConfigError, match=message):
        read_config_file(config)


def test_serve_refuses_a_bad_config_before_loading(tmp_path) -> None:
    config = _write(tmp_path, "models:\n  - name: a\n    model: /m/a\n    lora_modules: {a: /x}\n")
    result = CliRunner().invoke(app, ["serve", "--config", config], env={"COLUMNS": "200", "NO_COLOR": "1"})
    output = re.sub(r"\x1b\[[0-9;]*m", "", result.output)
    assert result.exit_code == 1 and "LoRA adapter a of model a: the name is already served" in output, output
    # a --lora-modules adapter may not take a name a config model's adapter has
    config = _write(tmp_path, "models:\n  - name: a\n    model: /m/a\n    lora_modules: {sql: /x}\n")
    entry = '{"name": "sql", "path": "/y", "base_model_name": "a"}'
    result = CliRunner().invoke(
        app, ["serve", "--config", config, "--lora-modules", entry], env={"COLUMNS": "200", "NO_COLOR": "1"}
    )
    output = re.sub(r"\x1b\[[0-9;]*m", "", result.output)
    assert result.exit_code == 1 and "--lora-modules sql: the name is already served" in output, output
