"""Turns each step's sampled tokens into per-request outputs: detokenization, stop strings,
hold-back, logprobs and ``RequestOutput`` building.

The scheduler has already appended the tokens and ended sequences on EOS, stop token ids,
``max_tokens`` and ``max_model_len``; what needs text happens here, as in vLLM's OutputProcessor. A
stop string ends a sequence from here: ``process`` hands it back for the engine to finish, with the
tokens to drop when the stop string came before the last of the tokens it got this step. The
sequences' tokens are the scheduler's: this module reads them and never edits them.

Faults are isolated per request: any exception while turning one request's tokens into output (a
detokenizer that raises, a stop-string or logprobs bug) finishes that request alone with finish
reason ``"error"`` and ``RequestOutput.error`` naming the cause; its sequences are handed back to
be finished (their blocks freed) and every other request goes on.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from llmctl.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmctl.engine.sampler import PromptLogprobs, SampleResult
from llmctl.engine.sequence import FinishReason, Sequence
from llmctl.pooling_params import PoolingParams
from llmctl.sampling_params import SamplingParams
from llmctl.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class SampleState:
    """Output state of one of a request's ``n`` samples: its text and how much was handed out."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    sent_chars: int = 0
    sent_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    ended: FinishReason | None = None  # ended here: a stop string (wins over "length") or an error
    stop_string: str | None = None
    # A stop string ended it with tokens of the same step after it: only this many of the sequence's
    # token ids count (prompt included), the rest were never generated.
    num_tokens_kept: int | None = None

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.ended or self.seq.finish_reason

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.token_ids[self.seq.num_prompt_tokens : self.num_tokens_kept]


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    user: str
    metrics: RequestMetrics
    samples: dict[int, SampleState] = field(default_factory=dict)  # by sample index
    prompt_logprobs: list[dict[int, float] | None] | None = None
    error: str | None = None
    pooling: PoolingParams | None = None  # a pooling request: no text, one vector
    pooled: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        if any(s.finish_reason is None for s in self.samples.values()):
            return False
        return self.error is not None or len(self.samples) == self.params.n

    def sequences(self) -> list[Sequence]:
        return [s.seq for s in self.samples.values()]


@dataclass(frozen=True)
class Truncation:
    """Keep only the first ``num_tokens`` token ids of ``seq``: a stop string ended it before the
    last of the tokens it got this step (speculative decoding), so those after it were never generated."""

    seq: Sequence
    num_tokens: int


