"""``/api/embed`` and ``/api/embeddings`` through the official ``ollama`` client against a real
``llmctl serve`` of a sentence-transformers model: the vectors sentence-transformers computes,
``truncate``, ``keep_alive``, errors in Ollama's shape, ``ps``/``list`` as Ollama answers them, and
every KV block back."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import httpx
import ollama
import pytest
import torch
from server_helpers import API_KEY, wait_until

_spec = importlib.util.spec_from_file_location(
    "pooling_models", Path(__file__).resolve().parents[1] / "engine" / "test_pooling.py"
)
pooling_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pooling_models)
TEXTS = pooling_models.TEXTS
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    st_dir = pooling_models.make_sentence_transformer("qwen3", tmp_path_factory.mktemp("embed"), "last")
    return st_dir, pooling_models.st_encode(st_dir, TEXTS)


@pytest.fixture(scope="module")
def server(start_server, embedding_model):
    return start_server(
        str(embedding_model[0]),
        "--api-key",
        API_KEY,
        "--served-model-name",
        "embedder",
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        "256",
        "--dtype",
        "float32",
    )


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url, headers=AUTH, timeout=120)


def all_blocks_back(server) -> None:
    def idle():
        stats = httpx.get(f"{server.url}/v1/engine/stats", headers=AUTH, timeout=30).json()
        kv, scheduler = stats["kv"], stats["scheduler"]
        return scheduler["running"] == scheduler["waiting"] == 0 and kv["used"] == kv["shared"] == 0

    wait_until(idle, timeout=30)


def test_embed_is_sentence_transformers_vectors_and_ollamas_shape(client, server, embedding_model):
    _, expected = embedding_model
    answer = client.embed(model="embedder", input=TEXTS, keep_alive="5m", options={"temperature": 0.5})
    torch.testing.assert_close(torch.tensor(answer.embeddings), expected, atol=1e-5, rtol=0)
    assert answer.model == "embedder" and answer.prompt_eval_count > len(TEXTS)
    assert answer.total_duration > 0 and answer.load_duration == 0
    one = client.embed(model="embedder:latest", input=TEXTS[2])
    torch.testing.assert_close(torch.tensor(one.embeddings[0]), expected[2], atol=1e-5, rtol=0)
    legacy = client.embeddings(model="embedder", prompt=TEXTS[1])
    torch.testing.assert_close(torch.tensor(legacy.embedding), expected[1], atol=1e-5, rtol=0)
    assert client.embeddings(model="embedder", prompt="").embedding == []
    all_blocks_back(server)


def test_truncate_cuts_to_the_context_or_refuses(client, server):
    long_text = " ".join(TEXTS * 30)
    with pytest.raises(ollama.ResponseError) as error:
        client.embed(model="embedder", input=long_text, truncate=False)
    assert error.value.status_code == 400 and "maximum context length is 256" in error.value.error
    cut = client.embed(model="embedder", input=long_text)
    assert cut.prompt_eval_count == 256
    direct = httpx.post(
        f"{server.url}/v1/embeddings",
        headers=AUTH,
        json={"input": [server_tokens(server, long_text)[:256]], "encoding_format": "float"},
        timeout=60,
    ).json()
    torch.testing.assert_close(torch.tensor(cut.embeddings[0]), torch.tensor(direct["data"][0]["embedding"]))
    all_blocks_back(server)


def server_tokens(server, text: str) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", headers=AUTH, json={"prompt": text}, timeout=60).json()["tokens"]


def test_errors_are_ollamas_and_ps_list_answer_as_ollama(client, server):
    cases = [
        (dict(model="nomic-embed-text", input="hi"), 404, "not found"),
        (dict(model="embedder", input=[]), 400, "empty list"),
        (dict(model="embedder", input=["hi", ""]), 400, "input[1] is an empty string"),
        (dict(model="embedder", input="hi", dimensions=8), 400, "Matryoshka"),
    ]
    for kwargs, status, needle in cases:
        with pytest.raises(ollama.ResponseError) as error:
            client.embed(**kwargs)
        assert error.value.status_code == status and needle in error.value.error, (kwargs, error.value)
    raw = httpx.post(f"{server.url}/api/embed", headers=AUTH, json={"model": "embedder"}, timeout=30)
    assert raw.status_code == 400 and set(raw.json()) == {"error"}
    assert [m.model for m in client.list().models] == ["embedder"]
    running = client.ps().models
    assert [m.model for m in running] == ["embedder"] and running[0].context_length == 256
    assert running[0].size > 0 and running[0].expires_at is not None
    all_blocks_back(server)
    # keep_alive goes to the model manager; a server of one model keeps it loaded (docs/server.md)
    assert client.embed(model="embedder", input="hi", keep_alive=0).embeddings
    assert [m.model for m in client.ps().models] == ["embedder"]
