"""llama.cpp's ``llama-server`` as a second oracle for GGUF files: the top-N log-probabilities of its
greedy continuation, next to llmctl's for the same tokens on the same file.

llama-server leaves out the probabilities of a token after which the generated text ends in an
incomplete UTF-8 sequence (a byte-fallback token, frequent in the tiny random models), so the
tokens it reports (``return_tokens``) are matched to its probability entries by replaying its
check (``validate_utf8``) on the tokens' bytes from the file's vocabulary.

The binary is ``$LLMCTL_TEST_LLAMA_SERVER``, else the one ../shared/peer/build_llama_cpp.sh builds
(``DEFAULT_BINARY``). The server runs on 127.0.0.1 with one slot, a float32 KV cache (its default
f16 cache would round what both sides compute in fp32), no prompt cache, and is stopped by its pid.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ENV = "LLMCTL_TEST_LLAMA_SERVER"
# a short prompt and one past Phi-3's original 32 positions (and the sliding windows of the cases)
PROMPTS = [[5, 17, 42, 8], list(range(40, 110))]


def oracle_prompts(case: str) -> list[list[int]]:
    """The prompts a case is compared on. Phi-3: the long one only, since llama.cpp picks LongRoPE's
    long factors by its context size (512 here, past the original 32) while llmctl, like
    transformers, uses the short ones until a sequence passes the original length."""
    return PROMPTS[1:] if case == "phi3" else PROMPTS


DEFAULT_BINARY = Path.home() / ".cache" / "llmctl-peer" / "llama.cpp" / "build" / "bin" / "llama-server"


def configured_binary() -> Path | None:
    """The binary to use: ``$LLMCTL_TEST_LLAMA_SERVER`` when set (whether or not it exists, so a
    wrong path fails the tests), else ``DEFAULT_BINARY`` when built, else None."""
    if env := os.environ.get(ENV):
        return Path(env)
    return DEFAULT_BINARY if DEFAULT_BINARY.is_file() else None


def llama_cpp_version(binary: Path) -> str:
    """``llama-server --version``'s build line (e.g. ``version: 1 (abc123)``)."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("version")]
    return lines[0] if lines else "unknown"


@dataclass
class Step:
    """One greedy step: the token chosen, its log-probability, and the top-N ``{id: logprob}``."""

    token: int
    logprob: float
    top: dict[int, float]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


