"""``llmctl top``'s expert-load view and models panel against real ``llmctl serve`` processes: a
mixture-of-experts model shows its per-expert token counts and the share of expert bytes a pass
reads, exactly as ``/v1/engine/stats`` has them; a server of several models shows the table
``llmctl ps`` draws; a dense model of a one-model server shows neither."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import httpx
import pytest
from tui_helpers import drive, shown_text

from llmctl.tui.app import TopApp
from llmctl.tui.experts import ExpertPanel, expert_totals
from llmctl.tui.models import ModelsPanel
from llmctl.tui.sources import HttpSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from server_helpers import ServerProcess  # noqa: E402

FLAGS = ("--kv-cache-memory", "16MiB", "--dtype", "float32")


def complete(url: str, model: str, count: int = 3) -> None:
    for i in range(count):
        answer = httpx.post(
            f"{url}/v1/completions",
            json={"model": model, "prompt": f"story number {i}", "max_tokens": 8, "ignore_eos": True},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    from model_factory import make_hf_model

    from llmctl.models.embedded import embedded_tokenizer

    tokenizer = embedded_tokenizer()
    out = make_hf_model(
        "mixtral", tmp_path_factory.mktemp("moe") / "mixtral", vocab_size=tokenizer.backend.get_vocab_size()
    )
    tokenizer.backend.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer.config))
    return out


def look(url: str) -> dict:
    """What the dashboard shows after polling ``url``: the snapshot, and each extra panel's text
    (None when hidden)."""
    seen = {}

    async def scenario(app, pilot):
        await app.poll_once()
        await pilot.pause()
        seen["snapshot"] = app.state.snapshot
        for key, panel in (("experts", ExpertPanel), ("models", ModelsPanel)):
            widget = app.query_one(panel)
            seen[key] = shown_text(widget) if widget.display else None

    drive(TopApp(HttpSource(url), interval=None), scenario, size=(160, 60))
    return seen


def test_expert_load_of_a_moe_model(moe_model, tmp_path):
    server = ServerProcess(str(moe_model), *FLAGS, "--served-model-name", "moe", log_path=tmp_path / "moe.log")
    try:
        complete(server.url, "moe")
        seen = look(server.url)
    finally:
        server.kill()
    experts = seen["snapshot"]["experts"]
    totals = expert_totals(experts)
    assert len(totals) == 8 and sum(totals) > 0 and len(experts["layers"]) == 2
    text = seen["experts"]
    assert f"reads {100 * experts['read_share_per_step']:.1f}% of" in text
    assert "8 experts × 2 layers" in text
    busiest = max(range(8), key=lambda i: (totals[i], -i))
    rows = [line for line in text.splitlines() if re.match(r"│\s*e\d+ ", line)]
    assert f"e{busiest} " in rows[0] and f"{totals[busiest]:,}" in rows[0]
    for i, count in enumerate(totals):  # every expert's count, with its share
        assert any(
            f"e{i} " in row and f" {count:,} " in row and f"{100 * count / sum(totals):.1f}%" in row for row in rows
        )
    assert seen["models"] is None  # one model: no models panel


def test_models_panel_of_a_server_of_several_models(tmp_path):
    config = tmp_path / "models.json"
    config.write_text(
        json.dumps(
            {
                "models": [
                    {"name": "first", "model": "tiny-random-llama"},
                    {"name": "second", "model": "tiny-random-llama"},
                ]
            }
        )
    )
    server = ServerProcess(f"--config={config}", *FLAGS, log_path=tmp_path / "many.log")
    try:
        complete(server.url, "first", count=1)
        seen = look(server.url)
    finally:
        server.kill()
    assert seen["experts"] is None  # a dense model
    status = {m["name"]: m for m in seen["snapshot"]["models_status"]["models"]}
    assert status["first"]["loaded"] and not status["second"]["loaded"]
    lines = seen["models"].splitlines()
    assert "Models" in lines[0] and "loaded" in lines[0]
    header = next(line for line in lines if "NAME" in line)
    assert all(column in header for column in ("STATUS", "MEMORY", "IN FLIGHT", "IDLE"))
    first = next(line for line in lines if "first" in line)
    second = next(line for line in lines if "second" in line)
    assert "idle" in first and "MiB" in first
    assert "unloaded" in second
