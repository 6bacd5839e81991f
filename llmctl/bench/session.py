"""One ``llmctl bench`` run from start to end: build the target and the workload, warm up, run the
timed load with a live progress bar, optionally run the transformers baseline, report."""

from __future__ import annotations

import asyncio
import math
import platform
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from llmctl.bench import DEFAULT_NUM_PROMPTS
from llmctl.bench.datasets import (
    DATASETS,
    BenchRequest,
    PromptFactory,
    random_requests,
    shared_prefix_requests,
    sharegpt_requests,
)
from llmctl.bench.metrics import RequestRecord, Slo, summarize
from llmctl.bench.report import BenchReport, print_report, report_dict, write_json
from llmctl.bench.runner import HttpTarget, InProcessTarget, RunResult, Target, run_load
from llmctl.cli_options import config_for_model, engine_option_list, resolve_model
from llmctl.config import EMBEDDED_MODEL_NAME, EngineConfig
from llmctl.errors import LlmctlError
from llmctl.models.gguf_files import default_model, resolve_gguf_spec
from llmctl.tokenizer import Tokenizer
from llmctl_kernels.cpu_features import native_bf16_units

PROMPT_FORMATS = ("auto", "tokens", "text")
DEFAULT_OUTPUT_LEN = 128


class BenchError(LlmctlError):
    """The benchmark cannot run as asked."""


