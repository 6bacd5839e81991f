"""``/v1/embeddings`` (OpenAI), ``/v1/rerank`` (Cohere / Jina / vLLM) and ``/score`` (vLLM), served
by the same engine as generation: every input becomes a pooling request (llmctl/engine/pooler.py),
prefilled in the same batches as the generation requests and answered with one vector.

- **Embeddings**: the model's final-norm hidden states pooled as ``PoolerConfig`` says (a
  sentence-transformers layout, else ``--pooling`` / ``--normalize``, else last token +
  L2 normalization). ``dimensions`` keeps the first components and normalizes again (Matryoshka):
  only for a model marked Matryoshka (config.json ``is_matryoshka`` / ``matryoshka_dimensions``,
  or ``--matryoshka``), as vLLM refuses it otherwise.
- **Rerank and score** with a reranker template (``--rerank-template``; a Qwen3-Reranker is
  recognised by its name): the query and each document are put into the template, and the score
  is ``softmax(logit_yes, logit_no)[yes]`` at the prompt's last position, the LM head run on that
  row only and the two token ids' logits kept (``--rerank-tokens``, default ``yes,no``). Without one: the
  cosine similarity of the embeddings.
"""

from __future__ import annotations

import base64
import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fastapi import Request
from pydantic import BaseModel, Field

from llmctl.engine.pooler import PoolerConfig, resolve_pooler_config
from llmctl.pooling_params import PoolingParams
from llmctl.server.protocol import STRICT, APIError, bad_request
from llmctl.server.serving import Generation, OpenAIServing
from llmctl.tokenizer import Tokenizer

UNVERSIONED_PATHS = frozenset({"/score", "/rerank"})  # outside /v1: the API key guards them too

# Qwen3-Reranker's prompt, as its model card builds it (prefix + instruction/query/document + suffix)
QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n<|im_start|>user\n'
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
QWEN3_RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True)
class RerankConfig:
    """A causal LM used as a reranker: its prompt template and the (yes, no) token ids."""

    template: str  # {query}, {document} and optionally {instruction} are filled in
    tokens: tuple[str, str]
    token_ids: tuple[int, int]
    default_instruction: str
    source: str

    def prompt(self, query: str, document: str, instruction: str | None) -> str:
        # str.replace, not str.format: a template may hold literal braces
        return (
            self.template.replace("{instruction}", instruction or self.default_instruction)
            .replace("{query}", query)
            .replace("{document}", document)
        )


@dataclass(frozen=True)
class PoolingSettings:
    """What ``llmctl serve`` decided for the pooling endpoints."""

    pooler: PoolerConfig
    rerank: RerankConfig | None = None

    @property
    def description(self) -> str:
        scoring = (
            f"rerank yes/no logits ({self.rerank.source})" if self.rerank is not None else "rerank by cosine similarity"
        )
        return f"embeddings: {self.pooler.description}; {scoring}"


def _token_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.backend.token_to_id(token)
    if token_id is None:
        ids = tokenizer.encode(token, add_special_tokens=False)
        if len(ids) != 1:
            raise ValueError(f"--rerank-tokens: {token!r} is not one token of this model's vocabulary")
        token_id = ids[0]
    return token_id


def resolve_settings(
    model: str,
    tokenizer: Tokenizer,
    *,
    pooling: str | None = None,
    normalize: bool | None = None,
    matryoshka: bool | None = None,
    rerank_template: str | None = None,
    rerank_tokens: str = "yes,no",
) -> PoolingSettings:
    """``rerank_template``: ``qwen3`` (Qwen3-Reranker's), ``none`` (cosine similarity), a file, or
    the template itself; None: Qwen3-Reranker's when the model's name or config says it is one."""
    model_dir = Path(model)
    model_dir = model_dir if model_dir.is_dir() else None
    pooler = resolve_pooler_config(model_dir, pooling, normalize, matryoshka)
    source = "--rerank-template"
    if rerank_template is None:
        names = [model]
        if model_dir is not None and (model_dir / "config.json").is_file():
            import json

            names.append(str(json.loads((model_dir / "config.json").read_text()).get("_name_or_path", "")))
        if not any("qwen3-reranker" in name.lower() for name in names):
            return PoolingSettings(pooler)
        rerank_template, source = "qwen3", "Qwen3-Reranker, recognised by its name"
    if rerank_template == "none":
        return PoolingSettings(pooler)
    instruction = ""
    if rerank_template == "qwen3":
        template, instruction = QWEN3_RERANKER_TEMPLATE, QWEN3_RERANKER_INSTRUCTION
        source = "Qwen3-Reranker's template" if source == "--rerank-template" else source
    elif Path(rerank_template).is_file():
        template = Path(rerank_template).read_text()
    else:
        template = rerank_template
    if "{query}" not in template or "{document}" not in template:
        raise ValueError("--rerank-template must contain {query} and {document}")
    parts = [t.strip() for t in rerank_tokens.split(",")]
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"--rerank-tokens {rerank_tokens!r}: give the yes and no tokens, e.g. yes,no")
    yes, no = parts
    return PoolingSettings(
        pooler,
        RerankConfig(template, (yes, no), (_token_id(tokenizer, yes), _token_id(tokenizer, no)), instruction, source),
    )


