"""The engine loop: ``add_request`` queues work, every ``step`` runs one scheduler decision through
the model and the sampler and returns what each request produced.

    add_request ──> Scheduler.waiting
                       │ schedule(): decodes, prefill chunks, admissions, preemption
                       v
                 SchedulerOutput ──> ModelRunner.execute ──> logits ──> Sampler ──> tokens
                                                                                      │
    RequestOutput <── detokenize, stop checks, finish (blocks freed) <────────────────┘
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmctl.config import EngineConfig, resolve_kv_cache_bytes
from llmctl.engine.block_manager import BlockManager
from llmctl.engine.latency import LatencyWindow
from llmctl.engine.model_runner import ModelRunner, kv_block_bytes
from llmctl.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from llmctl.engine.sampler import Sampler
from llmctl.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from llmctl.engine.sequence import FinishReason, Sequence
from llmctl.engine.stats import engine_snapshot
from llmctl.errors import ConfigError, InvalidRequestError, ModelLoadError
from llmctl.layers.ops import select_ops
from llmctl.models.embedded import EMBEDDED_LABEL, EMBEDDED_MODEL_NAME, load_embedded
from llmctl.models.gguf_files import resolve_gguf_spec
from llmctl.models.loader import load_model
from llmctl.sampling_params import SamplingParams
from llmctl.tokenizer import IncrementalDetokenizer, Tokenizer

STEP_HISTORY = 512


@dataclass(eq=False)
class _SampleText:
    """Text state of one sequence: what was decoded, and how much of it was already handed out."""

    detokenizer: IncrementalDetokenizer | None
    text: str = ""
    sent_chars: int = 0
    sent_tokens: int = 0
    stop_reason: str | int | None = None


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    user: str
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    texts: dict[int, _SampleText] = field(default_factory=dict)  # by sample index

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs)


@dataclass
class StepRecord:
    step: int
    time: float
    duration_s: float
    prefill_tokens: int
    decode_tokens: int
    num_seqs: int
    num_running: int
    num_waiting: int
    num_preempted: int


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        config = config or EngineConfig(**overrides)
        self.config = config
        self.device = config.resolve_device()
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        self.ops = select_ops(config.attention_backend, self.device)
        self.model, self.tokenizer, self.model_label = self._load(config, self.ops)
        cfg = self.model.config
        self.dtype = self.model.model.norm.weight.dtype  # activations; a packed (GGUF) model has int8 parameters first

        block_bytes = kv_block_bytes(self.model, config.block_size, self.dtype)
        num_blocks = resolve_kv_cache_bytes(config, self.device) // block_bytes
        capacity = num_blocks * config.block_size
        model_limit = cfg.max_position_embeddings
        if cfg.sliding_window:  # attention here is full-context; stay inside the window where both agree
            model_limit = min(model_limit, cfg.sliding_window)
        if config.max_model_len is None:
            max_model_len = min(model_limit, capacity)
        else:
            max_model_len = config.max_model_len
            if max_model_len > model_limit:
                raise ConfigError(f"max_model_len {max_model_len} exceeds the model's limit {model_limit}")
        if max_model_len > capacity or num_blocks < 1:
            raise ConfigError(
                f"the KV cache ({num_blocks} blocks of {config.block_size} tokens) cannot hold one sequence of "
                f"max_model_len={max_model_len} tokens: raise --kv-cache-memory or lower --max-model-len"
            )
        self.max_model_len = max_model_len
        self.runner = ModelRunner(self.model, num_blocks=num_blocks, block_size=config.block_size,
                                  device=self.device, kv_dtype=self.dtype)
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        budget = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:  # every prompt must fit one step whole
            budget = max(budget, max_model_len)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, budget, config.enable_chunked_prefill), self.block_manager
        )
        self.sampler = Sampler(config.seed, self.device)
        self.eos_token_ids: set[int] = set(cfg.eos_token_ids)
        if self.tokenizer is not None:
            self.eos_token_ids |= self.tokenizer.eos_token_ids
        self.requests: dict[str, _Request] = {}
        self._request_counter = itertools.count()
        self.step_count = 0
        self.step_history: deque[StepRecord] = deque(maxlen=STEP_HISTORY)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.requests_added_total = 0
        self.finished_requests: dict[str, int] = {r.value: 0 for r in FinishReason}
        self.start_time = time.time()
        self.latency = LatencyWindow()  # TTFT / TPOT / E2E of recently finished requests
        # Called after every step that ran, in the engine's thread: (outputs, the step's record).
        self.step_listeners: list[Callable[[list[RequestOutput], StepRecord], None]] = []

    @staticmethod
    def _load(config: EngineConfig, ops: Any) -> tuple[Any, Tokenizer | None, str]:
        device = config.resolve_device()
        if config.model == EMBEDDED_MODEL_NAME:
            model, tokenizer = load_embedded(dtype=config.dtype, device=device, ops=ops)
            return model, (None if config.skip_tokenizer else tokenizer), EMBEDDED_LABEL
        if (gguf_file := resolve_gguf_spec(config.model)) is not None:  # a .gguf file, a dir of one, a short name
            from llmctl.models.gguf import load_gguf

            model, tokenizer = load_gguf(gguf_file, dtype=config.dtype, device=device, ops=ops,
                                         with_tokenizer=not config.skip_tokenizer,
                                         quantization=getattr(config, "quantization", "none"))
            return model, tokenizer, config.model_name or str(config.model)
        model_dir = Path(config.model)
        if not model_dir.is_dir():
            raise ModelLoadError(
                f"{config.model}: no such model directory (use a local folder with config.json and "
                f"*.safetensors, a pulled hub id, or the embedded default {EMBEDDED_MODEL_NAME!r})"
            )
        model = load_model(model_dir, dtype=config.dtype, device=device, ops=ops)
        tokenizer = None if config.skip_tokenizer else Tokenizer.from_dir(Path(config.tokenizer or model_dir))
        return model, tokenizer, config.model_name or str(config.model)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        user: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request; raises ``InvalidRequestError`` (allocating nothing) when it
        can never run."""
        params = params or SamplingParams()
        params.validate()
        request_id = request_id or f"req-{next(self._request_counter)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this engine runs without one (use stop_token_ids)")
        token_ids, text = self._prompt_tokens(prompt)
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt is {len(token_ids)} tokens but max_model_len is {self.max_model_len} "
                "(it must leave room for at least one generated token)"
            )
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        now = time.time() if arrival_time is None else arrival_time
        request = _Request(request_id, text, token_ids, params, user or "default", RequestMetrics(now))
        seq = self._new_sequence(request, 0)
        seq.pending_forks = params.n - 1
        seq.priority = priority
        self.requests[request_id] = request
        self.prompt_tokens_total += len(token_ids)
        self.requests_added_total += 1
        self.scheduler.add(seq)
        return request_id

    def _prompt_tokens(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            if self.tokenizer is None:
                raise InvalidRequestError("this engine runs without a tokenizer: send token ids")
            return self.tokenizer.encode(prompt), prompt
        token_ids = list(prompt)
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        vocab = self.model.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        return token_ids, None

    def _new_sequence(self, request: _Request, index: int) -> Sequence:
        seq = Sequence(
            request_id=request.request_id,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            params=request.params,
            user=request.user,
            arrival_time=request.metrics.arrival_time,
            index=index,
        )
        seed = request.params.sample_seed(index)
        if seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seed)
        detok = None
        if self.tokenizer is not None:
            detok = self.tokenizer.decode_stream(request.prompt_token_ids, request.params.skip_special_tokens)
        request.seqs.append(seq)
        request.texts[index] = _SampleText(detok)
        return seq

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks go back at once. False if it is unknown/finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        now = time.time()
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)
        request.metrics.finished_time = now
        self.finished_requests[FinishReason.ABORT.value] += 1
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.time()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        for item in sched.scheduled:
            metrics = self.requests[item.seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = started
        sampling = [item.seq for item in sched.scheduled if item.samples]
        logits = self.runner.execute(sched)
        self.scheduler.complete_step(sched)

        rows = list(range(len(sampling)))
        for row, seq in enumerate(list(sampling)):
            if seq.pending_forks:
                children = self._fork(seq)
                sampling.extend(children)
                rows.extend([row] * len(children))
        if len(rows) > logits.shape[0]:
            logits = logits[torch.tensor(rows, device=logits.device)]
        result = self.sampler(logits, sampling)

        now = time.time()
        touched: dict[str, _Request] = {}
        for i, seq in enumerate(sampling):
            request = self.requests[seq.request_id]
            self._append_token(request, seq, result.token_ids[i], now)
            if result.logprobs is not None and seq.params.logprobs is not None:
                seq.logprobs.append(result.logprobs[i])
                seq.top_logprobs.append(result.top_logprobs[i])
            touched[request.request_id] = request
        outputs = [self._make_output(r) for r in touched.values()]
        for request in touched.values():
            if request.finished:
                del self.requests[request.request_id]
        record = self._record_step(sched, started)
        for out in outputs:
            self.latency.observe(out)
        for listener in self.step_listeners:
            listener(outputs, record)
        return outputs

    def _fork(self, parent: Sequence) -> list[Sequence]:
        request = self.requests[parent.request_id]
        children = [self._new_sequence(request, parent.index + k) for k in range(1, parent.pending_forks + 1)]
        for child in children:
            child.priority = parent.priority
        parent.pending_forks = 0
        self.scheduler.fork(parent, children)
        return children

    def _append_token(self, request: _Request, seq: Sequence, token: int, now: float) -> None:
        seq.token_ids.append(token)
        self.generation_tokens_total += 1
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        metrics.last_token_time = now
        params = seq.params
        state = request.texts[seq.index]
        reason: FinishReason | None = None
        if token in self.eos_token_ids and not params.ignore_eos:
            reason, state.stop_reason = FinishReason.STOP, None
        elif token in params.stop_token_ids:
            reason, state.stop_reason = FinishReason.STOP, token
        elif state.detokenizer is not None:
            previous = len(state.text)
            state.text += state.detokenizer.step(token)
            if params.stop:
                reason = self._check_stop_strings(state, params, previous)
        if reason is None and (seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = FinishReason.LENGTH
        if reason is not None:
            self.scheduler.finish(seq, reason)
            if request.finished:
                metrics.finished_time = now
                self.finished_requests[reason.value] += 1

    @staticmethod
    def _check_stop_strings(state: _SampleText, params: SamplingParams, previous_len: int) -> FinishReason | None:
        """Find the earliest stop string that the new text completes, and cut the text there."""
        start = max(0, previous_len - max(len(s) for s in params.stop) + 1)
        found = [(i, stop) for stop in params.stop if (i := state.text.find(stop, start)) != -1]
        if not found:
            return None
        index, stop = min(found)
        state.text = state.text[: index + len(stop) if params.include_stop_str_in_output else index]
        state.stop_reason = stop
        return FinishReason.STOP

    def _make_output(self, request: _Request) -> RequestOutput:
        outputs = []
        for seq in sorted(request.seqs, key=lambda s: s.index):
            state = request.texts[seq.index]
            finished = seq.is_finished
            holdback = 0 if finished or not seq.params.stop else max(len(s) for s in seq.params.stop) - 1
            visible = max(state.sent_chars, len(state.text) - holdback)
            delta_text = state.text[state.sent_chars:visible]
            state.sent_chars = visible
            out_ids = seq.output_token_ids
            delta_ids = out_ids[state.sent_tokens:]
            state.sent_tokens = len(out_ids)
            want_logprobs = seq.params.logprobs is not None
            outputs.append(CompletionOutput(
                index=seq.index,
                text=state.text[:visible],
                token_ids=list(out_ids),
                finish_reason=seq.finish_reason.value if finished else None,
                stop_reason=state.stop_reason,
                delta_text=delta_text,
                delta_token_ids=delta_ids,
                logprobs=list(seq.logprobs) if want_logprobs else None,
                top_logprobs=list(seq.top_logprobs) if want_logprobs else None,
            ))
        first = request.seqs[0]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.finished,
            num_cached_tokens=first.num_cached_tokens,
            metrics=dataclasses.replace(request.metrics),  # a snapshot: the engine keeps updating its own
            user=request.user,
        )

    def _record_step(self, sched: SchedulerOutput, started: float) -> StepRecord:
        self.step_count += 1
        record = StepRecord(
            step=self.step_count,
            time=started,
            duration_s=time.time() - started,
            prefill_tokens=sched.num_prefill_tokens,
            decode_tokens=sched.num_decode_tokens,
            num_seqs=len(sched.scheduled),
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            num_preempted=len(sched.preempted),
        )
        self.step_history.append(record)
        return record

    # ---- offline ------------------------------------------------------------------------------
    def generate(self, prompts: Iterable[str | list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in prompt order."""
        prompts = list(prompts)
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def live_sequences(self) -> list[Sequence]:
        return [s for r in self.requests.values() for s in r.seqs if not s.is_finished]

    def stats_snapshot(self, max_steps: int = 120) -> dict[str, Any]:
        return engine_snapshot(self, max_steps)
