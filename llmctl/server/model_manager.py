"""Many models behind one server: each loaded on its first request, kept for its keep-alive, then
unloaded; the least recently used idle one evicted when a new one does not fit the memory budget.

Every route resolves the request's ``model`` here (:meth:`ModelManager.run`): an unknown name is a
404 (``model_not_found``); a known one is *leased* for the request's whole life (a stream: until
it closes), so a model with requests in flight is never unloaded or evicted. A model that is not
loaded is loaded while the request waits (one load at a time, in a worker thread, so the other
models go on serving); concurrent requests for it wait for the same load. A load that fails
answers those requests with a 500 (``model_load_failed``) naming the cause; the next request tries
again.

When a model's last request ends, it stays loaded for its keep-alive (the request's ``keep_alive``,
else the model's, else the server's ``--keep-alive``): ``0`` unloads it at once, a negative value
keeps it until the server stops. Unloading stops its engine thread and drops every reference to
the engine, so its weights and KV pool are freed.

``--memory-budget`` bounds the sum over loaded models of weight bytes plus KV pool bytes (known
exactly once loaded; before a first load, estimated from the weight files and the KV pool size).
A model that cannot fit even alone is a 503 at once (``model_too_large``); otherwise idle models
are evicted, least recently used first, and if the models still loaded are all busy the request
waits for one of them to finish.

A server started with one model (``llmctl serve MODEL``) loads it at start-up and keeps it: the
model is *pinned* (requests' ``keep_alive`` is ignored) unless ``--keep-alive`` is given; only
``llmctl stop`` unloads it (and the next request loads it again).

LoRA adapters (``--lora-modules``, a ``--config`` model's ``lora_modules``, ``/v1/load_lora_adapter``)
belong to one base model each: they are kept in its spec (``lora_modules``), so the engine loads
them with the model (an adapter that cannot be read fails that model's load, naming both), and a
request naming an adapter resolves to its base model's slot; ``OpenAIServing.generation_target``
then picks the adapter, for the OpenAI routes and the dialects translated onto them.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import gc
import json
import math
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Request
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from llmctl.config import EngineConfig
from llmctl.errors import ConfigError
from llmctl.server.protocol import APIError, bad_request
from llmctl.server.serving import EngineStreamResponse, ServerState

if TYPE_CHECKING:
    from llmctl.engine.async_engine import AsyncEngine
    from llmctl.reasoning import ReasoningParser
    from llmctl.server.dialects.ollama import ModelInfo
    from llmctl.server.embeddings import PoolingServing, PoolingSettings
    from llmctl.server.metrics import ServerMetrics
    from llmctl.server.serving import ChatTemplatePolicy, OpenAIServing

DEFAULT_KEEP_ALIVE_S = 300.0  # Ollama's default: 5 minutes
FOREVER = math.inf
POLL_S = 0.05
FORCE_WAIT_S = 10.0  # how long `stop --force` waits for the aborted requests to close
LOAD_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")
PREFIX = "llmctl:"


# ---- keep-alive values ------------------------------------------------------------------------------
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: Any, param: str = "keep_alive") -> float:
    """Seconds to keep a model after its last request, as Ollama reads ``keep_alive``: a number of
    seconds or a Go duration (``"5m"``, ``"1h30m"``, ``"500ms"``, ``"-1"``). Negative: forever.
    Anything else is a 400 naming ``param`` (a ``ValueError`` subclass, so the CLI refuses it too)."""
    if isinstance(value, bool) or value is None:
        raise bad_request(f"{param} must be a duration such as 5m, 30s or -1 (never unload), got {value!r}", param)
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip()
        sign = -1.0 if text.startswith("-") else 1.0
        body = text.lstrip("+-")
        try:
            seconds = sign * float(body)
        except ValueError:
            parts = _DURATION.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise bad_request(
                    f"{param} must be a duration such as 5m, 30s or -1 (never unload), got {value!r}", param
                ) from None
            seconds = sign * sum(float(n) * _UNIT_S[u] for n, u in parts)
    if math.isnan(seconds):
        raise bad_request(f"{param} must be a duration, got {value!r}", param)
    return FOREVER if seconds < 0 else seconds


def describe_keep_alive(seconds: float) -> str:
    if seconds == FOREVER:
        return "forever"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"


# ---- what to serve ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelSpec:
    """One model the server can serve: its name in the API, where it comes from (a path, a hub id,
    a ``.gguf`` file, an embedded name), engine options over the command line's, and keep-alive."""

    name: str
    source: str
    options: dict[str, Any] = field(default_factory=dict)  # EngineConfig field -> value
    keep_alive_s: float | None = None  # None: the server's default

    def config(self, base: EngineConfig) -> EngineConfig:
        return dataclasses.replace(base, **self.options) if self.options else base

    @property
    def adapters(self) -> dict[str, str]:
        """The LoRA adapters served on this model: name -> path."""
        return dict(entry.split("=", 1) for entry in self.options.get("lora_modules", ()))

    def with_adapters(self, adapters: dict[str, str]) -> ModelSpec:
        modules = tuple(f"{name}={path}" for name, path in adapters.items())
        return dataclasses.replace(self, options={**self.options, "lora_modules": modules})