# ---- requests and responses --------------------------------------------------------------------
class EmbeddingRequest(BaseModel):
    model_config = STRICT

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    priority: int = 0
    keep_alive: str | int | float | None = None  # how long the model stays loaded (llmctl/server/model_manager.py)


class RerankDocument(BaseModel):
    model_config = STRICT

    text: str


class RerankRequest(BaseModel):
    model_config = STRICT

    query: str
    documents: list[str | RerankDocument]
    model: str | None = None
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    instruction: str | None = None  # a reranker template's {instruction}
    user: str | None = None
    priority: int = 0
    keep_alive: str | int | float | None = None  # how long the model stays loaded (llmctl/server/model_manager.py)


class ScoreRequest(BaseModel):
    model_config = STRICT

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    instruction: str | None = None
    user: str | None = None
    priority: int = 0
    keep_alive: str | int | float | None = None  # how long the model stays loaded (llmctl/server/model_manager.py)


def _request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _usage(generation: Generation) -> dict[str, int]:
    prompt = sum(len(out.prompt_token_ids) for out in generation.final.values())
    return {"prompt_tokens": prompt, "total_tokens": prompt}


class PoolingServing:
    """The pooling endpoints over ``OpenAIServing``'s checks, batching and disconnect handling."""

    def __init__(self, serving: OpenAIServing, settings: PoolingSettings, hidden_size: int) -> None:
        self.serving = serving
        self.settings = settings
        self.hidden_size = hidden_size

    # ---- inputs ----------------------------------------------------------------------------------
    def _encode(self, text: str, param: str, index: int | None = None) -> list[int]:
        where = param if index is None else f"{param}[{index}]"
        if not text:
            raise bad_request(f"{where} is an empty string", param)
        return self._check_length(self.serving.tokenizer.encode(text), where, param)

    def _check_length(self, ids: list[int], where: str, param: str) -> list[int]:
        limit = self.serving.max_model_len
        if len(ids) > limit:
            raise bad_request(
                f"{where} is {len(ids)} tokens; this model's maximum context length is {limit} tokens", param
            )
        return ids

    def _inputs(self, body: EmbeddingRequest) -> list[list[int]]:
        value = body.input
        if isinstance(value, str):
            return [self._encode(value, "input")]
        if not value:
            raise bad_request("input is an empty list", "input")
        if isinstance(value[0], str):
            return [self._encode(text, "input", i) for i, text in enumerate(value)]
        lists = [value] if isinstance(value[0], int) else value
        vocab = self.serving.vocab_size
        for i, ids in enumerate(lists):
            where = "input" if lists is not value else f"input[{i}]"
            if not ids:
                raise bad_request(f"{where} is an empty list of token ids", "input")
            if not all(0 <= t < vocab for t in ids):
                raise bad_request(f"{where}: token ids must be integers in [0, {vocab})", "input")
            self._check_length(ids, where, "input")
        return [list(ids) for ids in lists]

    def _dimensions(self, dimensions: int | None) -> int | None:
        if dimensions is None:
            return None
        allowed = self.settings.pooler.matryoshka_dimensions
        if allowed is None:
            raise bad_request(
                "this model is not marked Matryoshka (config.json is_matryoshka / matryoshka_dimensions, or "
                "llmctl serve --matryoshka): its embeddings cannot be shortened with dimensions",
                "dimensions",
            )
        if not 1 <= dimensions <= self.hidden_size or (allowed and dimensions not in allowed):
            sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {self.hidden_size}"
            raise bad_request(f"dimensions must be one of {sizes}, got {dimensions}", "dimensions")
        return dimensions

    async def _pool(
        self,
        request: Request,
        prompts: list[list[int]],
        params: PoolingParams,
        request_id: str,
        user: str | None,
        priority: int,
    ) -> Generation:
        """Run every prompt as one pooling request, batched by the engine; the finished generation."""
        done: list[Generation] = []
        response = await self.serving._run(
            request, prompts, params, request_id, user, lambda g: done.append(g) or {}, None, priority
        )
        if not done:  # the client left: _run answered 499 to nobody
            raise APIError(499, "the client closed the connection", code="client_disconnected")
        del response
        return done[0]

    # ---- /v1/embeddings --------------------------------------------------------------------------
    async def embeddings(self, body: EmbeddingRequest, request: Request) -> dict[str, Any]:
        self.serving.check_model(body.model)
        prompts = self._inputs(body)
        params = self.settings.pooler.params(self._dimensions(body.dimensions))
        generation = await self._pool(request, prompts, params, _request_id("embd"), body.user, body.priority)
        data = []
        for i in range(len(prompts)):
            vector = generation.final[i].pooled
            if body.encoding_format == "base64":
                embedding: Any = base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
            else:
                embedding = vector.tolist()
            data.append({"object": "embedding", "index": i, "embedding": embedding})
        return {"object": "list", "data": data, "model": self.serving.served_model_name, "usage": _usage(generation)}

    # ---- scoring -----------------------------------------------------------------------------------
    async def _scores(
        self,
        request: Request,
        pairs: list[tuple[str, str]],
        instruction: str | None,
        names: tuple[str, str],
        user: str | None,
        priority: int,
    ) -> tuple[list[float], dict[str, int]]:
        """One score per (query, document) pair, and the usage."""
        rerank = self.settings.rerank
        if rerank is not None:
            prompts = [
                self._check_length(
                    self.serving.tokenizer.encode(rerank.prompt(q, d, instruction)), f"{names[1]}[{i}]", names[1]
                )
                for i, (q, d) in enumerate(pairs)
            ]
            params = PoolingParams("last", normalize=False, logit_token_ids=list(rerank.token_ids))
            generation = await self._pool(request, prompts, params, _request_id("score"), user, priority)
            scores = []
            for i in range(len(prompts)):
                yes, no = generation.final[i].pooled.tolist()
                scores.append(1.0 / (1.0 + math.exp(no - yes)))  # softmax over (yes, no), yes's share
            return scores, _usage(generation)
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))  # each distinct text embedded once
        where = {text: i for i, text in enumerate(texts)}
        queries = {q for q, _ in pairs}
        prompts = [self._encode(text, names[0] if text in queries else names[1]) for text in texts]
        params = PoolingParams(self.settings.pooler.pooling, normalize=True)  # cosine: unit vectors
        generation = await self._pool(request, prompts, params, _request_id("score"), user, priority)
        vectors = [generation.final[i].pooled for i in range(len(texts))]
        scores = [float(vectors[where[q]] @ vectors[where[d]]) for q, d in pairs]
        return scores, _usage(generation)

    async def rerank(self, body: RerankRequest, request: Request) -> dict[str, Any]:
        self.serving.check_model(body.model)
        if not body.query:
            raise bad_request("query is an empty string", "query")
        documents = [d if isinstance(d, str) else d.text for d in body.documents]
        if not documents:
            raise bad_request("documents is an empty list", "documents")
        for i, document in enumerate(documents):
            if not document:
                raise bad_request(f"documents[{i}] is an empty string", "documents")
        pairs = [(body.query, d) for d in documents]
        scores, usage = await self._scores(
            request, pairs, body.instruction, ("query", "documents"), body.user, body.priority
        )
        order = sorted(range(len(documents)), key=lambda i: -scores[i])[: body.top_n or len(documents)]
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                result["document"] = {"text": documents[i]}
            results.append(result)
        return {
            "id": _request_id("rerank"),
            "model": self.serving.served_model_name,
            "usage": usage,
            "results": results,
        }

    async def score(self, body: ScoreRequest, request: Request) -> dict[str, Any]:
        self.serving.check_model(body.model)
        first = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        second = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        for name, texts in (("text_1", first), ("text_2", second)):
            if not texts:
                raise bad_request(f"{name} is an empty list", name)
            if not all(texts):
                raise bad_request(f"{name} holds an empty string", name)
        if len(first) == 1:
            first = first * len(second)
        if len(first) != len(second):
            raise bad_request(
                f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as text_2",
                "text_2",
            )
        pairs = list(zip(first, second, strict=True))
        scores, usage = await self._scores(
            request, pairs, body.instruction, ("text_1", "text_2"), body.user, body.priority
        )
        return {
            "id": _request_id("score"),
            "object": "list",
            "created": int(time.time()),
            "model": self.serving.served_model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": usage,
        }