@contextmanager
def llama_server(binary: Path, model: Path, threads: int = 2, timeout_s: float = 120.0) -> Iterator[str]:
    """A running ``llama-server`` for ``model``; yields its base URL."""
    if not binary.is_file():
        raise FileNotFoundError(
            f"{ENV}={binary}: no llama-server there (build it with ../shared/peer/build_llama_cpp.sh)"
        )
    port = _free_port()
    args = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", "1", "-c", "512"]
    args += ["-t", str(threads), "--cache-type-k", "f32", "--cache-type-v", "f32", "--no-warmup", "-fa", "off"]
    log = open(model.with_suffix(".llama-server.log"), "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({proc.returncode}): {log.name}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"llama-server not ready after {timeout_s} s: {log.name}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def token_bytes(model: Path) -> list[bytes]:
    """Each token's text as llama.cpp renders it, from the GGUF vocabulary (``llama``: SentencePiece
    pieces with ``<0xXX>`` bytes; ``gpt2``: byte-level BPE), control tokens empty."""
    from gguf import GGUFReader

    fields = GGUFReader(model).fields
    kind = fields["tokenizer.ggml.model"].contents()
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    if kind == "gpt2":
        printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
        codes = printable + [256 + n for n in range(256 - len(printable))]
        decoder = dict(zip(map(chr, codes), [*printable, *(b for b in range(256) if b not in printable)]))
    out = []
    for text, kind_of in zip(tokens, types):
        if kind_of == 3:  # CONTROL
            out.append(b"")
        elif kind == "gpt2":
            # a character outside the byte map is written as "[UNK_BYTE_0x..]": complete text
            out.append(b"".join(bytes([decoder[c]]) if c in decoder else b"[UNK]" for c in text))
        elif kind_of == 6:  # BYTE: <0xXX>
            out.append(bytes([int(text[3:5], 16)]))
        else:
            out.append(text.replace("\u2581", " ").encode())
    return out


def _complete_utf8(text: bytes) -> bool:
    """llama-server's ``validate_utf8(text) == len(text)``: no multi-byte sequence cut off at the end."""
    for i in range(1, min(4, len(text)) + 1):
        c = text[-i]
        if (c & 0xE0 == 0xC0 and i < 2) or (c & 0xF0 == 0xE0 and i < 3) or (c & 0xF8 == 0xF0 and i < 4):
            return False
    return True


def greedy_top_logprobs(url: str, prompt: list[int], n_predict: int, n_probs: int, vocab: list[bytes]) -> list[Step]:
    """llama-server's greedy continuation of ``prompt`` (token ids, used as given) with the top
    ``n_probs`` log-probabilities before sampling at each step (``Step.top`` empty where the server
    leaves them out, module docstring)."""
    body = {
        "prompt": prompt,
        "n_predict": n_predict,
        "n_probs": n_probs,
        "post_sampling_probs": False,
        "temperature": 0.0,
        "cache_prompt": False,
        "id_slot": 0,
        "return_tokens": True,
    }
    out = _post(f"{url}/completion", body)
    entries = iter(out.get("completion_probabilities", []))  # absent when every step was left out
    steps, text = [], b""
    for token in out["tokens"][:n_predict]:
        text += vocab[token]
        if not _complete_utf8(text):
            steps.append(Step(token, float("nan"), {}))
            continue
        entry = next(entries)
        if int(entry["id"]) != token:
            raise AssertionError(f"llama-server's probabilities are for token {entry['id']}, not {token}")
        top = {int(t["id"]): float(t["logprob"]) for t in entry["top_logprobs"]}
        steps.append(Step(token, float(entry["logprob"]), top))
    return steps


def max_logprob_difference(theirs: list[Step], top: list[dict[int, float]]) -> float:
    """The largest |llama.cpp - llmctl| log-probability over every step's top-N tokens (the ids in
    both lists, the chosen one among them); the caller checks first that the tokens are the same."""
    worst = 0.0
    for step, ours in zip(theirs, top):
        common = set(step.top) & set(ours)
        worst = max([worst, *(abs(step.top[i] - ours[i]) for i in common)])
    return worst


def llmctl_greedy_top_logprobs(model: Path, prompt: list[int], n_predict: int, n_probs: int) -> list[Step]:
    """llmctl's greedy continuation of ``prompt`` on the same file (fp32, CPU), in the same form."""
    from llmctl.engine.llm_engine import LLMEngine
    from llmctl.sampling_params import SamplingParams

    engine = LLMEngine(model=str(model), skip_tokenizer=True, dtype="float32", kv_cache_memory=8 << 20)
    params = SamplingParams(temperature=0, max_tokens=n_predict, ignore_eos=True, logprobs=n_probs)
    (out,) = engine.generate([prompt], params)
    sample = out.outputs[0]
    return [Step(t, lp, dict(top)) for t, lp, top in zip(sample.token_ids, sample.logprobs, sample.top_logprobs)]


@dataclass
class Comparison:
    """llama.cpp and llmctl on one file, per prompt: the greedy tokens of each (llama.cpp's end at
    EOS, llmctl's are compared up to there); the largest |log-probability difference| over the
    top-N tokens of every step up to the first where the tokens differ; and ``tie_gap``, None when
    no token differs, else the largest gap, in either engine, between the two candidates at a
    step where they part (a near tie is one within the log-probability tolerance)."""

    theirs: list[list[int]]
    ours: list[list[int]]
    max_delta: float
    tie_gap: float | None


def _gap(step: Step, other: int) -> float | None:
    """How far ``other`` trails the chosen token in ``step``'s top-N: inf when it is not there, None
    when the step has no top-N (llama-server left it out)."""
    if not step.top:
        return None
    return step.top[step.token] - step.top[other] if other in step.top else float("inf")


def compare_with_llama_cpp(
    binary: Path,
    model: Path,
    prompts: list[list[int]] = PROMPTS,
    n_predict: int = 16,
    n_probs: int = 5,
    ours_model: Path | None = None,
) -> Comparison:
    """llama-server on ``model`` against llmctl on the same file, or on ``ours_model`` (the same
    values in another file)."""
    theirs, ours, worst, tie_gap = [], [], 0.0, None
    vocab = token_bytes(model)
    with llama_server(binary, model) as url:
        for prompt in prompts:
            steps = greedy_top_logprobs(url, prompt, n_predict, n_probs, vocab)
            mine = llmctl_greedy_top_logprobs(ours_model or model, prompt, n_predict, n_probs)[: len(steps)]
            theirs.append([s.token for s in steps])
            ours.append([s.token for s in mine])
            part = next((i for i, (a, b) in enumerate(zip(steps, mine)) if a.token != b.token), None)
            upto = len(steps) if part is None else part + 1
            worst = max(worst, max_logprob_difference(steps[:upto], [s.top for s in mine[:upto]]))
            if part is not None:
                a, b = steps[part], mine[part]
                gaps = [g for g in (_gap(a, b.token), _gap(b, a.token)) if g is not None]
                tie_gap = max(tie_gap or 0.0, *gaps)
    return Comparison(theirs, ours, worst, tie_gap)
