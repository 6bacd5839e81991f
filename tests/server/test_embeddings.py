"""``/v1/embeddings`` through the real ``openai`` client against sentence-transformers, and
``/v1/rerank`` / ``/score`` through httpx against a reranker's yes/no scores computed with
transformers; every KV block comes back."""

from __future__ import annotations

import base64
import importlib.util
import math
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from server_helpers import API_KEY, wait_until

_spec = importlib.util.spec_from_file_location(
    "pooling_models", Path(__file__).resolve().parents[1] / "engine" / "test_pooling.py"
)
pooling_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pooling_models)
TEXTS = pooling_models.TEXTS

QWEN3_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
)
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@pytest.fixture(scope="module")
def embedding_model(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    st_dir = pooling_models.make_sentence_transformer("qwen3", tmp_path_factory.mktemp("embed"), "last")
    return st_dir, pooling_models.st_encode(st_dir, TEXTS)


@pytest.fixture(scope="module")
def embedding_server(start_server, embedding_model):
    return start_server(
        str(embedding_model[0]),
        "--api-key",
        API_KEY,
        "--served-model-name",
        "embedder",
        "--kv-cache-memory",
        "16MiB",
        "--max-num-batched-tokens",
        "32",
        "--matryoshka",
        "--dtype",
        "float32",
    )


@pytest.fixture(scope="module")
def reranker_server(start_server, embedding_model):
    """The same checkpoint as a Qwen3-Reranker-style causal LM (its yes/no logits score pairs)."""
    return start_server(
        str(embedding_model[0]),
        "--api-key",
        API_KEY,
        "--served-model-name",
        "reranker",
        "--kv-cache-memory",
        "16MiB",
        "--rerank-template",
        "qwen3",
        "--dtype",
        "float32",
    )


def client_for(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


def assert_all_blocks_back(http: httpx.Client) -> None:
    def idle():
        stats = http.get("/v1/engine/stats").json()
        kv, scheduler = stats["kv"], stats["scheduler"]
        return scheduler["running"] == scheduler["waiting"] == 0 and kv["used"] == kv["shared"] == 0

    wait_until(idle, timeout=30)


def test_openai_client_float_and_base64(embedding_server, embedding_model):
    import openai

    _, expected = embedding_model
    client = openai.OpenAI(base_url=embedding_server.base_url, api_key=API_KEY)
    batch = client.embeddings.create(model="embedder", input=TEXTS, encoding_format="float")
    assert [d.index for d in batch.data] == list(range(len(TEXTS)))
    got = torch.tensor([d.embedding for d in batch.data])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert batch.usage.prompt_tokens == batch.usage.total_tokens > len(TEXTS)
    # the client's default is base64 (little-endian float32), decoded by the client
    decoded = client.embeddings.create(model="embedder", input=TEXTS[3])
    torch.testing.assert_close(torch.tensor(decoded.data[0].embedding), expected[3], atol=1e-5, rtol=0)
    with client_for(embedding_server) as http:
        raw = http.post("/v1/embeddings", json={"input": [TEXTS[1]], "encoding_format": "base64"}).json()
        vector = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
        torch.testing.assert_close(torch.from_numpy(vector.copy()), expected[1], atol=1e-5, rtol=0)
        assert raw["object"] == "list" and raw["model"] == "embedder"
        assert_all_blocks_back(http)


def test_token_ids_dimensions_and_errors(embedding_server, embedding_model):
    from transformers import AutoTokenizer

    st_dir, expected = embedding_model
    ids = AutoTokenizer.from_pretrained(st_dir)(TEXTS[2])["input_ids"]
    with client_for(embedding_server) as http:
        one = http.post("/v1/embeddings", json={"input": ids}).json()
        many = http.post("/v1/embeddings", json={"input": [ids, ids[:3]]}).json()
        torch.testing.assert_close(torch.tensor(one["data"][0]["embedding"]), expected[2], atol=1e-5, rtol=0)
        assert len(many["data"]) == 2 and many["usage"]["prompt_tokens"] == len(ids) + 3
        short = http.post("/v1/embeddings", json={"input": TEXTS[2], "dimensions": 8}).json()
        want = torch.nn.functional.normalize(expected[2][:8], dim=-1)  # unit vectors: truncation renormalizes
        torch.testing.assert_close(torch.tensor(short["data"][0]["embedding"]), want, atol=1e-5, rtol=0)
        for body, param in [
            ({"input": ""}, "input"),
            ({"input": []}, "input"),
            ({"input": [1, "a"]}, "input"),
            ({"input": [[]]}, "input"),
            ({"input": [10**6]}, "input"),
            ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
            ({"input": "x", "dimensions": 0}, "dimensions"),
            ({"input": "x", "dimensions": 65}, "dimensions"),
            ({"input": "x" * 3000}, "input"),
        ]:
            response = http.post("/v1/embeddings", json=body)
            assert response.status_code == 400, (body, response.text)
            assert response.json()["error"]["param"] == param, (body, response.text)
        assert http.post("/v1/embeddings", json={"input": "x", "model": "other"}).status_code == 404
        assert httpx.post(f"{embedding_server.url}/score", json={"text_1": "a", "text_2": "b"}).status_code == 401
        assert_all_blocks_back(http)


def test_embedding_model_scores_by_cosine(embedding_server, embedding_model):
    _, expected = embedding_model
    with client_for(embedding_server) as http:
        score = http.post("/score", json={"text_1": TEXTS[1], "text_2": [TEXTS[2], TEXTS[3]]}).json()
        want = [float(expected[1] @ expected[i]) for i in (2, 3)]
        assert [d["score"] for d in score["data"]] == pytest.approx(want, abs=1e-5)
        rerank = http.post(
            "/v1/rerank", json={"query": TEXTS[1], "documents": TEXTS[2:5], "top_n": 2, "return_documents": True}
        ).json()
        cosines = [float(expected[1] @ expected[i]) for i in (2, 3, 4)]
        order = sorted(range(3), key=lambda i: -cosines[i])[:2]
        assert [r["index"] for r in rerank["results"]] == order
        assert [r["relevance_score"] for r in rerank["results"]] == pytest.approx([cosines[i] for i in order], abs=1e-5)
        assert rerank["results"][0]["document"] == {"text": TEXTS[2 + order[0]]}
        assert_all_blocks_back(http)


def hf_reranker_scores(model_dir: Path, pairs: list[tuple[str, str]]) -> list[float]:
    """Qwen3-Reranker's model card, verbatim in substance: prefix + formatted pair + suffix, the
    last position's logits of "yes" and "no", log-softmax, exp."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    prefix = tokenizer.encode(QWEN3_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(QWEN3_SUFFIX, add_special_tokens=False)
    scores = []
    with torch.inference_mode():
        for query, document in pairs:
            text = f"<Instruct>: {INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
            ids = prefix + tokenizer(text, add_special_tokens=False)["input_ids"] + suffix
            logits = model(torch.tensor([ids])).logits[0, -1]
            pair = torch.log_softmax(torch.stack([logits[no], logits[yes]]), dim=0)
            scores.append(pair[1].exp().item())
    return scores


def test_reranker_yes_no_scores(reranker_server, embedding_model):
    st_dir, _ = embedding_model
    query, documents = TEXTS[1], [TEXTS[0], TEXTS[2], TEXTS[4], TEXTS[6]]
    want = hf_reranker_scores(st_dir, [(query, d) for d in documents])
    with client_for(reranker_server) as http:
        rerank = http.post(
            "/v1/rerank",
            json={"model": "reranker", "query": query, "documents": [{"text": d} for d in documents]},
        ).json()
        got = {r["index"]: r["relevance_score"] for r in rerank["results"]}
        assert [got[i] for i in range(len(documents))] == pytest.approx(want, abs=1e-5)
        assert [r["index"] for r in rerank["results"]] == sorted(range(len(want)), key=lambda i: -want[i])
        assert rerank["usage"]["prompt_tokens"] > 0
        score = http.post("/score", json={"text_1": [query, query], "text_2": documents[:2]}).json()
        assert [d["score"] for d in score["data"]] == pytest.approx(want[:2], abs=1e-5)
        assert all(0 < d["score"] < 1 and not math.isnan(d["score"]) for d in score["data"])
        bad = http.post("/score", json={"text_1": ["a", "b"], "text_2": ["c", "d", "e"]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
        bad = http.post("/v1/rerank", json={"query": "q", "documents": []})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "documents"
        bad = http.post("/v1/rerank", json={"query": "q", "documents": ["a"], "top_n": 0})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_n"
        # generation still works on the same engine
        completion = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0}).json()
        assert completion["usage"]["completion_tokens"] == 3
        assert_all_blocks_back(http)