@dataclass
class BenchOptions:
    model: str | None = None
    url: str | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    dataset: str = "random"
    dataset_path: Path | None = None
    num_prompts: int = DEFAULT_NUM_PROMPTS
    input_len: int = 128
    output_len: int | None = None
    range_ratio: float = 0.0
    num_users: int = 4
    prefix_len: int = 256
    prompt_format: str = "auto"
    ignore_eos: bool | None = None
    concurrency: int = 64
    request_rate: float = math.inf
    warmup: int = 1
    seed: int = 0
    slo_ttft_ms: float | None = 500.0
    slo_tpot_ms: float | None = 1000 / 30
    json_path: Path | None = None
    baseline: str | None = None
    engine_config: EngineConfig = field(default_factory=EngineConfig)  # the in-process engine's settings
    lora_modules: tuple[str, ...] = ()  # NAME=DIR adapters the in-process requests spread over
    quantization_given: bool = False  # --quantization typed: its weights run as asked, never a float copy
    argv: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if self.dataset not in DATASETS:
            raise BenchError(f"--dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if self.dataset == "sharegpt" and self.dataset_path is None:
            raise BenchError("--dataset sharegpt needs --dataset-path FILE (a ShareGPT-format JSON list)")
        if self.prompt_format not in PROMPT_FORMATS:
            raise BenchError(f"--prompt-format must be one of {', '.join(PROMPT_FORMATS)}")
        if self.baseline not in (None, "hf"):
            raise BenchError(f"--baseline must be 'hf', got {self.baseline!r}")
        if self.num_prompts < 1 or self.input_len < 1 or (self.output_len is not None and self.output_len < 1):
            raise BenchError("--num-prompts, --input-len and --output-len must be at least 1")
        if self.concurrency < 0 or self.warmup < 0:
            raise BenchError("--concurrency and --warmup cannot be negative")
        if not self.request_rate > 0:
            raise BenchError("--request-rate must be positive (inf sends every request at once)")
        if self.lora_modules and self.url is not None:
            raise BenchError(
                "--lora-modules runs adapters in process; against --url name an adapter the server has "
                "with --served-model-name"
            )
        if self.lora_modules and self.baseline is not None:
            raise BenchError("--lora-modules and --baseline: the transformers baseline runs the base model only")
        for entry in self.lora_modules:
            name, _, path = entry.partition("=")
            if not name or not path:
                raise BenchError(f"--lora-modules takes NAME=DIR, got {entry!r}")

    @property
    def effective_ignore_eos(self) -> bool:
        return self.ignore_eos if self.ignore_eos is not None else self.dataset != "sharegpt"

    def as_text(self) -> bool:
        return self.prompt_format == "text" or (self.prompt_format == "auto" and self.url is not None)


def build_requests(
    options: BenchOptions, tokenizer: Tokenizer | None, vocab_size: int | None, max_model_len: int | None = None
) -> list[BenchRequest]:
    """The warm-up requests followed by the timed ones, all drawn from one seeded stream."""
    total = options.num_prompts + options.warmup
    output_len = options.output_len or DEFAULT_OUTPUT_LEN
    if options.dataset == "sharegpt":
        return sharegpt_requests(
            options.dataset_path, tokenizer, total, options.seed, options.output_len, max_model_len
        )
    factory = PromptFactory(tokenizer, vocab_size, as_text=options.as_text())
    if options.dataset == "shared-prefix":
        return shared_prefix_requests(
            factory,
            total,
            options.num_users,
            options.prefix_len,
            options.input_len,
            output_len,
            options.range_ratio,
            options.seed,
        )
    return random_requests(factory, total, options.input_len, output_len, options.range_ratio, options.seed)


def default_bench_model() -> str:
    """SmolLM2-135M when its package is installed (a real model), else the embedded one."""
    return default_model(EMBEDDED_MODEL_NAME)


BATCHED_STREAMS = 8


def _batched_default_prefers_floats(options: BenchOptions, spec: str, config: EngineConfig) -> bool:
    """The default model is a packed GGUF; at many rows a step (prefill, 64 streams) its bf16 copy
    is faster where the CPU computes bf16 natively, and elsewhere the packed weights are as fast as
    a float32 copy or faster, from a sixth of the memory (SmolLM2-135M, 64 x 128 -> 128, output
    tok/s: on a Zen 4 packed 302-316 against bf16 538 and fp32 283; on an AVX2-only Zen 3 packed
    247-259 against fp32 234-246; docs/benchmarks.md, "Concurrency"). A ``--quantization`` typed
    on the command line is kept as given."""
    many = options.concurrency == 0 or options.concurrency >= BATCHED_STREAMS
    return (
        many
        and not options.quantization_given
        and config.quantization == "auto"
        and config.dtype in ("auto", "bfloat16")  # another dtype asked for: packed beats its float copy
        and config.resolve_device().type == "cpu"
        and bool(native_bf16_units())
        and resolve_gguf_spec(spec) is not None
    )


def _tokenizer_for(spec: str) -> Tokenizer:
    if spec == EMBEDDED_MODEL_NAME:
        from llmctl.models.embedded import embedded_tokenizer

        return embedded_tokenizer()
    if (gguf_file := resolve_gguf_spec(spec)) is not None:
        from llmctl.models.gguf import gguf_tokenizer

        return gguf_tokenizer(gguf_file)
    return Tokenizer.from_dir(Path(resolve_model(spec)))


def _load_model_weights(spec: str, dtype: str) -> Any:
    """The llmctl model alone (no engine, no KV pool) with plain float weights, for the baseline
    (a GGUF model's weights dequantized: transformers computes in floats)."""
    from llmctl.layers.ops import TorchOps
    from llmctl.models.embedded import load_embedded
    from llmctl.models.loader import load_model

    cpu = torch.device("cpu")
    if spec == EMBEDDED_MODEL_NAME:
        return load_embedded(dtype=dtype, device=cpu, ops=TorchOps())[0]
    if (gguf_file := resolve_gguf_spec(spec)) is not None:
        from llmctl.models.gguf import load_gguf

        return load_gguf(gguf_file, dtype=dtype, device=cpu, ops=TorchOps(), with_tokenizer=False, quantization="none")[
            0
        ]
    return load_model(Path(resolve_model(spec)), dtype=dtype, device=cpu, ops=TorchOps())


class _LiveProgress:
    """The progress bar of one phase, with the output token rate so far."""

    def __init__(self, progress: Progress, description: str, total: int) -> None:
        self.progress = progress
        self.task = progress.add_task(description, total=total, rate="")
        self.tokens = 0
        self.failed = 0

    def __call__(self, record: RequestRecord) -> None:
        self.tokens += record.output_tokens
        self.failed += not record.succeeded
        elapsed = self.progress.tasks[self.task].elapsed or 0.0
        rate = f"{self.tokens / elapsed:.0f} tok/s" if elapsed > 0 else ""
        if self.failed:
            rate += f" · [red]{self.failed} failed[/]"
        self.progress.update(self.task, advance=1, rate=rate)


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[rate]}"),
        console=console,
    )


def _describe(options: BenchOptions, requests: list[BenchRequest]) -> str:
    if options.dataset == "sharegpt":
        workload = f"sharegpt {options.dataset_path}"
    else:
        workload = f"{options.dataset} in={options.input_len} out={options.output_len or DEFAULT_OUTPUT_LEN}"
        if options.range_ratio:
            workload += f" ±{options.range_ratio:g}"
        if options.dataset == "shared-prefix":
            workload += f" users={options.num_users} prefix={options.prefix_len}"
    rate = "inf" if math.isinf(options.request_rate) else f"{options.request_rate:g}/s"
    return (
        f"llmctl bench · {workload} · {len(requests)} requests · concurrency {options.concurrency or '∞'} · rate {rate}"
    )


async def _run_phases(
    target: Target, warmup: list[BenchRequest], timed: list[BenchRequest], options: BenchOptions, err: Console
) -> RunResult:
    concurrency = options.concurrency or None
    with _progress(err) as progress:
        if warmup:
            await run_load(
                target,
                warmup,
                concurrency=concurrency,
                seed=options.seed,
                on_done=_LiveProgress(progress, "warm-up", len(warmup)),
            )
        return await run_load(
            target,
            timed,
            concurrency=concurrency,
            request_rate=options.request_rate,
            seed=options.seed,
            on_done=_LiveProgress(progress, "benchmark", len(timed)),
        )


