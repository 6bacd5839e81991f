"""``llmctl perplexity MODEL --text FILE``: how well a model predicts a text, so that the quality
of a quantization or a model is measured, not assumed.

The file is tokenized once (with the tokenizer's BOS at the start of the file only) and cut into
windows of at most ``--window`` tokens (default: max_model_len - 1, leaving the engine room for the
one token it must sample). Windows start every ``--stride`` tokens (default: window - 1). A
window's first token has no context inside it and is never scored, and a window scores only the
tokens no earlier window did; so the default, where each window starts on the previous one's last
token, scores every token but the file's first exactly once. A smaller stride gives the later
tokens more context (the sliding-window method of Hugging Face's perplexity guide); stride =
window leaves each window's first token unscored. Each window runs through
the engine with ``prompt_logprobs=0``; perplexity = exp(mean negative log-likelihood)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from llmctl.cli_options import (
    BATCHING,
    KV,
    MODEL,
    PARALLEL,
    QUANTIZATION,
    ModelArg,
    config_for_model,
    engine_options,
    exit_on_error,
)
from llmctl.config import EngineConfig
from llmctl.errors import InvalidRequestError


@dataclass(frozen=True)
class Window:
    """Tokens ``start:start + len(token_ids)`` of the text; positions ``>= first_scored`` count."""

    token_ids: list[int]
    first_scored: int


@dataclass(frozen=True)
class PerplexityResult:
    perplexity: float
    mean_nll: float
    scored_tokens: int
    text_tokens: int
    windows: int
    window: int
    stride: int


def windows(token_ids: list[int], window: int, stride: int) -> list[Window]:
    """The windows covering ``token_ids``; no token is scored twice."""
    if window < 2 or not 1 <= stride <= window:
        raise InvalidRequestError(f"need window >= 2 and 1 <= stride <= window, got window={window}, stride={stride}")
    result, scored_until = [], 1  # token 0 has no context anywhere
    for start in range(0, max(len(token_ids) - 1, 1), stride):
        chunk = token_ids[start : start + window]
        if len(chunk) < 2 or start + len(chunk) <= scored_until:
            break
        result.append(Window(chunk, max(scored_until - start, 1)))
        scored_until = start + len(chunk)
    return result


def window_nll(window: Window, prompt_logprobs: list[dict[int, float] | None]) -> list[float]:
    """Negative log-likelihoods of the window's scored tokens."""
    return [-prompt_logprobs[i][window.token_ids[i]] for i in range(window.first_scored, len(window.token_ids))]


def perplexity(
    engine, token_ids: list[int], window: int, stride: int, progress: Progress | None = None
) -> PerplexityResult:
    """Score ``token_ids`` window by window; all windows are queued at once (continuous batching)."""
    from llmctl.sampling_params import SamplingParams

    todo = windows(token_ids, window, stride)
    if not todo:
        raise InvalidRequestError("the text is too short: it needs at least 2 tokens")
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    by_id = {engine.add_request(w.token_ids, params): w for w in todo}
    task = progress.add_task("scoring", total=sum(len(w.token_ids) for w in todo)) if progress else None
    nll: list[float] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                if out.prompt_logprobs is None:
                    reason = out.error or out.outputs[0].finish_reason
                    raise InvalidRequestError(f"window {out.request_id} failed: {reason}")
                nll.extend(window_nll(by_id[out.request_id], out.prompt_logprobs))
                if progress is not None:
                    progress.advance(task, len(out.prompt_token_ids))
    mean = math.fsum(nll) / len(nll)
    return PerplexityResult(
        perplexity=math.exp(mean),
        mean_nll=mean,
        scored_tokens=len(nll),
        text_tokens=len(token_ids),
        windows=len(todo),
        window=window,
        stride=stride,
    )


def register_commands(app: typer.Typer) -> None:
    app.command(name="perplexity")(perplexity_command)


# scoring samples nothing and renders no chat: no speculative decoding, seed or chat template
@engine_options(groups=(MODEL, BATCHING, KV, QUANTIZATION, PARALLEL), exclude=("chat_template",))
def perplexity_command(
    model: ModelArg,
    text: Annotated[Path, typer.Option("--text", help="UTF-8 text file to score.")],
    window: Annotated[
        int | None, typer.Option("--window", help="Tokens per window (default: max_model_len - 1).")
    ] = None,
    stride: Annotated[
        int | None,
        typer.Option(
            "--stride", help="Tokens between window starts (default: window - 1, so windows share one token)."
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as one JSON object.")] = False,
    *,
    engine_config: EngineConfig,
) -> None:
    """Perplexity of MODEL on a text file: exp of the mean negative log-likelihood of its tokens."""
    from llmctl.engine.llm_engine import LLMEngine

    err = Console(stderr=True, soft_wrap=True)
    with exit_on_error(err):
        try:
            content = text.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidRequestError(f"cannot read {text}: {exc.strerror or exc}") from None
        engine = LLMEngine(config_for_model(engine_config, model))
        if engine.tokenizer is None:
            raise InvalidRequestError(f"{model} has no tokenizer; perplexity needs one to tokenize {text}")
        token_ids = engine.tokenizer.encode(content)
        size = window or engine.max_model_len - 1
        if size > engine.max_model_len - 1:
            raise InvalidRequestError(
                f"--window {size} is too long: at most max_model_len - 1 = "
                f"{engine.max_model_len - 1} tokens (the engine samples one more)"
            )
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("tokens"),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=err, transient=True) as progress:
            result = perplexity(engine, token_ids, size, stride or size - 1, progress)
    if as_json:
        print(json.dumps({"model": model, "text": str(text), **asdict(result)}))
    else:
        print(
            f"perplexity {result.perplexity:.4f} · mean NLL {result.mean_nll:.5f} · "
            f"{result.scored_tokens} tokens scored of {result.text_tokens} · "
            f"{result.windows} windows of {result.window} (stride {result.stride})"
        )
