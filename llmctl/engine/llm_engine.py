"""The engine loop: ``add_request`` queues work; every ``step`` is schedule -> execute -> sample ->
update -> process outputs, and returns what each request produced::

    add_request ──> Scheduler (waiting queues, block manager)
                       │ schedule(): decodes, prefill chunks, admissions, preemption, n > 1 forks
                       v
                 SchedulerOutput ──> ModelRunner.execute ──> logits ──> Sampler ──> token ids
                                                                                      │
                 Scheduler.update_from_output: computed K/V, append, EOS / stop ids /  <┘
                 max_tokens / max_model_len, finish and free
                       │
                 OutputProcessor.process: detokenize, stop strings, logprobs ──> RequestOutput
                 (a fault here ends its one request with finish_reason "error")
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from llmctl.config import QUANTIZED_AT_LOAD, EngineConfig, kv_pool_too_small, resolve_kv_cache_bytes
from llmctl.engine.block_manager import BlockManager, blocks_per_seq
from llmctl.engine.host_malloc import keep_large_allocations
from llmctl.engine.logits_processors import bad_words_token_ids
from llmctl.engine.model_runner import ModelOutput, ModelRunner, kv_format, kv_groups, paged_format
from llmctl.engine.output_processor import OutputProcessor, RequestState
from llmctl.engine.outputs import RequestMetrics, RequestOutput
from llmctl.engine.pooler import Pooler
from llmctl.engine.sampler import Sampler
from llmctl.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from llmctl.engine.sequence import FinishReason, Sequence
from llmctl.engine.stats import EngineCounters, EngineStats, Speculation
from llmctl.errors import ConfigError, InvalidRequestError, ModelLoadError
from llmctl.layers.backends import build_ops
from llmctl.layers.mla import LatentAttention
from llmctl.layers.moe import StackedExperts, expert_stats
from llmctl.lora.adapter import LoRAAdapter, LoRAAdapterError
from llmctl.lora.manager import LoRAManager
from llmctl.models.embedded import EMBEDDED_LABEL, EMBEDDED_MODEL_NAME, load_embedded
from llmctl.models.gguf_files import resolve_gguf_spec
from llmctl.models.loader import load_model
from llmctl.platform import select_kernels
from llmctl.pooling_params import PoolingParams
from llmctl.sampling_params import SamplingParams
from llmctl.spec.speculator import NGRAM, build_speculator
from llmctl.structured import CompiledGrammar, StructuredOutputManager
from llmctl.tokenizer import Tokenizer, read_chat_template


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        config = config or EngineConfig(**overrides)
        self.config = config
        self.device = config.resolve_device()
        if self.device.type == "cpu":
            keep_large_allocations()
            if config.num_threads:
                torch.set_num_threads(config.num_threads)
        self.kernels = select_kernels(
            config.kernel_backend,
            self.device,  # every kernel choice: llmctl/platform.py
            quant_exact_activations=config.quant_exact_activations,
        )
        self.ops = build_ops(self.kernels)
        self.parallel = None  # rank 0 of a torchrun job: this engine drives the other ranks (llmctl.parallel)
        if config.world_size > 1:
            from llmctl.parallel.driver import start_parallel

            self.parallel = start_parallel(config)
        try:
            self._assemble(config)
        except Exception as exc:
            if self.parallel is None:
                raise
            from llmctl.parallel.watchdog import fatal

            # the other ranks wait in a start-up collective this rank will not join: end now with the
            # reason, and torchrun's agent stops them (a raised error would hang them and this rank)
            fatal(f"rank 0 could not start the engine: {exc}")

    def _assemble(self, config: EngineConfig) -> None:
        """Everything after the process group: the model, the tokenizer, the pool and the scheduler."""
        self.model, self.tokenizer, self.model_label = self._load(
            config, self.ops, self.parallel.shard_kwargs() if self.parallel else {}
        )
        if config.chat_template and self.tokenizer is not None:
            self.tokenizer.chat_template = read_chat_template(config.chat_template)
        self.dtype = self.model.model.norm.weight.dtype  # the activation/KV dtype (weights may be packed)
        self.kv_format = kv_format(
            self.model,
            config.block_size,
            self.dtype,
            config.kv_cache_dtype,
            config.kv_quant_group_size,
            config.kv_residual_length,
        )
        # KV-cache groups: one of every layer, or full attention and each sliding window apart
        self.kv_groups = kv_groups(self.model)
        self._check_kv_groups()
        num_blocks, num_residual, self.max_model_len = self._size_kv_pool()
        self.lora = self._build_lora()  # None: this engine serves no LoRA adapters
        self.runner = ModelRunner(
            self.model,
            num_blocks=num_blocks,
            block_size=config.block_size,
            device=self.device,
            kv_dtype=self.dtype,
            kv_format=self.kv_format,
            num_residual_slots=num_residual,
            groups=self.kv_groups,
            lora=self.lora,
        )
        if self.parallel is not None:
            from llmctl.parallel.driver import ParallelRunner

            self.runner = ParallelRunner(self.parallel, self.runner)
        budget = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:  # every prompt must fit one step whole
            budget = max(budget, self.max_model_len)
        eos_token_ids = set(self.model.config.eos_token_ids)
        if self.tokenizer is not None:
            eos_token_ids |= self.tokenizer.eos_token_ids
        self.eos_token_ids = frozenset(eos_token_ids)
        # Each collaborator gets what it works with when it is built, in the order they need each
        # other: the pool's block manager, the sampler, the speculator, then the scheduler.
        quantized_kv = getattr(self.runner, "quantized_kv", None)
        # a model whose cached keys depend on more than the prefix (Phi-3's LongRoPE) says why not
        self.prefix_caching_why_not = getattr(self.model, "prefix_caching_why_not", None)
        prefix_caching = config.enable_prefix_caching and self.prefix_caching_why_not is None
        block_manager = BlockManager(
            num_blocks,
            config.block_size,
            prefix_caching,
            config.kv_cache_dtype,
            on_release=quantized_kv.release if quantized_kv is not None else None,
            cache_group=max(1, self.kv_format.residual_blocks_per_seq()) if quantized_kv is not None else 1,
            group_windows=[group.window for group in self.kv_groups],
        )
        # The grammar engine for this model's vocabulary (it reads the vocabulary on first use).
        self._structured_outputs = (
            None
            if self.tokenizer is None
            else StructuredOutputManager.for_tokenizer(self.tokenizer, self.model.config.vocab_size)
        )
        self.sampler = Sampler(config.seed, self.device, self.eos_token_ids, self._structured_outputs)
        # --speculative-model (llmctl/spec/), else None
        self.speculator = build_speculator(
            config,
            self.sampler,
            block_manager,
            self.device,
            self.model.config.vocab_size,
            self.tokenizer,
            functools.partial(self._load, ops=self.ops, shard={}),
        )
        pipelined = self.parallel is not None and self.parallel.pp_size > 1 and self.speculator is None
        batches_in_flight = 1
        if pipelined:
            from llmctl.parallel.pipeline import batches_in_flight as pipeline_depth

            batches_in_flight = pipeline_depth(self.parallel.pp_size)
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_blocks=num_blocks,
                block_size=config.block_size,
                max_model_len=self.max_model_len,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=budget,
                enable_chunked_prefill=config.enable_chunked_prefill,
                enable_prefix_caching=prefix_caching,
                eos_token_ids=self.eos_token_ids,
                num_speculative_tokens=config.num_speculative_tokens if config.speculative_model else 0,
                kv_cache_dtype=config.kv_cache_dtype,
                batches_in_flight=batches_in_flight,
                max_loras=config.max_loras if self.lora is not None else 0,
            ),
            block_manager,
            propose_drafts=self.speculator.lookahead if self.speculator is not None else None,
        )
        self.pipeline = None  # pipeline parallelism: batches in flight across steps (llmctl.parallel.pipeline)
        if pipelined:
            from llmctl.parallel.pipeline import PipelinedSteps

            self.pipeline = PipelinedSteps(self.scheduler, self.runner)
        self.pooler = Pooler()  # pooling requests' sums across prefill chunks (llmctl/engine/pooler.py)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stats = EngineStats(
            self.scheduler,
            model=self.model_label,
            settings=self._settings(),
            speculation=self._speculation(),
            experts=functools.partial(expert_stats, self.model)
            if any(isinstance(module, StackedExperts) for module in self.model.modules())
            else None,
        )
        self._request_counter = itertools.count()

    def _build_lora(self) -> LoRAManager | None:
        """The LoRA slots and adapters (--enable-lora / --lora-modules); a bad adapter stops the start."""
        config = self.config
        if not config.lora_enabled:
            return None
        manager = LoRAManager(
            self.model,
            max_loras=config.max_loras,
            max_lora_rank=config.max_lora_rank,
            kernels=self.kernels,
            dtype=self.dtype,
        )
        for entry in config.lora_modules:
            name, sep, path = entry.partition("=")
            if not (sep and name and path):
                raise ConfigError(f"--lora-modules {entry!r}: expected NAME=PATH")
            try:
                manager.add(name, path)
            except LoRAAdapterError as e:
                raise ConfigError(str(e)) from None
        return manager

    def add_lora(self, name: str, path: str | Path) -> LoRAAdapter:
        """Load a PEFT adapter to serve as ``name``; raises ``LoRAAdapterError`` (nothing changed)."""
        return self._lora_manager().add(name, path)

    def remove_lora(self, name: str) -> None:
        """Stop serving adapter ``name``; its running requests finish with it."""
        self._lora_manager().remove(name)

    def lora_names(self) -> list[str]:
        return [] if self.lora is None else list(self.lora.adapters)

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (give it some: --lora-modules)")
        return self.lora

    def _settings(self) -> dict[str, Any]:
        """The stats snapshot's ``config`` section: what this engine runs with, fixed at start-up."""
        config, bm = self.config, self.scheduler.block_manager
        return {
            "block_size": bm.block_size,
            "num_blocks": bm.num_blocks,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": self.scheduler.config.max_num_batched_tokens,
            "max_model_len": self.max_model_len,
            "enable_prefix_caching": bm.enable_prefix_caching,
            "enable_chunked_prefill": config.enable_chunked_prefill,
            "dtype": str(self.dtype).replace("torch.", ""),
            "kv_cache_dtype": config.kv_cache_dtype,
            "kv_bytes_per_token": self.kv_format.bytes_per_token(),
            "kv_groups": [{"window": g.window, "layers": len(g.layers)} for g in self.kv_groups],
            "device": str(self.device),
            "attention_backend": getattr(self.ops, "description", self.ops.name),
        }

    def _speculation(self) -> Speculation | None:
        if self.speculator is None:
            return None
        return Speculation(self.speculator.method, self.config.num_speculative_tokens, self.speculator.counters)

    @property
    def dtype_description(self) -> str:
        """The dtype and, where it was chosen automatically, why (for start-up lines)."""
        name = str(self.dtype).removeprefix("torch.")
        choice = getattr(self.model.config, "dtype_choice", None)
        return f"{name} ({choice.reason})" if choice is not None and choice.reason else name

    @property
    def weights_description(self) -> str:
        """Weight bytes and, when they were quantized while loading, how (for start-up lines)."""
        from llmctl.layers.quantization import weight_bytes

        text = f"weights {weight_bytes(self.model) / 2**20:.1f} MiB"
        kind = self.config.quantization
        if kind in QUANTIZED_AT_LOAD and self.model_label != EMBEDDED_LABEL:
            text += f" {kind}" + (f" g{self.config.quantization_group_size}" if kind == "int4" else "")
            if self.config.calibration is not None:
                text += f" (GPTQ on {self.config.calibration})"
        return text

    @property
    def kv_description(self) -> str:
        """The KV cache dtype and its bytes per token (for start-up lines)."""
        name = self.config.kv_cache_dtype
        if name == "auto":
            name = f"auto ({str(self.dtype).removeprefix('torch.')})"
        off = "" if self.prefix_caching_why_not is None else f", no prefix caching ({self.prefix_caching_why_not})"
        mla = any(isinstance(layer, LatentAttention) for layer in self.model.attention_layers())
        latent = ", latent KV (MLA)" if mla else ""
        return f"KV {name}, {self.kv_format.bytes_per_token():g} B/token{latent}{off}"

    def _check_kv_groups(self) -> None:
        """Refuse what does not take several KV-cache groups (a model mixing full and sliding
        attention, or several windows) or a sliding group 0 (a draft model reads group 0)."""
        config, groups = self.config, self.kv_groups
        if len(groups) > 1 and self.parallel is not None and self.parallel.pp_size > 1:
            raise ConfigError(
                "pipeline parallelism does not take models mixing full and sliding-window attention "
                f"yet ({len(groups)} KV-cache groups); use --tensor-parallel-size alone"
            )
        if len(groups) > 1 and self.kv_format.is_kivi:
            raise ConfigError(
                f"--kv-cache-dtype {config.kv_cache_dtype} does not take models mixing full and "
                "sliding-window attention yet; use fp8_e4m3, fp8_e5m2, int8 or auto"
            )
        if config.speculative_model not in (None, NGRAM) and groups[0].window is not None:
            raise ConfigError(
                "a draft model reads the target's full-attention block tables, and every layer of "
                "this model has a sliding window: use --speculative-model ngram"
            )

    def _size_kv_pool(self) -> tuple[int, int, int]:
        """(KV blocks, KIVI residual slots, max_model_len): the pool from the memory budget, the
        length from the model's limit, capped by what the pool can hold. With several KV-cache
        groups a block holds the layers of one group (``model_runner.kv_groups``), and a sequence
        of L tokens holds ``blocks_per_seq`` of them at most."""
        config, cfg = self.config, self.model.config
        pool_bytes = resolve_kv_cache_bytes(config, self.device)
        pool_format = self.pool_format = paged_format(self.kv_format, self.kv_groups)
        block_bytes = pool_format.block_bytes() + pool_format.residual_block_bytes()
        num_blocks, num_residual = pool_format.size_pool(pool_bytes, config.max_num_seqs)
        if self.parallel is not None:  # every rank must hold the blocks this scheduler hands out
            num_blocks = self.parallel.agree_min(num_blocks)
        windows = [g.window for g in self.kv_groups]
        chunk = config.max_num_batched_tokens if config.enable_chunked_prefill else None

        def fits(length: int) -> bool:
            step = length if chunk is None else max(chunk, 1 + config.num_speculative_tokens)
            return blocks_per_seq(windows, config.block_size, length, step) <= num_blocks

        model_limit = cfg.max_position_embeddings  # a sliding window limits what is attended, not the length
        if windows == [None]:
            capacity = num_blocks * config.block_size
        else:  # the longest sequence that fits the pool alone (every group's blocks at once)
            low, high = 0, max(model_limit, config.max_model_len or 0)
            while low < high:
                mid = (low + high + 1) // 2
                low, high = (mid, high) if fits(mid) else (low, mid - 1)
            capacity = low
            block_bytes *= len(windows)
        if config.max_model_len is None:
            max_model_len = min(model_limit, capacity)
        else:
            max_model_len = config.max_model_len
            if max_model_len > model_limit:
                raise ConfigError(f"max_model_len {max_model_len} exceeds the model's limit {model_limit}")
        if max_model_len > capacity or num_blocks < 1:
            raise kv_pool_too_small(pool_bytes, block_bytes, config.block_size, config.max_model_len)
        return num_blocks, num_residual, max_model_len

    @staticmethod
    def _load(config: EngineConfig, ops: Any, shard: dict[str, Any]) -> tuple[Any, Tokenizer | None, str]:
        """``shard``: this rank's tensor-parallel group and pipeline stage (empty: the whole model)."""
        device = config.resolve_device()
        if config.model == EMBEDDED_MODEL_NAME:
            model, tokenizer = load_embedded(dtype=config.dtype, device=device, ops=ops)
            return model, (None if config.skip_tokenizer else tokenizer), EMBEDDED_LABEL
        if (gguf_file := resolve_gguf_spec(config.model)) is not None:  # a .gguf file, a dir of one, a short name
            from llmctl.models.gguf import load_gguf

            model, tokenizer = load_gguf(
                gguf_file,
                dtype=config.dtype,
                device=device,
                ops=ops,
                with_tokenizer=not config.skip_tokenizer,
                quantization=config.quantization,
                calibration=config.calibration,
            )
            return model, tokenizer, config.model_name or str(config.model)
        model_dir = Path(config.model)
        if not model_dir.is_dir():
            raise ModelLoadError(
                f"{config.model}: no such model directory (use a local folder with config.json and "
                f"*.safetensors, a pulled hub id, or the embedded default {EMBEDDED_MODEL_NAME!r})"
            )
        model = load_model(
            model_dir,
            dtype=config.dtype,
            device=device,
            ops=ops,
            quantization=config.quantization,
            quantization_group_size=config.quantization_group_size,
            calibration=config.calibration,
            tokenizer_dir=config.tokenizer and Path(config.tokenizer),
            **shard,
        )
        tokenizer = None if config.skip_tokenizer else Tokenizer.from_dir(Path(config.tokenizer or model_dir))
        return model, tokenizer, config.model_name or str(config.model)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | PoolingParams | None = None,
        *,
        request_id: str | None = None,
        user: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora: str | LoRAAdapter | None = None,
    ) -> str:
        """Validate and queue a request; raises ``InvalidRequestError`` (allocating nothing) when it
        can never run. This is where requests are validated, once, whoever sends them. With
        ``PoolingParams`` the prompt is prefilled and pooled into one vector (``RequestOutput.pooled``).
        ``lora``: the name of a loaded LoRA adapter to run it with (None: the base model)."""
        adapter = None if lora is None else self._lora_manager().resolve(lora)
        if isinstance(params, PoolingParams):
            return self._add_pooling_request(prompt, params, request_id, user, priority, arrival_time, adapter)
        params = params or SamplingParams()
        params.validate()
        request_id = request_id or f"req-{next(self._request_counter)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError(
                "stop strings need a tokenizer; this engine runs without one (use stop_token_ids)"
            )
        token_ids, text = self._prompt_tokens(prompt)
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt is {len(token_ids)} tokens but max_model_len is {self.max_model_len} "
                "(it must leave room for at least one generated token)"
            )
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        vocab = self.model.config.vocab_size
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise InvalidRequestError(
                f"logit_bias token {max(params.logit_bias)} is out of the vocabulary [0, {vocab})"
            )
        if params.allowed_token_ids and max(params.allowed_token_ids) >= vocab:
            raise InvalidRequestError(
                f"allowed_token_ids token {max(params.allowed_token_ids)} is out of the vocabulary [0, {vocab})"
            )
        if params.bad_words:
            if self.tokenizer is None:
                raise InvalidRequestError("bad_words need a tokenizer; this engine runs without one")
            encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
            params = dataclasses.replace(params, bad_words_token_ids=bad_words_token_ids(encode, params.bad_words))
        grammar = self.prepare(params).new_matcher() if params.structured_outputs is not None else None
        now = time.time() if arrival_time is None else arrival_time
        user = user or "default"
        seq = Sequence(
            request_id,
            list(token_ids),
            len(token_ids),
            params,
            user=user,
            priority=priority,
            arrival_time=now,
            pending_forks=params.n - 1,
            lora=adapter,
        )
        seed = params.sample_seed(0)
        if seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seed)
        seq.grammar = grammar
        self.output_processor.add_request(
            RequestState(request_id, text, token_ids, params, user, RequestMetrics(now)), seq
        )
        self.stats.request_added(len(token_ids))
        self.scheduler.add(seq)
        return request_id

    def _add_pooling_request(
        self,
        prompt: str | list[int],
        pooling: PoolingParams,
        request_id: str | None,
        user: str | None,
        priority: int,
        arrival_time: float | None,
        adapter: LoRAAdapter | None = None,
    ) -> str:
        pooling.validate()
        if self.parallel is not None:
            raise InvalidRequestError(
                "pooling requests (embeddings, scores) do not run with tensor/pipeline parallelism"
            )
        request_id = request_id or f"req-{next(self._request_counter)}"
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        token_ids, text = self._prompt_tokens(prompt)
        if len(token_ids) > self.max_model_len:
            raise InvalidRequestError(f"prompt is {len(token_ids)} tokens but max_model_len is {self.max_model_len}")
        hidden, vocab = self.model.config.hidden_size, self.model.config.vocab_size
        if pooling.dimensions is not None and pooling.dimensions > hidden:
            raise InvalidRequestError(f"dimensions {pooling.dimensions} exceeds the model's hidden size {hidden}")
        if pooling.logit_token_ids and max(pooling.logit_token_ids) >= vocab:
            raise InvalidRequestError(f"logit_token_ids must be in the vocabulary [0, {vocab})")
        now = time.time() if arrival_time is None else arrival_time
        user = user or "default"
        params = SamplingParams(max_tokens=1)  # a placeholder: a pooling sequence never samples
        seq = Sequence(
            request_id, list(token_ids), len(token_ids), params, user=user, priority=priority, arrival_time=now
        )
        seq.pooling, seq.lora = pooling, adapter
        state = RequestState(request_id, text, token_ids, params, user, RequestMetrics(now), pooling=pooling)
        self.output_processor.add_request(state, seq)
        self.stats.request_added(len(token_ids))
        self.scheduler.add(seq)
        return request_id

    @property
    def structured_outputs(self) -> StructuredOutputManager:
        """The grammar engine for this model's vocabulary (the sampler masks logits with it)."""
        if self._structured_outputs is None:
            raise InvalidRequestError("structured outputs need a tokenizer; this engine runs without one")
        return self._structured_outputs

    def prepare(self, params: SamplingParams | PoolingParams) -> CompiledGrammar | None:
        """Compile the request's grammar (cached; on the manager's threads). ``AsyncEngine`` calls
        this before taking the engine lock, so the loop never waits for a compilation."""
        if isinstance(params, PoolingParams) or params.structured_outputs is None:
            return None
        return self.structured_outputs.compile(params.structured_outputs)

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

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks go back at once. False if it is unknown/finished."""
        request = self.output_processor.abort(request_id)
        if request is None:
            return False
        for seq in request.sequences():
            if not seq.is_finished:
                self.scheduler.finish(seq, FinishReason.ABORT)
            self.pooler.discard(seq.seq_id)
        request.metrics.finished_time = time.time()
        self.stats.request_finished(FinishReason.ABORT.value)
        return True

    def has_unfinished(self) -> bool:
        """Requests to finish, or batches still in the pipeline (aborted ones too: collected, not booked)."""
        return bool(self.output_processor.requests) or (self.pipeline is not None and self.pipeline.busy)

    # ---- the step ------------------------------------------------------------------------------
    def step(self, before_forward: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One engine step: schedule, run the model, sample, book. ``before_forward`` (the async
        engine's hand-over of the previous step's outputs) runs once the batch is scheduled,
        just before the model runs."""
        if self.pipeline is not None:  # launch the next batch, book the oldest one in flight
            if before_forward is not None:
                before_forward()
            done = self.pipeline.advance()
            return [] if done is None else self._book(*done)
        started = time.time()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        if before_forward is not None:
            before_forward()
        if sched.verifies:  # speculative decoding: the draft model proposes now (n-gram did while scheduling)
            self.speculator.propose(sched)
        return self._book(sched, self.runner.execute(sched), started)

    def _book(self, sched: SchedulerOutput, output: ModelOutput, started: float) -> list[RequestOutput]:
        """Sample from the batch's logits, book the tokens, and build the requests' outputs."""
        kv_usage = self.scheduler.block_manager.usage  # before this step's finished sequences free theirs
        vectors = self.pooler.collect(output.pooled) if output.pooled else {}
        pooled = [(chunk.seq, vectors[chunk.seq.seq_id]) for chunk in output.pooled if chunk.seq.seq_id in vectors]
        sampled = self.sampler.sample(output, sched.sampling)
        seqs = sched.sampling
        if sched.verifies:
            verified = self.speculator.verify(sched, output.verify_logits)
            self.scheduler.update_from_output(sched, sampled.token_ids, verified.token_ids)
            seqs, sampled = self.speculator.rows(sched, sampled, verified)
        else:
            self.scheduler.update_from_output(sched, sampled.token_ids)
        processed = self.output_processor.process(seqs, sampled, time.time(), pooled)
        for cut in processed.truncations:  # tokens after a stop string (speculative decoding)
            self.scheduler.truncate(cut.seq, cut.num_tokens)
        for seq, reason in processed.to_finish:  # stop strings, and requests whose output failed
            self.scheduler.finish(seq, reason)
        self.stats.record_step(sched, processed.outputs, started, self.scheduler.num_requests(), len(seqs), kv_usage)
        return processed.outputs

    # ---- offline ------------------------------------------------------------------------------
    def generate(
        self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
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

    # ---- what others may read ------------------------------------------------------------------
    @property
    def block_manager(self) -> BlockManager:
        return self.scheduler.block_manager

    @property
    def requests(self) -> dict[str, RequestState]:
        """Unfinished requests by id (read-only by convention)."""
        return self.output_processor.requests

    def live_sequences(self) -> list[Sequence]:
        return [s for r in self.requests.values() for s in r.sequences() if not s.is_finished]

    def counters(self) -> EngineCounters:
        return self.stats.counters(self.requests.values())

    def stats_snapshot(self, max_steps: int = 120) -> dict[str, Any]:
        return self.stats.snapshot(self.requests.values(), max_steps)
