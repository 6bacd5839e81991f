"""Pooling requests: a prompt's prefill turned into one vector instead of a sampled token.

A pooling request (``PoolingParams``) is scheduled like any prompt, chunked prefill included, in
the same batches as generation requests. For its rows the runner computes no logits; it hands
each chunk's hidden states (the model's output: after the final norm) to ``pool_chunk``, which
keeps only what the pooling needs of them::

    scheduler ──> batch ──> model ──> hidden ──┬─ sampling rows ──> logits ──> sampler
                                               └─ pooling chunks ─> pool_chunk ──> Pooler.collect
                                                                                      │
                       Scheduler.update_from_output: prefill complete -> finish, blocks back
                       OutputProcessor: RequestOutput.pooled (the vector) <───────────┘

What a chunk keeps: ``mean`` the sum of its rows (fp32), ``cls`` its first row when it starts the
prompt, ``last`` its last row when it ends the prompt, and with ``logit_token_ids`` the logits of
those ids at the prompt's last position (the LM head run on that one row). ``Pooler`` adds the
chunks of a sequence up and, when its prompt is complete, divides (mean), truncates to
``dimensions`` and L2-normalizes as asked. A chunk that starts at position 0 starts over, so a
sequence preempted mid-prefill (and recomputed from the start) is pooled once. Mean and cls
pooling take no prefix-cache hit (the skipped positions' hidden states would be missing); last
pooling does, since the last position is always computed.

``PoolerConfig`` is the model's default pooling: read from a sentence-transformers layout
(``modules.json``, ``1_Pooling/config.json``, a ``Normalize`` module) when there is one, else
last-token pooling with L2 normalization (what vLLM does for a decoder-only embedding model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from llmctl.pooling_params import POOLING_TYPES, PoolingParams

if TYPE_CHECKING:
    from collections.abc import Callable

    from llmctl.engine.scheduler import ScheduledSeq
    from llmctl.engine.sequence import Sequence


@dataclass
class PooledChunk:
    """What one prefill chunk of a pooling sequence contributes (positions ``[start, end)``)."""

    seq: Sequence
    start: int
    end: int
    value: torch.Tensor | None  # float32; None: nothing of this chunk is needed


def pool_chunk(
    item: ScheduledSeq, rows: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> PooledChunk:
    """``rows``: the chunk's hidden states, one row per position it computed."""
    seq, params = item.seq, item.seq.pooling
    start = seq.num_computed_tokens
    end = start + item.num_new_tokens
    value = None
    if params.pooling == "mean":
        value = rows.float().sum(dim=0)
    elif params.pooling == "cls":
        value = rows[0].float() if start == 0 else None
    elif end == seq.num_tokens:  # last
        if params.logit_token_ids is not None:
            ids = torch.tensor(params.logit_token_ids, device=rows.device)
            value = compute_logits(rows[-1:]).float()[0, ids]
        else:
            value = rows[-1].float()
    return PooledChunk(seq, start, end, None if value is None else value.clone())


@dataclass
class _Partial:
    value: torch.Tensor | None = None


class Pooler:
    """Adds each pooling sequence's chunks up across steps; hands back the finished vectors."""

    def __init__(self) -> None:
        self._partial: dict[int, _Partial] = {}  # by seq_id, while its prefill runs

    def collect(self, chunks: list[PooledChunk]) -> dict[int, torch.Tensor]:
        """The vectors (float32, on the CPU) of the sequences whose prompt these chunks complete, by seq_id."""
        done: dict[int, torch.Tensor] = {}
        for chunk in chunks:
            seq_id = chunk.seq.seq_id
            if chunk.start == 0:  # a first chunk, or a recompute from the start after a preemption
                self._partial.pop(seq_id, None)
            partial = self._partial.setdefault(seq_id, _Partial())
            if chunk.value is not None:
                partial.value = chunk.value if partial.value is None else partial.value + chunk.value
            if chunk.end == chunk.seq.num_tokens:
                del self._partial[seq_id]
                done[seq_id] = finish_vector(partial.value, chunk.seq.pooling, chunk.seq.num_tokens)
        return done

    def discard(self, seq_id: int) -> None:
        """An aborted sequence's partial sums go."""
        self._partial.pop(seq_id, None)

    @property
    def num_partial(self) -> int:
        return len(self._partial)