async def _run_target(options: BenchOptions, err: Console) -> tuple[RunResult, list[BenchRequest], dict[str, Any]]:
    """Build the target and the workload, run both phases; returns the timed run, its requests and
    facts for the report (the llmctl model for the baseline, notes)."""
    facts: dict[str, Any] = {"notes": []}
    spec = options.model or (EMBEDDED_MODEL_NAME if options.url is not None else default_bench_model())
    if options.url is not None:
        target = HttpTarget(
            options.url,
            model=options.served_model_name,
            api_key=options.api_key,
            ignore_eos=options.effective_ignore_eos,
        )
        try:
            server_stats = await _probe_server(target)
            try:
                await target.connect()
            except ConnectionError as exc:
                raise BenchError(str(exc)) from exc
            tokenizer = _tokenizer_for(spec)
            if options.model is None:
                facts["notes"].append(
                    f"prompts built with {EMBEDDED_MODEL_NAME}'s tokenizer; pass the served "
                    "model as MODEL for prompt lengths in its own tokens"
                )
            requests = build_requests(options, tokenizer, tokenizer.vocab_size)
            warmup, timed = requests[: options.warmup], requests[options.warmup :]
            result = await _run_phases(target, warmup, timed, options, err)
        finally:
            await target.close()
        facts.update(
            tokenizer=tokenizer,
            model_spec=spec,
            label="server",
            model_label=f"{target.model}, served at {target.base_url}",
            engine_options=server_stats["config"] if server_stats else None,
            settings=_server_settings(server_stats),
        )
        return result, timed, facts

    from llmctl.engine.async_engine import AsyncEngine
    from llmctl.engine.llm_engine import LLMEngine

    config = config_for_model(options.engine_config, spec)
    if options.model is None and _batched_default_prefers_floats(options, spec, config):
        # 4-bit weights lose nothing measurable in bf16 (SmolLM2-135M Q4_1: perplexity +0.06 % and
        # -0.001 % on two texts), and bf16 matmuls run ~1.7x the packed GEMM where the CPU has bf16 units
        config.quantization, config.dtype = "none", "bfloat16"
        facts["notes"].append(
            f"{spec}: packed weights dequantized to bfloat16 (--quantization none): with "
            f"{options.concurrency or 'all'} streams a step the bf16 matmuls of this CPU "
            f"({', '.join(native_bf16_units())}) are faster; --quantization auto keeps them packed"
        )
    if (
        not options.as_text()
        and options.dataset != "sharegpt"
        and config.model != EMBEDDED_MODEL_NAME
        and not (Path(config.model) / "tokenizer.json").is_file()
    ):
        config.skip_tokenizer = True  # token-id prompts: a checkpoint without tokenizer files still benchmarks
    if options.lora_modules:
        from llmctl.lora.adapter import config_with_adapters

        config = config_with_adapters(config, options.lora_modules)
        facts["notes"].append(f"requests spread round-robin over the LoRA adapters {', '.join(config.lora_modules)}")
    engine = LLMEngine(config)
    requests = build_requests(options, engine.tokenizer, engine.model.config.vocab_size, engine.max_model_len)
    if adapters := engine.lora_names():
        requests = [replace(r, lora=adapters[i % len(adapters)]) for i, r in enumerate(requests)]
    too_long = max(r.prompt_len + r.output_len for r in requests)
    if too_long > engine.max_model_len:
        raise BenchError(
            f"a request needs {too_long} tokens (prompt + output) but max_model_len is "
            f"{engine.max_model_len}: shorten --input-len/--output-len/--prefix-len"
        )
    async_engine = AsyncEngine(engine).start()
    try:
        target = InProcessTarget(async_engine, ignore_eos=options.effective_ignore_eos)
        warmup, timed = requests[: options.warmup], requests[options.warmup :]
        result = await _run_phases(target, warmup, timed, options, err)
    finally:
        async_engine.shutdown()
    facts.update(
        tokenizer=engine.tokenizer,
        llmctl_model=engine.model,
        label="llmctl",
        model_label=engine.model_label,
        settings=f"torch threads: {torch.get_num_threads()} · {platform.machine()}",
        engine_options={o.name: getattr(config, o.name) for o in engine_option_list()},
        model_spec=spec,
    )
    return result, timed, facts


