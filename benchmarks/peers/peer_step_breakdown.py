"""Where the peer workload's time goes in llmctl (64 requests x 128 random prompt ids -> 128
tokens, greedy, the model of benchmarks/peers/peer_workload.py): CPU time of every engine step split into
prefill (and mixed) steps and decode-only steps, then, through the Python module path
(``LLMCTL_DECODE_LOOP=0``, so that each kernel call can be timed), a per-op breakdown of chosen
steps: the GEMMs by shape, prefill and decode attention, norms, rotary, SiLU-and-mul, KV store, and
the rest (embedding, LM head, Python). Also the step's system time and page faults.

One thread by default and CPU time (``time.process_time``): on a machine shared with other work the
CPU time of one thread is what compares two versions fairly; ``--threads 2`` times wall clock.

    python -m benchmarks.peers.peer_step_breakdown MODEL [--steps 0,4,60] [--threads 1] [--dtype float32]
        [--quantization none|int8|int4|fp8|auto]
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import statistics
import time

os.environ.setdefault("LLMCTL_DECODE_LOOP", "0")  # before llmctl reads it: per-op timing needs the module path

import torch  # noqa: E402

import llmctl.layers.linear as linear_module  # noqa: E402
from benchmarks.peers.peer_workload import OUT_LEN, make_prompts  # noqa: E402
from llmctl.engine.llm_engine import LLMEngine  # noqa: E402
from llmctl.layers.ops import TorchOps  # noqa: E402
from llmctl.layers.quantization.methods import PackedLinearMethod  # noqa: E402
from llmctl.sampling_params import SamplingParams  # noqa: E402

OPS = ("rms_norm", "rotary_embedding", "silu_and_mul", "store_kv", "prefill_attention", "decode_attention")


class OpClock:
    """Accumulates the time of wrapped calls by name, for the current step."""

    def __init__(self, clock) -> None:
        self.clock, self.total, self.count = clock, collections.defaultdict(float), collections.Counter()

    def wrap(self, name_of, fn):
        def timed(*args, **kwargs):
            start = self.clock()
            result = fn(*args, **kwargs)
            name = name_of(*args, **kwargs)
            self.total[name] += self.clock() - start
            self.count[name] += 1
            return result

        return timed


def gemm_name(x, weight, bias=None, out_features=None) -> str:
    rows = x.numel() // x.shape[-1]
    return f"GEMM {x.shape[-1]} -> {out_features or weight.shape[0]}, {'M > 100' if rows > 100 else f'M = {rows}'}"


def packed_gemm_name(method, layer, x, bias=None) -> str:
    return f"{layer.packed_format} {gemm_name(x, layer.qweight)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", default="0,4,60", help="steps to break down by op")
    parser.add_argument("--quantization", default=None, help="none | int8 | int4 | fp8 | auto (the engine's default)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    ops = OpClock(clock)
    linear_module.linear = ops.wrap(gemm_name, linear_module.linear)
    PackedLinearMethod.apply = ops.wrap(packed_gemm_name, PackedLinearMethod.apply)
    for name in OPS:
        setattr(TorchOps, name, ops.wrap(lambda *a, _n=name, **k: _n, getattr(TorchOps, name)))
    engine = LLMEngine(
        model=args.model,
        dtype=args.dtype,
        skip_tokenizer=True,
        max_model_len=512,
        max_num_seqs=64,
        kv_cache_memory=4 << 30,
        **({} if args.quantization is None else {"quantization": args.quantization}),
    )
    prompts = make_prompts()
    engine.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    from llmctl_kernels.cpu_features import cpu_model, isa_level

    print(
        f"{args.model} · {engine.dtype} · {engine.ops.description} · ISA {isa_level()} · {cpu_model()} · "
        f"{args.threads} thread(s) · {'CPU' if args.threads == 1 else 'wall'} time · "
        f"load {' '.join(open('/proc/loadavg').read().split()[:3])}"
    )
    show = {int(s) for s in args.steps.split(",") if s}
    runner, execute, steps = engine.runner, engine.runner.execute, []

    def timed_execute(sched):
        ops.total.clear()
        ops.count.clear()
        usage, start = resource.getrusage(resource.RUSAGE_SELF), clock()
        out = execute(sched)
        took, after = clock() - start, resource.getrusage(resource.RUSAGE_SELF)
        prefill = sum(item.num_new_tokens for item in sched.prefills)
        steps.append((prefill, len(sched.decodes), took))
        if len(steps) - 1 in show:
            print(
                f"\n--- step {len(steps) - 1}: {prefill} prefill tokens, {len(sched.decodes)} decode rows: "
                f"{took * 1000:.0f} ms (system {1000 * (after.ru_stime - usage.ru_stime):.0f} ms, "
                f"{after.ru_minflt - usage.ru_minflt} page faults)"
            )
            for name, spent in sorted(ops.total.items(), key=lambda kv: -kv[1]):
                print(f"  {name:34s} {spent * 1000:8.1f} ms  {100 * spent / took:5.1f} %  x{ops.count[name]}")
            rest = took - sum(ops.total.values())
            print(f"  {'rest (embedding, LM head, Python)':34s} {rest * 1000:8.1f} ms  {100 * rest / took:5.1f} %")
        return out

    runner.execute = timed_execute
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=OUT_LEN, ignore_eos=True))
    wall = time.perf_counter() - start
    prefill = [s for s in steps if s[0] > 0]
    decode = [s for s in steps if s[0] == 0]
    print(
        f"\nwhole run: {wall:.1f} s wall ({len(prompts) * OUT_LEN / wall:.1f} out tok/s with per-op timing on); "
        f"model steps {sum(s[2] for s in steps):.1f} s"
    )
    print(
        f"  {len(prefill)} steps with prefill: {sum(s[2] for s in prefill):.1f} s "
        f"({', '.join(f'{p}+{d}: {t:.1f} s' for p, d, t in prefill)})"
    )
    print(
        f"  {len(decode)} decode-only steps: {sum(s[2] for s in decode):.1f} s, median "
        f"{1000 * statistics.median(s[2] for s in decode):.0f} ms"
    )


if __name__ == "__main__":
    main()