NOT_PER_MODEL = {"tensor_parallel_size", "pipeline_parallel_size", "seed", "num_threads", "device"}


def spec_from_argument(argument: str) -> ModelSpec:
    """``MODEL`` or ``NAME=MODEL`` from the command line."""
    name, sep, source = argument.partition("=")
    if sep and name and source and "/" not in name:
        return ModelSpec(name, source)
    return ModelSpec(argument, argument)


def read_config_file(path: str) -> tuple[list[ModelSpec], dict[str, Any]]:
    """``--config FILE``: the models and the server-wide settings (``keep_alive``, ``memory_budget``).

    YAML (``.yaml``/``.yml``, read with PyYAML, which huggingface-hub already installs), JSON or TOML::

        keep_alive: 5m
        memory_budget: 8GiB
        models:
          - name: qwen
            model: Qwen/Qwen2.5-0.5B-Instruct
            dtype: bfloat16
            kv_cache_memory: 1GiB
            max_model_len: 4096
            keep_alive: -1
          - name: stories
            model: ../shared/models/stories260k
            quantization: int8
            lora_modules: {tales: ./tales-lora}  # or a list: [tales=./tales-lora]
            max_lora_rank: 32
            max_loras: 2

    ``models`` may also be a mapping from name to options. Engine options take the names of
    ``llmctl serve``'s flags (``kv-cache-memory`` or ``kv_cache_memory``); a model's LoRA adapters
    are checked as ``--lora-modules`` / ``--max-loras`` / ``--max-lora-rank`` are, and read when the
    model loads (a bad adapter fails that model's load alone)."""
    from llmctl.cli_options import engine_option_list

    file = Path(path).expanduser()
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror or exc}") from None
    try:
        if file.suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        elif file.suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # noqa: BLE001 - any parser's error, as one line
        raise ConfigError(f"--config {path}: cannot parse it: {exc}") from None
    if not isinstance(data, dict) or not data.get("models"):
        raise ConfigError(f"--config {path}: expected a mapping with a non-empty `models` list")
    entries = data["models"]
    if isinstance(entries, dict):
        entries = [{"name": name, **(options or {})} for name, options in entries.items()]
    if not isinstance(entries, list):
        raise ConfigError(f"--config {path}: `models` must be a list or a mapping")
    options = {o.name: o for o in engine_option_list()}
    specs = []
    for i, entry in enumerate(entries):
        where = f"--config {path}: models[{i}]"
        if isinstance(entry, str):
            entry = {"model": entry}
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: expected a mapping")
        entry = {str(k).replace("-", "_"): v for k, v in entry.items()}
        source = entry.pop("model", None) or entry.pop("path", None)
        if not isinstance(source, str) or not source:
            raise ConfigError(f"{where}: `model` (a path, a hub id or a .gguf file) is required")
        name = str(entry.pop("name", source))
        keep_alive = entry.pop("keep_alive", None)
        try:
            keep_alive_s = None if keep_alive is None else parse_keep_alive(keep_alive)
        except APIError as exc:
            raise ConfigError(f"{where}: {exc.message}") from None
        overrides = lora_options(entry, f"{where} ({name})")
        for key, value in entry.items():
            option = options.get(key)
            if option is None or key in NOT_PER_MODEL:
                raise ConfigError(f"{where}: {key!r} is not a per-model option")
            try:
                overrides[key] = option.value(value)
            except (ValueError, TypeError) as exc:
                raise ConfigError(f"{where}: {key}: {exc}") from None
        specs.append(ModelSpec(name, source, overrides, keep_alive_s))
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ConfigError(f"--config {path}: model names must differ: {names}")
    check_adapter_names(specs)
    settings = {k: data[k] for k in ("keep_alive", "memory_budget") if k in data}
    return specs, settings


