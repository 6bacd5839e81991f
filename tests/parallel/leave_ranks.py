"""Run under torchrun by ``test_parallel_launch``: join the process groups as an engine does, run
collectives on them, leave as every rank does at exit, then write the names of this process's
threads. Usage: torchrun ... leave_ranks.py TP PP OUT (writes OUT.<rank>)."""

from __future__ import annotations

import json
import os
import sys

import torch

from llmctl.config import EngineConfig
from llmctl.parallel.topology import init_parallel, leave_process_group


def main() -> None:
    tp, pp, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    config = EngineConfig(model="unused", tensor_parallel_size=tp, pipeline_parallel_size=pp, device="cpu")
    ctx = init_parallel(config, num_layers=2)
    for i in range(20):
        ctx.agree_min(i)
        ctx.tp.all_reduce(torch.ones(4))
    leave_process_group()
    threads = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    with open(f"{out}.{ctx.rank}", "w") as f:
        json.dump(threads, f)


if __name__ == "__main__":
    main()
