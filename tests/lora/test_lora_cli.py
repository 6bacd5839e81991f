"""``llmctl serve``'s LoRA options: adapters attach to their base model's spec (NAME=PATH for one
model, JSON with base_model_name for several), clashing or unknown names are refused, and the
runtime load/unload routes exist only behind --enable-lora-runtime-updates."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from llmctl.config import EngineConfig
from llmctl.errors import ConfigError
from llmctl.server.app import build_app
from llmctl.server.cli import _attach_adapters, _is_adapter_argument
from llmctl.server.model_manager import ModelManager, ModelSpec
from llmctl.server.serving import ServerState


def test_adapters_attach_to_their_base(lora_adapters) -> None:
    path = str(lora_adapters["llama"]["r8"])
    one = _attach_adapters([ModelSpec("base", "/models/base")], [f"a={path}", f"b={path}"])
    assert one[0].adapters == {"a": path, "b": path}
    assert one[0].config(EngineConfig()).lora_modules == (f"a={path}", f"b={path}")
    two = [ModelSpec("x", "/m/x"), ModelSpec("y", "/m/y")]
    attached = _attach_adapters(two, [json.dumps({"name": "a", "path": path, "base_model_name": "y"})])
    assert attached[0].adapters == {} and attached[1].adapters == {"a": path}
    for entries, message in [
        ([f"a={path}"], "several models are served"),
        ([json.dumps({"name": "a", "path": path, "base_model_name": "z"})], "no served model is named 'z'"),
        ([json.dumps({"name": "x", "path": path, "base_model_name": "y"})], "already served"),
        (["a"], "expected NAME=PATH"),
        (["{not json"], "expected JSON"),
    ]:
        with pytest.raises(ConfigError, match=message):
            _attach_adapters(two, entries)
    # `--lora-modules a=DIR b=DIR`: the second lands among the MODEL arguments, and is told apart
    assert _is_adapter_argument(f"b={path}") and _is_adapter_argument('{"name": "c"}')
    assert not _is_adapter_argument("name=/no/such/dir") and not _is_adapter_argument(path)


@pytest.mark.parametrize("enabled", [False, True])
def test_runtime_routes_only_behind_the_flag(enabled: bool) -> None:
    manager = ModelManager([ModelSpec("m", "/m")], lambda spec: None, server_state=ServerState())
    client = TestClient(build_app(manager, enable_lora_runtime_updates=enabled))
    answer = client.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert answer.status_code == 404
    assert ("no LoRA adapter named `nope`" in answer.text) == enabled
    assert ("no route" in answer.text) != enabled


def test_chat_answers_through_the_adapter(stories_dir, tmp_path) -> None:
    """``llmctl chat MODEL --lora DIR``: the banner names the adapter, the slots take its rank (32,
    above the default 16), and the greedy answer is the adapter's, not the base model's."""
    import subprocess
    import sys

    from lora_factory import ALL_LINEAR, make_adapter

    adapter = make_adapter(stories_dir, tmp_path / "tale", rank=32, targets=ALL_LINEAR, seed=7, std=0.2)

    def answer(*extra: str) -> str:
        cmd = [sys.executable, "-m", "llmctl.cli", "chat", str(stories_dir), "-t", "0", "-n", "16"]
        done = subprocess.run(
            [*cmd, "--dtype", "float32", "--kv-cache-memory", "16MiB", *extra],
            input="Once upon a time\n",
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    plain, adapted = answer(), answer("--lora", str(adapter))
    assert "LoRA tale" in adapted and "LoRA" not in plain
    banner_lines = 3
    assert adapted.splitlines()[banner_lines:] != plain.splitlines()[banner_lines:]


def test_bench_spreads_requests_over_the_adapters(lora_bases, lora_adapters, monkeypatch) -> None:
    """``llmctl bench MODEL --lora-modules a=DIR --lora-modules b=DIR``: the in-process requests run
    round-robin over the adapters (the engine sees each request's adapter; r64 sizes the slots);
    --url or a malformed entry is one clear line."""
    from typer.testing import CliRunner

    from llmctl.cli import app
    from llmctl.engine.async_engine import AsyncEngine

    seen: list[str | None] = []
    generate = AsyncEngine.generate

    def recording(self, prompt, params, final_only=False, **kwargs):
        seen.append(kwargs.get("lora"))
        return generate(self, prompt, params, final_only, **kwargs)

    monkeypatch.setattr(AsyncEngine, "generate", recording)
    adapters = lora_adapters["llama"]
    workload = ["--num-prompts", "6", "--warmup", "0", "--concurrency", "3", "--input-len", "8", "--output-len", "4"]
    engine = [str(lora_bases["llama"]), "--dtype", "float32", "--kv-cache-memory", "16MiB"]
    loras = ["--lora-modules", f"a={adapters['r8']}", "--lora-modules", f"b={adapters['r64']}"]
    result = CliRunner().invoke(app, ["bench", *engine, *workload, *loras])
    assert result.exit_code == 0, result.output
    assert sorted(seen) == ["a", "a", "a", "b", "b", "b"]
    assert "round-robin over the LoRA adapters" in result.output
    for extra, message in [
        (["--url", "http://127.0.0.1:9"], "--lora-modules runs adapters in process"),
        (["--lora-modules", "nodir"], "takes NAME=DIR"),
    ]:
        args = [*workload, *(loras if "--url" in extra else []), *extra]
        result = CliRunner().invoke(app, ["bench", *(() if "--url" in extra else engine), *args])
        assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output