def finish_vector(value: torch.Tensor, params: PoolingParams, num_tokens: int) -> torch.Tensor:
    if params.logit_token_ids is None:
        if params.pooling == "mean":
            value = value / num_tokens
        if params.dimensions is not None:
            value = value[: params.dimensions]
        if params.normalize:
            value = torch.nn.functional.normalize(value, p=2, dim=-1)  # sentence-transformers' Normalize
    return value.cpu()


# ---- the model's default pooling ------------------------------------------------------------------
ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
ST_NAMES = {"lasttoken": "last", "mean": "mean", "cls": "cls"}


@dataclass(frozen=True)
class PoolerConfig:
    """How this server pools by default, and where that came from (for the start-up line)."""

    pooling: str = "last"
    normalize: bool = True
    source: str = "default for a decoder-only model"
    # Matryoshka: None: a request's ``dimensions`` is refused; [] any size up to the hidden size;
    # else the sizes the model was trained for
    matryoshka_dimensions: list[int] | None = field(default=None)

    def params(self, dimensions: int | None = None) -> PoolingParams:
        return PoolingParams(self.pooling, self.normalize, dimensions)

    @property
    def description(self) -> str:
        return f"pooling {self.pooling}{', normalized' if self.normalize else ''} ({self.source})"


def read_sentence_transformers(model_dir: Path) -> tuple[str, bool] | None:
    """(pooling, normalize) from a sentence-transformers directory, or None when it is not one.
    Raises ValueError for a pooling mode llmctl does not run (max, weighted mean, ...) and for a
    module other than Transformer, Pooling and Normalize (a ``Dense`` projection: decoder embedders
    such as Qwen3-Embedding and gte-Qwen2 have none)."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return None
    modules: list[dict[str, Any]] = json.loads(modules_file.read_text())
    pooling = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith("models.Pooling") or kind.endswith(".Pooling"):
            config = json.loads((model_dir / module.get("path", "") / "config.json").read_text())
            if isinstance(config.get("pooling_mode"), str):  # sentence-transformers >= 6: one name
                on = [config["pooling_mode"]]
                modes = [ST_NAMES[on[0]]] if on[0] in ST_NAMES else []
            else:  # earlier: one boolean per mode
                on = sorted(key for key, value in config.items() if key.startswith("pooling_mode_") and value is True)
                modes = [ST_MODES[key] for key in on if key in ST_MODES]
            if len(on) != 1 or len(modes) != 1:
                raise ValueError(
                    f"{model_dir}: sentence-transformers pooling {on} is not one llmctl runs (lasttoken, mean or cls)"
                )
            pooling = modes[0]
        elif kind.endswith(".Normalize"):
            normalize = True
        elif not kind.endswith(".Transformer"):
            raise ValueError(f"{model_dir}: sentence-transformers module {kind} is not one llmctl runs")
    return None if pooling is None else (pooling, normalize)


def resolve_pooler_config(
    model_dir: Path | None,
    pooling: str | None = None,
    normalize: bool | None = None,
    matryoshka: bool | None = None,
) -> PoolerConfig:
    """The server's pooling: ``--pooling`` / ``--normalize`` when given, else the model's
    sentence-transformers files, else last + normalize. Matryoshka ``dimensions`` are accepted when
    ``--matryoshka`` says so or the model's config.json has ``is_matryoshka`` or
    ``matryoshka_dimensions`` (vLLM's fields)."""
    if pooling is not None and pooling not in POOLING_TYPES:
        raise ValueError(f"--pooling {pooling}: choose from {', '.join(POOLING_TYPES)}")
    found = read_sentence_transformers(model_dir) if model_dir is not None and model_dir.is_dir() else None
    base_pooling, base_normalize, source = "last", True, "default for a decoder-only model"
    if found is not None:
        (base_pooling, base_normalize), source = found, "sentence-transformers modules.json"
    if pooling is not None or normalize is not None:
        source = "--pooling/--normalize" if found is None else f"{source}, overridden by --pooling/--normalize"
    dims: list[int] | None = None
    config_file = model_dir / "config.json" if model_dir is not None else None
    if config_file is not None and config_file.is_file():
        cfg = json.loads(config_file.read_text())
        if cfg.get("matryoshka_dimensions"):
            dims = [int(d) for d in cfg["matryoshka_dimensions"]]
        elif cfg.get("is_matryoshka"):
            dims = []
    if matryoshka is not None:
        dims = (dims or []) if matryoshka else None
    return PoolerConfig(
        pooling if pooling is not None else base_pooling,
        normalize if normalize is not None else base_normalize,
        source,
        dims,
    )
