"""torchrun's agent with llmctl's way of ending: one line naming the rank that failed first (after
torchrun's own report), or the signal that stopped every rank, instead of the agent's traceback.

``python -m llmctl.parallel.agent`` takes torchrun's arguments; ``llmctl.parallel.launch`` execs it.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    try:
        run(get_args_parser().parse_args(argv))
    except SignalException as exc:  # Ctrl-C / SIGTERM: the agent has stopped every rank
        sys.stderr.write(f"llmctl: {exc.sigval.name} received; every rank was stopped\n")
        return 128 + int(exc.sigval)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        sys.stderr.write(
            f"{exc.format_msg()}\nllmctl: rank {rank} failed first ({how}, pid {failure.pid}); every rank was stopped\n"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
