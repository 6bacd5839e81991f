"""The same batched load stepped from three places: the main thread, a second thread, and
``AsyncEngine`` (what ``llmctl bench``, ``serve`` and ``top`` do). Wall time, CPU time and output
tok/s for each; the CPU time says whether the cores were busy or waiting.

    python -m benchmarks.features.engine_thread [MODEL] [--quantization none] [--modes main thread async]

64 requests of 128 random prompt ids -> 128 tokens (greedy, ignore EOS), after a 4-token warm-up
request. Each mode loads its own engine in the main thread, as the CLI does. Why it exists: a
second OpenMP pool made the engine thread ~25 % slower (llmctl/engine/openmp.py).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time

import torch

from llmctl.engine.async_engine import AsyncEngine
from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams

REQUESTS, PROMPT_LEN, OUTPUT_LEN = 64, 128, 128


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 30000) for _ in range(PROMPT_LEN)] for _ in range(REQUESTS)]


def step_all(engine: LLMEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    for prompt in prompts():
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()


def warm_up(engine: LLMEngine) -> None:
    engine.generate([list(range(100, 116))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))


def run_sync(engine: LLMEngine, in_thread: bool) -> tuple[float, float]:
    def body() -> None:
        warm_up(engine)
        start, cpu = time.perf_counter(), time.process_time()
        step_all(engine)
        timing.extend([time.perf_counter() - start, time.process_time() - cpu])

    timing: list[float] = []
    if in_thread:
        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
    else:
        body()
    return timing[0], timing[1]


def run_async(engine: LLMEngine) -> tuple[float, float]:
    async_engine = AsyncEngine(engine).start()
    params = SamplingParams(temperature=0, max_tokens=OUTPUT_LEN, ignore_eos=True)

    async def one(prompt: list[int], sampling: SamplingParams) -> None:
        async for _ in async_engine.generate(prompt, sampling):
            pass

    async def main() -> tuple[float, float]:
        await one(list(range(100, 116)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        start, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one(prompt, params) for prompt in prompts()))
        return time.perf_counter() - start, time.process_time() - cpu

    try:
        return asyncio.run(main())
    finally:
        async_engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2-135m")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--modes", nargs="+", default=["main", "thread", "async"], choices=["main", "thread", "async"])
    args = parser.parse_args()
    print(
        f"{args.model} · quantization {args.quantization} · {torch.get_num_threads()} torch threads · "
        f"{REQUESTS} x {PROMPT_LEN} -> {OUTPUT_LEN}"
    )
    for mode in args.modes:
        engine = LLMEngine(model=args.model, quantization=args.quantization, skip_tokenizer=True)
        wall, cpu = run_async(engine) if mode == "async" else run_sync(engine, in_thread=mode == "thread")
        print(
            f"{mode:7s} wall {wall:6.1f} s  CPU {cpu:6.1f} s  {REQUESTS * OUTPUT_LEN / wall:6.1f} output tok/s",
            flush=True,
        )


if __name__ == "__main__":
    main()