def lora_options(entry: dict[str, Any], where: str) -> dict[str, Any]:
    """Takes a config entry's ``lora_modules`` (name -> path, or a list of ``NAME=PATH``),
    ``max_loras`` and ``max_lora_rank`` out of ``entry`` as ``EngineConfig`` fields, refusing what
    ``llmctl serve``'s flags refuse."""
    options: dict[str, Any] = {}
    for key in ("max_loras", "max_lora_rank"):
        if key in entry:
            value = entry.pop(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{where}: {key} must be an integer of at least 1, got {value!r}")
            options[key] = value
    modules = entry.pop("lora_modules", None)
    if modules is None:
        return options
    if isinstance(modules, dict):
        pairs = [(str(name), adapter) for name, adapter in modules.items()]
    elif isinstance(modules, list) and all(isinstance(item, str) for item in modules):
        pairs = [tuple(item.split("=", 1)) if "=" in item else (item, None) for item in modules]
    else:
        raise ConfigError(f"{where}: lora_modules must map names to adapter directories, or list NAME=PATH")
    adapters: dict[str, str] = {}
    for name, adapter in pairs:
        if not name or "=" in name or not isinstance(adapter, str) or not adapter:
            raise ConfigError(f"{where}: lora_modules {name!r}: expected NAME=PATH (a PEFT adapter directory)")
        if name in adapters:
            raise ConfigError(f"{where}: lora_modules {name}: the name is given twice")
        adapters[name] = adapter
    options["lora_modules"] = tuple(f"{name}={adapter}" for name, adapter in adapters.items())
    return options


def check_adapter_names(specs: list[ModelSpec]) -> None:
    """Every LoRA adapter's name is its own: no model and no other adapter answers to it."""
    taken = {spec.name: "a model" for spec in specs}
    for spec in specs:
        for name in spec.adapters:
            if name in taken:
                raise ConfigError(
                    f"LoRA adapter {name} of model {spec.name}: the name is already served ({taken[name]})"
                )
            taken[name] = f"an adapter of model {spec.name}"


# ---- a loaded model ---------------------------------------------------------------------------------
class ModelState(ServerState):
    """One model's share of the server's state: its own API calls in flight (what ``stop --force``
    cancels), the server's drain flag."""

    def __init__(self, server: ServerState) -> None:  # not the dataclass __init__: draining is the server's
        self.server = server
        self.rejected_queue_full = 0
        self.started = server.started
        self.live = set()

    @property  # type: ignore[override]
    def draining(self) -> bool:
        return self.server.draining

    @draining.setter
    def draining(self, value: bool) -> None:
        self.server.draining = value


@dataclass
class ServedModel:
    """A loaded model and everything the routes use for it."""

    name: str
    async_engine: AsyncEngine
    serving: OpenAIServing
    pooling: PoolingServing
    info: ModelInfo
    metrics: ServerMetrics
    state: ModelState
    weights_bytes: int
    kv_bytes: int
    load_s: float
    description: str  # the start-up line

    @property
    def size_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes

    def close(self) -> None:
        """Stop the engine thread; the caller drops its references, and the memory goes with them."""
        self.async_engine.shutdown()


@dataclass
class ServerOptions:
    """The settings every model is loaded with (the command line's)."""

    engine_config: EngineConfig
    max_queue: int
    chat_templates: ChatTemplatePolicy
    reasoning_parser: str | None = None
    pooling: dict[str, Any] = field(default_factory=dict)  # resolve_settings' keyword arguments


def load_model(
    spec: ModelSpec,
    options: ServerOptions,
    server_state: ServerState,
    *,
    allow_pull: bool | None = False,
    on_settings: Callable[[str], None] | None = None,
) -> ServedModel:
    """Load ``spec`` and start its engine thread (call it in the thread that will own the model's
    OpenMP pool's release: see ``AsyncEngine.start``). Raises ``LlmctlError``, ``ValueError`` or
    ``OSError`` with a message for the user."""
    from llmctl.cli_options import config_for_model
    from llmctl.engine.async_engine import AsyncEngine
    from llmctl.engine.llm_engine import LLMEngine
    from llmctl.layers.quantization import weight_bytes
    from llmctl.reasoning import resolve_parser
    from llmctl.server.dialects.ollama import ModelInfo
    from llmctl.server.embeddings import PoolingServing, resolve_settings
    from llmctl.server.metrics import ServerMetrics
    from llmctl.server.serving import OpenAIServing

    config = config_for_model(spec.config(options.engine_config), spec.source, allow_pull=allow_pull)
    started = time.perf_counter()
    engine = LLMEngine(config)
    if engine.tokenizer is None:
        raise ConfigError("the server needs the model's tokenizer (tokenizer.json)")
    parser: ReasoningParser | None = resolve_parser(options.reasoning_parser, engine.tokenizer)
    pooling: PoolingSettings = resolve_settings(config.model, engine.tokenizer, **options.pooling)
    if on_settings is not None:
        on_settings(pooling.description)
        if options.reasoning_parser is not None:
            found = parser.description if parser else "none"
            on_settings(f"reasoning parser: {found}")
    load_s = time.perf_counter() - started
    description = (
        f"model: {engine.model_label} · {engine.dtype_description} · {engine.kv_description} · "
        f"{engine.device} · {engine.runner.decode_path} · {engine.weights_description} · "
        f"{engine.block_manager.num_blocks} KV blocks of {config.block_size} · max_model_len "
        f"{engine.max_model_len} · load {load_s:.2f}s"
    )
    if engine.lora is not None:
        names = ", ".join(engine.lora_names()) or "none loaded"
        description += f" · {engine.lora.describe()} ({names})"
    state = ModelState(server_state)
    async_engine = AsyncEngine(engine, max_waiting=options.max_queue).start()
    serving = OpenAIServing(
        async_engine,
        served_model_name=spec.name,
        model_aliases={spec.source, str(config.model)},
        state=state,
        chat_templates=options.chat_templates,
        reasoning_parser=parser,
    )
    return ServedModel(
        name=spec.name,
        async_engine=async_engine,
        serving=serving,
        pooling=PoolingServing(serving, pooling, engine.model.config.hidden_size),
        info=ModelInfo(serving),
        metrics=ServerMetrics(async_engine, spec.name),
        state=state,
        weights_bytes=weight_bytes(engine.model),
        kv_bytes=_kv_pool_bytes(engine),
        load_s=load_s,
        description=description,
    )


def _kv_pool_bytes(engine: Any) -> int:
    """The KV pool's bytes: its float blocks, or the quantized pool's."""
    runner = getattr(engine.runner, "runner", engine.runner)  # a ParallelRunner wraps rank 0's runner
    total = runner.kv_cache.numel() * runner.kv_cache.element_size()
    quantized = getattr(runner, "quantized_kv", None)
    if quantized is not None:
        total += sum(t.numel() * t.element_size() for t in vars(quantized).values() if hasattr(t, "element_size"))
    return int(total)


def _release_freed_memory() -> None:
    """Collect the unloaded engine's reference cycles and give freed heap back to the OS (glibc)."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort
        pass
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


# ---- the manager ------------------------------------------------------------------------------------
@dataclass
class Slot:
    """One servable model and its life: unloaded, loading, loaded (idle or busy)."""

    spec: ModelSpec
    keep_alive_s: float  # the model's default
    pinned: bool = False  # requests' keep_alive is ignored
    served: ServedModel | None = None
    loading: asyncio.Future | None = None
    stopping: bool = False
    in_flight: int = 0
    waiting_for_load: int = 0
    last_used: float = field(default_factory=time.monotonic)
    expires_at: float = FOREVER  # monotonic
    current_keep_alive_s: float | None = None  # the last request's, once idle
    timer_token: int = 0
    loads: int = 0
    load_failures: int = 0
    unloads: dict[str, int] = field(default_factory=dict)  # by reason
    last_error: str | None = None
    last_load_s: float | None = None
    last_size: int | None = None  # bytes, once loaded
    last_info: dict[str, Any] | None = None  # Ollama's tag, once loaded
    last_root: str | None = None
    last_max_model_len: int | None = None
    aliases: set[str] = field(default_factory=set)

    @property
    def loaded(self) -> bool:
        return self.served is not None

    @property
    def status(self) -> str:
        if self.stopping:
            return "stopping"
        if self.loading is not None:
            return "loading"
        if self.served is not None:
            return "busy" if self.in_flight else "idle"
        return "failed" if self.last_error else "unloaded"


class Lease:
    """One request's hold on a loaded model; ``release`` once (a stream: when it closes)."""

    def __init__(self, manager: ModelManager, slot: Slot, keep_alive_s: float | None, load_wait_s: float) -> None:
        self.manager, self.slot, self.keep_alive_s, self.load_wait_s = manager, slot, keep_alive_s, load_wait_s
        self.served: ServedModel = slot.served  # type: ignore[assignment]
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.manager._release(self.slot, self.keep_alive_s)


class ModelManager:
    def __init__(
        self,
        specs: list[ModelSpec],
        loader: Callable[[ModelSpec], ServedModel],
        *,
        server_state: ServerState,
        default_keep_alive_s: float = DEFAULT_KEEP_ALIVE_S,
        memory_budget: int | None = None,
        pinned: bool = False,
        base_config: EngineConfig | None = None,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        if not specs:
            raise ValueError("no models to serve")
        self.loader = loader
        self.state = server_state
        self.memory_budget = memory_budget
        self.on_event = on_event or (lambda message: None)
        self.slots: dict[str, Slot] = {}
        for spec in specs:
            keep = spec.keep_alive_s if spec.keep_alive_s is not None else default_keep_alive_s
            self.slots[spec.name] = Slot(spec, keep, pinned=pinned, aliases={spec.name, spec.source})
        self.default_name = specs[0].name
        self.base_config = base_config or EngineConfig()
        self._admit: asyncio.Lock | None = None  # made on first use, in the server's event loop
        self._tasks: set[asyncio.Task] = set()  # unloads the keep-alive timers started
        self.registry = CollectorRegistry()
        self.load_wait = Histogram(
            PREFIX + "model_load_wait_seconds",
            "Time a request waited for its model to load (requests that found it loaded are not counted).",
            ["model_name"],
            buckets=LOAD_WAIT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_ManagerCollector(self))

    # ---- names ----------------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return list(self.slots)

    def resolve(self, model: str | None, ollama: bool = False) -> Slot:
        """The slot that ``model`` names (its served name, the path or hub id it comes from, the
        directory it was loaded from; a LoRA adapter's name: its base model's; Ollama's ``:latest``
        tag too); no model: the first one. An unknown name is a 404, worded as OpenAI's API (or,
        ``ollama``, as Ollama's) words it."""
        if model is None:
            return self.slots[self.default_name]
        for candidate in (model, model.removesuffix(":latest")):
            slot = self.slots.get(candidate)
            if slot is not None:
                return slot
            for slot in self.slots.values():
                if candidate in slot.aliases:
                    return slot
            if (found := self.adapter_slot(candidate)) is not None:
                return found
        if ollama:
            served = ", ".join(f"'{name}'" for name in self.slots)
            raise APIError(404, f"model '{model}' not found (this server serves {served})", code="model_not_found")
        served = ", ".join(f"`{name}`" for name in self.slots)
        raise APIError(
            404,
            f"The model `{model}` does not exist (this server serves {served})",
            param="model",
            code="model_not_found",
        )

    def adapter_slot(self, name: str) -> Slot | None:
        """The slot of the base model serving LoRA adapter ``name`` (None: no such adapter)."""
        return next((slot for slot in self.slots.values() if name in slot.spec.adapters), None)

    async def load_adapter(self, name: str, path: str, base: str | None = None) -> dict[str, Any]:
        """``POST /v1/load_lora_adapter``: serve the PEFT adapter at ``path`` as ``name`` on ``base``
        (default: the first model), loading the base model if needed. A bad adapter is a 400 and
        changes nothing."""
        taken = set(self.slots) | {a for slot in self.slots.values() for a in slot.spec.adapters}
        if not name or "=" in name:
            raise bad_request("lora_name must be a non-empty name without '='", "lora_name")
        if name in taken:
            raise bad_request(f"the name `{name}` is already served (a model or a LoRA adapter)", "lora_name")
        slot = self.resolve(base)
        lease = await self.acquire(slot)
        try:
            await asyncio.to_thread(lease.served.async_engine.engine.add_lora, name, path)
            slot.spec = slot.spec.with_adapters({**slot.spec.adapters, name: path})  # loaded again with the model
        finally:
            lease.release()
        self.on_event(f"loaded LoRA adapter {name} ({path}) on {slot.spec.name}")
        return {"lora_name": name, "lora_path": path, "base_model": slot.spec.name}

    def unload_adapter(self, name: str) -> dict[str, Any]:
        """``POST /v1/unload_lora_adapter``: stop serving ``name``; requests running with it finish."""
        slot = self.adapter_slot(name)
        if slot is None:
            raise APIError(404, f"no LoRA adapter named `{name}` is served", param="lora_name", code="model_not_found")
        adapters = slot.spec.adapters
        del adapters[name]
        slot.spec = slot.spec.with_adapters(adapters)
        if slot.served is not None:
            slot.served.async_engine.engine.remove_lora(name)
        self.on_event(f"unloaded LoRA adapter {name} from {slot.spec.name}")
        return {"lora_name": name, "unloaded": True}

    def loaded(self) -> list[ServedModel]:
        return [slot.served for slot in list(self.slots.values()) if slot.served is not None]

    # ---- start-up and shutdown --------------------------------------------------------------------
    def adopt(self, name: str, served: ServedModel) -> None:
        """A model loaded before the server started (``llmctl serve MODEL``)."""
        slot = self.slots[name]
        self._loaded(slot, served)

    def shutdown(self) -> None:
        for slot in self.slots.values():
            if slot.served is not None:
                slot.served.close()

    @property
    def in_flight(self) -> int:
        return sum(s.state.in_flight for s in self.loaded())

    @property
    def live(self) -> bool:
        return any(s.state.live for s in self.loaded())

    def cancel_all(self, message: str) -> int:
        return sum(s.state.cancel_all(message) for s in self.loaded())

    @property
    def rejected_queue_full(self) -> int:
        return sum(s.state.rejected_queue_full for s in self.loaded())

    def dead_error(self) -> BaseException | None:
        for served in self.loaded():
            if served.async_engine.error is not None:
                return served.async_engine.error
        return None

    # ---- requests ---------------------------------------------------------------------------------
    async def run(
        self,
        model: str | None,
        keep_alive: Any,
        call: Callable[[ServedModel], Awaitable[Any]],
        request: Request | None = None,
        *,
        ollama: bool = False,
    ) -> Any:
        """``call`` with ``model``'s loaded ``ServedModel``, the model held until the answer ends:
        a streamed response releases it when it closes, anything else when ``call`` returns."""
        slot = self.resolve(model, ollama)
        keep_alive_s = None if keep_alive is None else parse_keep_alive(keep_alive)
        lease = await self.acquire(slot, keep_alive_s)
        if request is not None:
            request.state.load_wait_s = lease.load_wait_s
        try:
            result = await call(lease.served)
        except BaseException:
            lease.release()
            raise
        if isinstance(result, EngineStreamResponse):
            close = result.on_close

            def on_close() -> None:
                try:
                    close()
                finally:
                    lease.release()

            result.on_close = on_close
        else:
            lease.release()
        return result

    async def acquire(self, slot: Slot, keep_alive_s: float | None = None) -> Lease:
        slot.in_flight += 1  # from here on the model is never unloaded under this request
        slot.timer_token += 1
        slot.expires_at = FOREVER
        started = time.monotonic()
        waited = False
        try:
            while slot.stopping:  # `stop --force` is taking it down: load it again after
                waited = True
                await asyncio.sleep(POLL_S)
            if slot.served is None:
                waited = True
                slot.waiting_for_load += 1
                try:
                    if slot.loading is None:
                        slot.loading = asyncio.ensure_future(self._load(slot))
                    await asyncio.shield(slot.loading)
                finally:
                    slot.waiting_for_load -= 1
        except BaseException:
            self._release(slot, None)
            raise
        wait_s = time.monotonic() - started
        if waited:
            self.load_wait.labels(slot.spec.name).observe(wait_s)
        slot.last_used = time.monotonic()
        return Lease(self, slot, keep_alive_s, wait_s if waited else 0.0)

    def _release(self, slot: Slot, keep_alive_s: float | None) -> None:
        slot.in_flight -= 1
        slot.last_used = time.monotonic()
        if keep_alive_s is not None and not slot.pinned:
            slot.current_keep_alive_s = keep_alive_s
        if slot.in_flight > 0 or slot.served is None:
            return
        keep = slot.keep_alive_s if (slot.pinned or slot.current_keep_alive_s is None) else slot.current_keep_alive_s
        slot.current_keep_alive_s = None if slot.pinned else keep
        slot.expires_at = slot.last_used + keep
        slot.timer_token += 1
        if keep == FOREVER:
            return
        token = slot.timer_token
        loop = asyncio.get_running_loop()
        loop.call_later(max(keep, 0.0), self._start_task, self._expire(slot, token))

    def _start_task(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _expire(self, slot: Slot, token: int) -> None:
        if slot.timer_token == token and slot.in_flight == 0 and slot.served is not None and not slot.stopping:
            await self._unload(slot, "expired")

    # ---- loading ----------------------------------------------------------------------------------
    async def _load(self, slot: Slot) -> None:
        if self._admit is None:
            self._admit = asyncio.Lock()
        try:
            async with self._admit:  # one load at a time; the loaded models go on serving
                if slot.served is not None:
                    return
                await self._make_room(slot)
                self.on_event(f"loading {slot.spec.name} ({slot.spec.source})")
                try:
                    served = await asyncio.to_thread(self.loader, slot.spec)
                except Exception as exc:  # noqa: BLE001 - told to this model's requests; the others go on
                    slot.load_failures += 1
                    slot.last_error = str(exc) or repr(exc)
                    self.on_event(f"{slot.spec.name} failed to load: {slot.last_error}")
                    raise APIError(
                        500,
                        f"the model `{slot.spec.name}` failed to load: {slot.last_error}",
                        type="server_error",
                        code="model_load_failed",
                    ) from None
                self._loaded(slot, served)
                self.on_event(f"loaded {slot.spec.name} in {served.load_s:.2f}s ({_mib(served.size_bytes)})")
                if self.memory_budget is not None:  # the estimate was low: make room now
                    while self._used_bytes() > self.memory_budget and (victim := self._lru_idle(slot)) is not None:
                        await self._unload(victim, "evicted")
        finally:
            slot.loading = None

    def _loaded(self, slot: Slot, served: ServedModel) -> None:
        slot.served = served
        slot.loads += 1
        slot.last_error = None
        slot.last_load_s = served.load_s
        slot.last_size = served.size_bytes
        slot.last_info = served.info.tag()
        slot.last_root = str(served.async_engine.engine.config.model)
        slot.last_max_model_len = served.serving.max_model_len
        slot.aliases |= served.serving.model_aliases
        slot.last_used = time.monotonic()

    def _used_bytes(self, exclude: Slot | None = None) -> int:
        return sum(s.served.size_bytes for s in self.slots.values() if s.served is not None and s is not exclude)

    def _lru_idle(self, exclude: Slot) -> Slot | None:
        idle = [
            s
            for s in self.slots.values()
            if s is not exclude and s.served is not None and s.in_flight == 0 and not s.stopping
        ]
        return min(idle, key=lambda s: s.last_used, default=None)

    async def _make_room(self, slot: Slot) -> None:
        if self.memory_budget is None:
            return
        need = slot.last_size if slot.last_size is not None else await asyncio.to_thread(self._estimate, slot)
        if need > self.memory_budget:
            raise APIError(
                503,
                f"the model `{slot.spec.name}` needs about {_mib(need)} (weights + KV pool), more than the "
                f"server's --memory-budget of {_mib(self.memory_budget)}: it can never be loaded here",
                type="server_error",
                code="model_too_large",
            )
        announced = False
        while self._used_bytes() + need > self.memory_budget:
            victim = self._lru_idle(slot)
            if victim is not None:
                await self._unload(victim, "evicted")
                continue
            if not announced:  # every model still loaded is busy: wait for one to finish
                announced = True
                self.on_event(f"{slot.spec.name} waits for memory: the loaded models are all busy")
            await asyncio.sleep(POLL_S)

    def _estimate(self, slot: Slot) -> int:
        """Bytes before a first load: the weight files, plus the KV pool its options give."""
        from llmctl.config import resolve_kv_cache_bytes
        from llmctl.model_spec import resolve_model

        config = slot.spec.config(self.base_config)
        try:
            path = Path(resolve_model(slot.spec.source, allow_pull=False))
        except Exception:  # noqa: BLE001 - the load will say why
            return 0
        if path.is_file():
            weights = path.stat().st_size
        elif path.is_dir():
            weights = sum(p.stat().st_size for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
        else:
            weights = 0
        try:
            kv = resolve_kv_cache_bytes(config, config.resolve_device())
        except Exception:  # noqa: BLE001
            kv = 0
        return weights + kv

    # ---- unloading --------------------------------------------------------------------------------
    async def _unload(self, slot: Slot, reason: str) -> None:
        served = slot.served
        if served is None:
            return
        slot.served = None  # no new request gets it from here on
        slot.expires_at = FOREVER
        slot.current_keep_alive_s = None
        slot.unloads[reason] = slot.unloads.get(reason, 0) + 1
        slot.stopping = True
        try:
            await asyncio.to_thread(served.close)
            del served
            await asyncio.to_thread(_release_freed_memory)
        finally:
            slot.stopping = False
        self.on_event(f"unloaded {slot.spec.name} ({reason})")

    async def stop(self, model: str, force: bool = False) -> dict[str, Any]:
        """``POST /v1/models/unload``: unload now. 409 with requests in flight, unless ``force``
        (they are cancelled: a stream ends with an error event, a whole answer is a 503)."""
        slot = self.resolve(model)
        if slot.served is None:
            return {"model": slot.spec.name, "unloaded": False, "aborted": 0, "status": slot.status}
        aborted = 0
        if slot.in_flight:
            if not force:
                raise APIError(
                    409,
                    f"the model `{slot.spec.name}` has {slot.in_flight} request(s) in flight "
                    "(wait for them, or stop it with --force to cancel them)",
                    type="invalid_request_error",
                    code="model_busy",
                )
            slot.stopping = True  # new requests wait, then load it again
            try:
                aborted = slot.served.state.cancel_all(f"the model `{slot.spec.name}` was stopped")
                deadline = time.monotonic() + FORCE_WAIT_S
                while slot.in_flight and time.monotonic() < deadline:
                    await asyncio.sleep(POLL_S)
            finally:
                slot.stopping = False
        await self._unload(slot, "stopped")
        return {"model": slot.spec.name, "unloaded": True, "aborted": aborted, "status": slot.status}

    # ---- status -----------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """``GET /v1/models/status``: what ``llmctl ps`` shows."""
        now = time.monotonic()
        models = []
        for slot in list(self.slots.values()):
            served = slot.served
            idle = slot.in_flight == 0 and served is not None
            keep = slot.current_keep_alive_s if slot.current_keep_alive_s is not None else slot.keep_alive_s
            models.append(
                {
                    "name": slot.spec.name,
                    "source": slot.spec.source,
                    "status": slot.status,
                    "loaded": served is not None,
                    "weights_bytes": served.weights_bytes if served else None,
                    "kv_bytes": served.kv_bytes if served else None,
                    "size_bytes": served.size_bytes if served else slot.last_size,
                    "in_flight": slot.in_flight,
                    "waiting_for_load": slot.waiting_for_load,
                    "idle_s": round(now - slot.last_used, 3) if idle else None,
                    "keep_alive_s": None if keep == FOREVER else keep,
                    "expires_in_s": None
                    if not idle or slot.expires_at == FOREVER
                    else round(max(slot.expires_at - now, 0.0), 3),
                    "pinned": slot.pinned,
                    "loads": slot.loads,
                    "load_failures": slot.load_failures,
                    "unloads": dict(slot.unloads),
                    "last_load_s": slot.last_load_s,
                    "last_error": slot.last_error,
                }
            )
        return {
            "models": models,
            "memory_budget_bytes": self.memory_budget,
            "memory_used_bytes": self._used_bytes(),
        }

    def expires_at_wall(self, slot: Slot) -> float | None:
        """When ``slot`` unloads, as a Unix time (None: never, or not idle yet)."""
        if slot.expires_at == FOREVER:
            return None
        return time.time() + (slot.expires_at - time.monotonic())

    # ---- /metrics ---------------------------------------------------------------------------------
    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _ManagerCollector(Collector):
    """Every loaded model's engine metrics (their families merged: one family per name, a sample
    per model) and the manager's own gauges and counters."""

    def __init__(self, manager: ModelManager) -> None:
        self.manager = manager

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for served in self.manager.loaded():
            for family in served.metrics.registry.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()
        slots = list(self.manager.slots.values())

        def gauge(name: str, doc: str, value: Callable[[Slot], float]) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            for slot in slots:
                family.add_metric([slot.spec.name], value(slot))
            return family

        def counter(name: str, doc: str, value: Callable[[Slot], float]) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            for slot in slots:
                family.add_metric([slot.spec.name], value(slot))
            return family

        yield gauge("model_loaded", "1 while the model is loaded.", lambda s: float(s.served is not None))
        yield gauge("model_loading", "1 while the model is loading.", lambda s: float(s.loading is not None))
        yield gauge(
            "model_requests_waiting_for_load", "Requests waiting for the model to load.", lambda s: s.waiting_for_load
        )
        yield gauge("model_requests_in_flight", "Requests holding the model.", lambda s: s.in_flight)
        yield gauge(
            "model_memory_bytes",
            "Weights + KV pool bytes of the loaded model (0 when unloaded).",
            lambda s: s.served.size_bytes if s.served is not None else 0,
        )
        yield counter("model_loads", "Times the model was loaded.", lambda s: s.loads)
        yield counter("model_load_failures", "Loads that failed.", lambda s: s.load_failures)
        unloads = CounterMetricFamily(
            PREFIX + "model_unloads", "Times the model was unloaded, by reason.", labels=["model_name", "reason"]
        )
        for slot in slots:
            for reason in ("expired", "evicted", "stopped"):
                unloads.add_metric([slot.spec.name, reason], slot.unloads.get(reason, 0))
        yield unloads


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def keep_alive_of(raw: bytes) -> Any:
    """The ``keep_alive`` field of a JSON body (OpenAI clients send it in ``extra_body``), or None;
    the body itself is validated by the route."""
    if b'"keep_alive"' not in raw:
        return None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return data.get("keep_alive") if isinstance(data, dict) else None
