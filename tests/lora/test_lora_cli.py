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