async def _probe_server(target: HttpTarget) -> dict[str, Any] | None:
    """Check the key before the load starts (a 401 is one clear line, not an error per request) and
    read the server's engine settings from ``/v1/engine/stats`` when it is llmctl (None otherwise)."""
    stats = None
    for path in ("/v1/models", "/v1/engine/stats"):
        try:
            status, body = await target.get(path)
        except (aiohttp.ClientError, OSError):  # OSError: timeouts too
            return None  # unreachable: connect() says so
        if status == 401:
            raise BenchError(f"401 from {target.base_url}: pass --api-key or set LLMCTL_API_KEY")
        if path.endswith("stats") and status == 200:
            stats = body
    return stats if isinstance(stats, dict) and isinstance(stats.get("config"), dict) else None


def _server_settings(stats: dict[str, Any] | None) -> str:
    """The serving engine's settings, as the report's note (the client's would say nothing)."""
    if stats is None:
        return "server: not llmctl (no /v1/engine/stats), so its engine settings are not known"
    c = stats["config"]
    return (
        f"server: llmctl · {c.get('dtype')} · {c.get('device')} · {c.get('attention_backend')} · "
        f"max_num_seqs {c.get('max_num_seqs')} · max_num_batched_tokens {c.get('max_num_batched_tokens')} · "
        f"{c.get('num_blocks')} KV blocks of {c.get('block_size')} · max_model_len {c.get('max_model_len')} · "
        f"prefix caching {'on' if c.get('enable_prefix_caching') else 'off'} · "
        f"chunked prefill {'on' if c.get('enable_chunked_prefill') else 'off'}"
    )


def _run_baseline(
    options: BenchOptions, timed: list[BenchRequest], result: RunResult, facts: dict[str, Any], err: Console
) -> RunResult:
    from llmctl.bench.baseline_hf import require_transformers, run_static_batches, to_hf_model

    require_transformers()
    model = facts.get("llmctl_model")
    if model is None or any(getattr(m, "packed_format", None) for m in model.modules()):  # packed: not for transformers
        model = _load_model_weights(facts["model_spec"], options.engine_config.dtype)
    hf = to_hf_model(model)
    # the same work on both sides: each request generates what it generated in the timed run
    same_work = [
        replace(r, output_len=rec.output_tokens) if rec.succeeded else r for r, rec in zip(timed, result.records)
    ]
    batch = min(options.concurrency or len(same_work), len(same_work))
    tokenizer = facts["tokenizer"]
    pad = tokenizer.eos_token_id if tokenizer is not None and tokenizer.eos_token_id is not None else 0
    with _progress(err) as progress:
        warm = [replace(r, output_len=2) for r in same_work[:batch]]
        run_static_batches(hf, warm, batch, tokenizer, pad, _LiveProgress(progress, "hf warm-up", len(warm)))
        return run_static_batches(
            hf, same_work, batch, tokenizer, pad, _LiveProgress(progress, "hf static batching", len(same_work))
        )


def run_bench(options: BenchOptions, out: Console, err: Console) -> dict[str, Any]:
    """Run the benchmark, print the report; returns the JSON-ready figures (also written to --json)."""
    options.validate()
    threads = options.engine_config.num_threads
    if threads:  # also the baseline's and, with --url, the client's threads
        torch.set_num_threads(threads)
    result, timed, facts = asyncio.run(_run_target(options, err))
    slo = Slo(options.slo_ttft_ms, options.slo_tpot_ms)
    sides = [BenchReport(facts["label"], summarize(result.records, slo, result.duration_s), result.engine_stats)]
    notes = [
        f"model: {facts['model_label']}",
        *facts["notes"],
        facts["settings"],
        f"{options.warmup} warm-up request(s), not counted",
    ]
    if options.baseline == "hf":
        base = _run_baseline(options, timed, result, facts, err)
        sides.append(BenchReport("hf static", summarize(base.records, slo, base.duration_s)))
        notes.append(
            f"hf static: transformers generate(), static batches of "
            f"{min(options.concurrency or len(timed), len(timed))}, same weights and dtype, same "
            "output lengths; a request starts with its batch and ends when the batch returns"
        )
    title = _describe(options, timed)
    print_report(out, sides, title, notes)
    config = {
        k: (str(v) if isinstance(v, Path) else v)
        for k, v in asdict(options).items()
        if k not in ("api_key", "argv", "engine_config")
    }
    config["engine_options"] = facts["engine_options"]
    config.update(
        request_rate=None if math.isinf(options.request_rate) else options.request_rate,
        argv=options.argv,
        model_label=facts["model_label"],
        torch_threads=torch.get_num_threads() if options.url is None else None,
        ignore_eos=options.effective_ignore_eos,
        prompt_format="text" if options.as_text() else "tokens",
    )
    data = report_dict(sides, config)
    if options.json_path is not None:
        write_json(options.json_path, data)
        err.print(f"[dim]wrote {options.json_path}[/]")
    if sides[0].summary.completed == 0:
        raise BenchError("every request failed: nothing was measured")
    return data