@dataclass
class ProcessedStep:
    outputs: list[RequestOutput]
    to_finish: list[tuple[Sequence, FinishReason]]  # ended here (stop strings, errors): free their blocks
    truncations: list[Truncation] = field(default_factory=list)  # for the scheduler, before it finishes them


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(self, request: RequestState, seq: Sequence) -> None:
        if request.params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # nothing predicts the first prompt token
        self.requests[request.request_id] = request
        self._add_sample(request, seq)

    def abort(self, request_id: str) -> RequestState | None:
        return self.requests.pop(request_id, None)

    def _add_sample(self, request: RequestState, seq: Sequence) -> SampleState:
        detokenizer = None
        if self.tokenizer is not None and request.pooling is None:
            detokenizer = self.tokenizer.decode_stream(request.prompt_token_ids, request.params.skip_special_tokens)
        sample = request.samples[seq.index] = SampleState(seq, detokenizer)
        return sample

    # ---- a step ----------------------------------------------------------------------------------
    def process(
        self,
        seqs: list[Sequence],
        sampled: SampleResult,
        now: float,
        pooled: list[tuple[Sequence, torch.Tensor]] = (),
    ) -> ProcessedStep:
        """``seqs[i]`` just got ``sampled.token_ids[i]`` (already appended by the scheduler). A
        sequence that got several tokens this step (speculative decoding) fills consecutive rows,
        one per token it kept, in order. ``pooled``: pooling sequences whose prefill completed
        (the scheduler finished them) and their vectors."""
        touched: dict[str, RequestState] = {}
        for seq, vector in pooled:
            request = self.requests[seq.request_id]
            request.pooled = vector
            touched[request.request_id] = request
        for chunk in sampled.prompt_logprobs:
            request = self.requests[chunk.seq.request_id]
            self._guarded(request, touched, self._add_prompt_logprobs, request, chunk)
        later = [0] * len(seqs)  # rows of the same sequence after row i
        for i in range(len(seqs) - 2, -1, -1):
            later[i] = later[i + 1] + 1 if seqs[i + 1] is seqs[i] else 0
        for i, seq in enumerate(seqs):
            request = self.requests[seq.request_id]
            touched[request.request_id] = request
            self._guarded(request, touched, self._add_token, request, seq, i, later[i], sampled, now)
        outputs, to_finish, truncations = [], [], []
        for request in touched.values():
            output = self._output(request)
            for sample in request.samples.values():
                seq, kept = sample.seq, sample.num_tokens_kept
                if kept is not None and len(seq.token_ids) > kept:
                    truncations.append(Truncation(seq, kept))
                if sample.ended and not seq.is_finished:
                    to_finish.append((seq, sample.ended))
            if output.finished:
                request.metrics.finished_time = output.metrics.finished_time = now
                del self.requests[request.request_id]
            outputs.append(output)
        return ProcessedStep(outputs, to_finish, truncations)

    def _guarded(self, request: RequestState, touched: dict[str, RequestState], work, *args) -> None:
        if request.error is not None:
            return
        try:
            work(*args)
        except Exception as exc:  # noqa: BLE001 - whatever it is, it ends this request only
            self._fail(request, exc)
            touched[request.request_id] = request

    def _fail(self, request: RequestState, exc: Exception) -> None:
        logger.warning("request %s failed while building its output", request.request_id, exc_info=exc)
        request.error = f"could not turn the generated tokens into output: {type(exc).__name__}: {exc}"
        for sample in request.samples.values():
            if sample.finish_reason is None:
                sample.ended = FinishReason.ERROR

    def _add_prompt_logprobs(self, request: RequestState, chunk: PromptLogprobs) -> None:
        """A recomputed chunk (after a preemption) repeats positions already held: keep the first."""
        held = request.prompt_logprobs
        assert held is not None, "prompt logprobs for a request that did not ask for them"
        skip = len(held) - chunk.first_index
        if skip >= 0:
            held.extend(chunk.logprobs[skip:])

    def _add_token(
        self, request: RequestState, seq: Sequence, row: int, later: int, sampled: SampleResult, now: float
    ) -> None:
        metrics = request.metrics
        if metrics.last_token_time != now:  # the request's first token this step
            metrics.previous_token_time, metrics.last_token_time = metrics.last_token_time, now
            if metrics.first_token_time is None:
                metrics.first_token_time = now
        sample = request.samples.get(seq.index) or self._add_sample(request, seq)
        if sample.ended is not None:  # a stop string ended it at an earlier token of this step
            return
        if sampled.logprobs is not None and seq.params.logprobs is not None:
            sample.logprobs.append(sampled.logprobs[row])
            sample.top_logprobs.append(sampled.top_logprobs[row])
        if sample.detokenizer is not None:
            self._add_text(sample, seq, later)

    @staticmethod
    def _add_text(sample: SampleState, seq: Sequence, later: int) -> None:
        """EOS or a stop token id ends the text before itself; a sequence that ended flushes what
        the detokenizer held back, and then its final text is checked for stop strings. ``later``:
        how many of the sequence's tokens this step follow this one (a stop string found here
        drops them, as if they had never been generated)."""
        previous = len(sample.text)
        last = later == 0
        stopped_by_token = last and seq.finish_reason is FinishReason.STOP
        if not stopped_by_token:
            sample.text += sample.detokenizer.step(seq.token_ids[-1 - later])
        if last and seq.is_finished:
            sample.text += sample.detokenizer.flush()
        if seq.params.stop and not stopped_by_token:
            _check_stop_strings(sample, seq.params, previous)
            if sample.ended is not None and later:
                sample.num_tokens_kept = len(seq.token_ids) - later

    # ---- outputs ---------------------------------------------------------------------------------
    def _output(self, request: RequestState) -> RequestOutput:
        if request.error is None:
            try:
                return self._make_output(request)
            except Exception as exc:  # noqa: BLE001 - as in _guarded
                self._fail(request, exc)
        return self._error_output(request)

    def _make_output(self, request: RequestState) -> RequestOutput:
        outputs = []
        for index in sorted(request.samples):
            sample = request.samples[index]
            seq, reason = sample.seq, sample.finish_reason
            holdback = 0 if reason is not None or not seq.params.stop else max(len(s) for s in seq.params.stop) - 1
            visible = max(sample.sent_chars, len(sample.text) - holdback)
            delta_text = sample.text[sample.sent_chars : visible]
            sample.sent_chars = visible
            out_ids = sample.output_token_ids
            delta_ids = out_ids[sample.sent_tokens :]
            sample.sent_tokens = len(out_ids)
            want_logprobs = seq.params.logprobs is not None
            outputs.append(
                CompletionOutput(
                    index=index,
                    text=sample.text[:visible],
                    token_ids=list(out_ids),
                    finish_reason=None if reason is None else reason.value,
                    stop_reason=sample.stop_string if sample.stop_string is not None else seq.stop_reason,
                    delta_text=delta_text,
                    delta_token_ids=delta_ids,
                    logprobs=list(sample.logprobs) if want_logprobs else None,
                    top_logprobs=list(sample.top_logprobs) if want_logprobs else None,
                )
            )
        return self._request_output(request, outputs)

    def _error_output(self, request: RequestState) -> RequestOutput:
        """What is known to be good: the text already handed out, the tokens, the error."""
        outputs = [
            CompletionOutput(
                index=index,
                text=sample.text[: sample.sent_chars],
                token_ids=list(sample.output_token_ids),
                finish_reason=(sample.finish_reason or FinishReason.ERROR).value,
            )
            for index, sample in sorted(request.samples.items())
        ]
        return self._request_output(request, outputs)

    @staticmethod
    def _request_output(request: RequestState, outputs: list[CompletionOutput]) -> RequestOutput:
        first = request.samples[min(request.samples)].seq
        prompt_logprobs = request.prompt_logprobs
        complete = prompt_logprobs is not None and len(prompt_logprobs) == len(request.prompt_token_ids)
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics=dataclasses.replace(request.metrics),  # a snapshot: the processor keeps updating its own
            user=request.user,
            error=request.error,
            prompt_logprobs=list(prompt_logprobs) if complete else None,
            pooled=request.pooled,
        )


def _check_stop_strings(sample: SampleState, params: SamplingParams, previous_len: int) -> None:
    """Find the earliest stop string that the new text completes, and cut the text there."""
    start = max(0, previous_len - max(len(s) for s in params.stop) + 1)
    found = [(i, stop) for stop in params.stop if (i := sample.text.find(stop, start)) != -1]
    if not found:
        return
    index, stop = min(found)
    sample.text = sample.text[: index + len(stop) if params.include_stop_str_in_output else index]
    sample.ended, sample.stop_string = FinishReason.STOP, stop
