"""Multi-LoRA serving through ``llmctl serve``: 64 concurrent requests spread over 4 adapters
against the same load on the base model alone, and time to first token for a cold model (loaded
by its first request) against a warm one.

The base model has SmolLM2-135M's layer shape (30 layers, hidden 576, 9 heads / 3 KV heads, MLP
1536) with **random weights** and stories260k's 512-token vocabulary and tokenizer (the vocabulary
changes only the embedding and LM head); the 4 adapters are random PEFT LoRA adapters of rank 16
on every projection (q, k, v, o, gate, up, down), made with ``peft``. Requests are completions of
``--input-len`` random tokens for ``--output-len`` tokens, all sent at once, streamed; output tok/s
is generated tokens over the wall time of the whole run.

usage: python -m benchmarks.features.lora_serving [--work DIR] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from benchmarks.harness import cpu_line, write_result

STORIES = Path(__file__).resolve().parents[2].parent / "shared" / "models" / "stories260k"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")
ADAPTERS = 4
READY = re.compile(r"llmctl serve: .* at (http://\S+)/v1")


def build(work: Path) -> tuple[Path, list[Path]]:
    """The base model and its adapters (built once into ``work``)."""
    base = work / "base"
    adapters = [work / f"lora{i}" for i in range(ADAPTERS)]
    if (base / "config.json").is_file() and all((a / "adapter_config.json").is_file() for a in adapters):
        return base, adapters
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(base)
    for name in TOKENIZER_FILES:
        shutil.copy(STORIES / name, base / name)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for i, path in enumerate(adapters):
        torch.manual_seed(100 + i)
        lora = LoraConfig(r=16, lora_alpha=32, target_modules=targets, init_lora_weights=False)
        get_peft_model(LlamaForCausalLM(config), lora).save_pretrained(path)
    return base, adapters


class Server:
    def __init__(self, args: list[str], log: Path) -> None:
        self._log = open(log, "wb")
        cmd = [sys.executable, "-m", "llmctl.cli", "serve", *args, "--port", "0", "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT)
        self.log_path = log
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if (found := READY.search(log.read_text(errors="replace"))) is not None:
                self.url = found.group(1)
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"llmctl serve did not start:\n{log.read_text(errors='replace')}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=120)
        self._log.close()


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """(time to first token, tokens) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    body["temperature"] = 0
    started, first, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:])["choices"][0].get("text") is not None:
                tokens += 1
                first = first or time.perf_counter() - started
    return first or 0.0, tokens


async def load(url: str, models: list[str], concurrency: int, input_len: int, output_len: int) -> dict:
    """All requests at once, model i % len(models) for request i; output tok/s over the run."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (input_len,), generator=gen).tolist() for _ in range(concurrency)]
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=concurrency)) as client:
        await one(client, url, models[0], prompts[0][:8], 4)  # warm-up
        started = time.perf_counter()
        results = await asyncio.gather(
            *(one(client, url, models[i % len(models)], p, output_len) for i, p in enumerate(prompts))
        )
        wall = time.perf_counter() - started
    tokens = sum(n for _, n in results)
    ttfts = sorted(t for t, _ in results)
    return {"output_tok_s": tokens / wall, "wall_s": wall, "median_ttft_s": ttfts[len(ttfts) // 2], "tokens": tokens}


async def ttft(url: str, model: str) -> float:
    async with httpx.AsyncClient(timeout=None) as client:
        first, _ = await one(client, url, model, list(range(10, 42)), 4)
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path.home() / ".cache" / "llmctl-bench" / "lora")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    base, adapters = build(args.work)
    names = [f"lora{i}" for i in range(ADAPTERS)]
    common = ["--threads", str(args.threads), "--kv-cache-memory", "2GiB", "--dtype", "float32"]
    lora_args = ["--lora-modules", *(f"{n}={p}" for n, p in zip(names, adapters)), "--max-loras", str(ADAPTERS)]
    print(cpu_line())
    server = Server([str(base), "--served-model-name", "base", *common, *lora_args], args.work / "serve.log")
    try:
        only_base = asyncio.run(load(server.url, ["base"], args.concurrency, args.input_len, args.output_len))
        spread = asyncio.run(load(server.url, names, args.concurrency, args.input_len, args.output_len))
    finally:
        server.stop()
    ratio = spread["output_tok_s"] / only_base["output_tok_s"]
    base_ttft = only_base["median_ttft_s"]
    print(f"base model alone:  {only_base['output_tok_s']:.1f} output tok/s (median TTFT {base_ttft:.2f} s)")
    print(f"over {ADAPTERS} adapters:  {spread['output_tok_s']:.1f} output tok/s ({ratio:.2f}x the base alone)")
    # cold vs warm: two models behind one server, the second loaded by its first request
    server = Server([f"warm={base}", f"cold={base}", *common], args.work / "serve_two.log")
    try:
        asyncio.run(ttft(server.url, "warm"))  # loads "warm"
        warm = asyncio.run(ttft(server.url, "warm"))
        cold = asyncio.run(ttft(server.url, "cold"))
    finally:
        server.stop()
    print(f"time to first token: warm {warm * 1000:.0f} ms, cold (the request loads the model) {cold * 1000:.0f} ms")
    write_result(
        {
            "date": datetime.date.today().isoformat(),
            "concurrency": args.concurrency,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "base_only": only_base,
            "over_adapters": spread,
            "ratio": ratio,
            "ttft_warm_s": warm,
            "ttft_cold_s": cold,
        },
        args.work / "lora_serving.json",
    )


if __name__ == "__main__":
    main()
