"""llmctl pull / ls / rm against a hub-compatible server on 127.0.0.1 (tests/hub_server.py).

The server serves generated Llama models (transformers ``save_pretrained``) and the real
stories260k model read in place from ../shared; ``HF_ENDPOINT`` points at it and the HF cache is
a temporary directory. What is checked is what the server saw (requests, Range headers,
Authorization) and what ended up in the cache (bytes, checksums, symlinks, refs).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from hub_server import HubServer, closed_port_url
from rich.console import Console
from typer.testing import CliRunner

from llmctl import hub
from llmctl.errors import HubError, LlmctlError, ModelNotFoundError

REPO_ROOT = Path(__file__).resolve().parents[2]
STORIES_DIR = REPO_ROOT.parent / "shared" / "models" / "stories260k"
STORIES_ID = "llmctl-test/stories260k"
TINY = "llmctl-test/tiny"
SHARDED = "llmctl-test/sharded"
BIG = "llmctl-test/big"
GATED = "llmctl-test/gated"
MAMBA = "llmctl-test/mamba"
GATED_TOKEN = "hf_llmctl_test_token"

TINY_INFERENCE_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
]
NOT_FOR_INFERENCE = {
    "README.md": b"# tiny\n",
    ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
    "pytorch_model.bin": os.urandom(4096),
    "model.onnx": os.urandom(2048),
    "onnx/model.onnx": os.urandom(2048),
    "original/consolidated.00.pth": os.urandom(1024),
    "LICENSE": b"MIT\n",
}


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


def _write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(61)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"})
    )
    (directory / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def _safetensors_numel(files: list[Path]) -> int:
    """Parameter count through the safetensors library (independent of llmctl's header parser)."""
    from safetensors import safe_open

    total = 0
    for path in files:
        with safe_open(str(path), framework="numpy") as f:
            for key in f.keys():
                total += math.prod(f.get_slice(key).get_shape())
    return total


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Tiny Llama checkpoints written by transformers (bf16 tiny, a v1 variant, a sharded one, a 17 MB f32 one)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("hub-models")
    torch.manual_seed(0)

    def build(name: str, *, dtype: torch.dtype, shard: str | None = None, **overrides) -> dict:
        params = dict(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        )
        params.update(overrides)
        model = LlamaForCausalLM(LlamaConfig(**params)).to(dtype)
        directory = root / name
        kwargs = {"max_shard_size": shard} if shard else {}
        model.save_pretrained(directory, **kwargs)
        _write_tokenizer(directory)
        return {"dir": directory, "num_parameters": model.num_parameters()}

    built = {
        "tiny": build("tiny", dtype=torch.bfloat16),
        "tiny_v1": build("tiny_v1", dtype=torch.bfloat16, num_hidden_layers=1),
        "sharded": build("sharded", dtype=torch.bfloat16, shard="20KB", tie_word_embeddings=False),
        "big": build(
            "big",
            dtype=torch.float32,
            vocab_size=16384,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=1,
            tie_word_embeddings=False,
        ),
    }
    assert (built["sharded"]["dir"] / "model.safetensors.index.json").is_file(), "expected a sharded checkpoint"
    assert (built["big"]["dir"] / "model.safetensors").stat().st_size > 12_000_000  # > http_get's 10 MB chunk
    return built


@pytest.fixture
def server(models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A fresh hub on 127.0.0.1 with HF_ENDPOINT pointing at it and an empty HF cache."""
    hub_server = HubServer()
    hub_server.add_repo(TINY, models["tiny"]["dir"], extra=NOT_FOR_INFERENCE)
    hub_server.add_repo(TINY, models["tiny_v1"]["dir"], revision="v1")
    sharded_dir = models["sharded"]["dir"]
    first_shard = sorted(sharded_dir.glob("model-*.safetensors"))[0]
    hub_server.add_repo(SHARDED, sharded_dir, extra={"consolidated.safetensors": first_shard.read_bytes()})
    hub_server.add_repo(BIG, models["big"]["dir"])
    hub_server.add_repo(GATED, models["tiny"]["dir"], gated_token=GATED_TOKEN)
    hub_server.add_repo("llmctl-test/bin-only", None, extra={"config.json": b"{}", "pytorch_model.bin": b"x" * 64})
    mamba_config = json.dumps({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}).encode()
    tiny_weights = (models["tiny"]["dir"] / "model.safetensors").read_bytes()
    hub_server.add_repo(MAMBA, None, extra={"config.json": mamba_config, "model.safetensors": tiny_weights})
    if (STORIES_DIR / "model.safetensors").is_file():
        hub_server.add_repo(STORIES_ID, STORIES_DIR)  # read in place, never copied
    hub_server.start()
    monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in (
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HUGGINGFACE_HUB_CACHE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    yield hub_server
    hub_server.stop()


@pytest.fixture
def cli() -> typer.Typer:
    app = typer.Typer()
    hub.register_hub_commands(app)
    return app


def _console() -> tuple[Console, io.StringIO]:
    buf = io.StringIO()
    return Console(file=buf, width=140, force_terminal=False, color_system=None), buf


def _commit(server: HubServer, repo_id: str, revision: str = "main") -> str:
    return server.repos[repo_id].revisions[revision].commit


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _downloads(server: HubServer) -> list:
    """File transfers (GET on /resolve/), in order."""
    return [r for r in server.requests("GET") if "/resolve/" in r.path]


def _invoke(cli: typer.Typer, *args: str):
    return CliRunner().invoke(cli, list(args), env={"COLUMNS": "200"})


# ---------------------------------------------------------------------------------------------
# Pure helpers
# ---------------------------------------------------------------------------------------------


def test_parse_model_ref() -> None:
    assert hub.parse_model_ref("org/name@rev") == ("org/name", "rev")
    assert hub.parse_model_ref("org/name") == ("org/name", None)
    assert hub.parse_model_ref("hf://org/name@v1.0") == ("org/name", "v1.0")
    assert hub.parse_model_ref("https://huggingface.co/org/name") == ("org/name", None)
    assert hub.parse_model_ref("org/name@refs/pr/1") == ("org/name", "refs/pr/1")
    with pytest.raises(ModelNotFoundError, match="empty revision"):
        hub.parse_model_ref("org/name@")


def test_select_inference_files() -> None:
    files = [
        ".gitattributes",
        "README.md",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "pytorch_model.bin",
        "model.onnx",
        "onnx/model.onnx",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tf_model.h5",
        "original/consolidated.00.pth",
        "LICENSE",
    ]
    assert hub.select_inference_files(files) == [
        "model.safetensors",
        "generation_config.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "config.json",
    ]
    sharded = [
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "consolidated.safetensors",
        "tokenizer.model",
    ]
    assert hub.select_inference_files(
        sharded, ["model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors"]
    ) == [
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "tokenizer.model",
        "config.json",
    ]


# ---------------------------------------------------------------------------------------------
# pull
# ---------------------------------------------------------------------------------------------


def test_pull_fetches_only_inference_files_with_progress(server: HubServer, models) -> None:
    console, buf = _console()
    snapshot = hub.pull(TINY, console=console)

    commit = _commit(server, TINY)
    assert snapshot == hub.hub_cache_dir() / "models--llmctl-test--tiny" / "snapshots" / commit
    assert sorted(p.name for p in snapshot.iterdir()) == TINY_INFERENCE_FILES
    for name in TINY_INFERENCE_FILES:  # the bytes the hub serves, linked into the standard cache layout
        assert (snapshot / name).read_bytes() == (models["tiny"]["dir"] / name).read_bytes(), name
        assert (snapshot / name).is_symlink()
    weights = snapshot / "model.safetensors"
    assert os.readlink(weights) == f"../../blobs/{_sha256(weights)}"  # LFS blobs are named by sha256
    assert (snapshot.parent.parent / "refs" / "main").read_text() == commit

    touched = {r.path.rsplit("/resolve/", 1)[1].split("/", 1)[1] for r in server.log if "/resolve/" in r.path}
    assert touched == set(TINY_INFERENCE_FILES)  # README, *.bin, *.onnx, sub-folders: never even HEAD-ed
    assert sorted(r.path.rsplit("/", 1)[1] for r in _downloads(server)) == sorted(TINY_INFERENCE_FILES)

    out = buf.getvalue()
    assert f"Pulling {TINY}@main (commit {commit[:12]})" in out
    assert "6 file(s) to download" in out
    for name in TINY_INFERENCE_FILES:
        assert re.search(rf"✓ {re.escape(name)}\s.*100%", out), f"no finished bar for {name}:\n{out}"
    # Real byte counts: the overall bar ends at the sum of the file sizes, each file bar at its size.
    total_kb = f"{sum((snapshot / n).stat().st_size for n in TINY_INFERENCE_FILES) / 1000:.1f}"
    weights_kb = f"{weights.stat().st_size / 1000:.1f}"
    assert re.search(rf"{TINY}@main\s.*100%\s+{total_kb}/{total_kb} kB", out), out
    assert re.search(rf"✓ model\.safetensors\s.*100%\s+{weights_kb}/{weights_kb} kB", out), out


def test_pull_revision_tag_and_commit(server: HubServer, models) -> None:
    v1 = _commit(server, TINY, "v1")
    main = _commit(server, TINY, "main")
    assert v1 != main

    snapshot = hub.pull(f"{TINY}@v1", progress=False)
    assert snapshot.name == v1
    assert json.loads((snapshot / "config.json").read_text())["num_hidden_layers"] == 1
    storage = snapshot.parent.parent
    assert (storage / "refs" / "v1").read_text() == v1
    assert not (storage / "refs" / "main").exists()
    assert hub.find_cached_snapshot(TINY, "v1") == snapshot
    assert hub.find_cached_snapshot(TINY, v1[:10]) == snapshot
    assert hub.find_cached_snapshot(TINY, "main") is None

    main_snapshot = hub.pull(TINY, progress=False)
    assert main_snapshot.name == main
    assert hub.find_cached_snapshot(TINY) == main_snapshot

    server.clear_log()
    assert hub.pull(f"{TINY}@{main}", progress=False) == main_snapshot
    assert server.log == []  # a full commit hash that is cached needs no network at all

    rows = {m.revision: m for m in hub.list_models() if m.repo_id == TINY}
    assert set(rows) == {"main", "v1"}
    assert rows["main"].num_parameters == models["tiny"]["num_parameters"]
    assert rows["v1"].num_parameters == models["tiny_v1"]["num_parameters"]

    freed = hub.remove(f"{TINY}@v1")
    assert freed > 0
    assert [m.revision for m in hub.list_models()] == ["main"]
    assert hub.find_cached_snapshot(TINY) == main_snapshot  # blobs shared with main (tokenizer) are kept
    assert (main_snapshot / "tokenizer.json").read_bytes() == (models["tiny"]["dir"] / "tokenizer.json").read_bytes()


def test_cached_model_is_not_downloaded_again(server: HubServer) -> None:
    first = hub.pull(TINY, progress=False)
    server.clear_log()
    console, buf = _console()
    assert hub.pull(TINY, console=console) == first
    assert [r.path for r in server.log] == [f"/api/models/{TINY}/revision/main"]  # only "what is main now?"
    assert "is up to date in the cache" in buf.getvalue()

    server.clear_log()
    assert hub.resolve_model_dir(TINY, allow_pull=False) == first
    assert server.log == []


def test_model_downloaded_by_another_tool_is_reused(server: HubServer) -> None:
    """A snapshot written by huggingface_hub.snapshot_download (transformers, vLLM, `hf download`) is reused."""
    from huggingface_hub import snapshot_download

    other = Path(
        snapshot_download(
            TINY, cache_dir=hub.hub_cache_dir(), endpoint=server.url, allow_patterns=["*.json", "*.safetensors"]
        )
    )
    assert hub.find_cached_snapshot(TINY) == other
    server.clear_log()
    assert hub.pull(TINY, progress=False) == other
    assert _downloads(server) == [] and [r for r in server.log if "/resolve/" in r.path] == []
    assert [m.repo_id for m in hub.list_models()] == [TINY]


def test_sharded_checkpoint_fetches_the_index_shards_only(server: HubServer, models) -> None:
    snapshot = hub.pull(SHARDED, progress=False)
    source = models["sharded"]["dir"]
    shards = sorted(p.name for p in source.glob("model-*.safetensors"))
    assert len(shards) >= 2
    names = sorted(p.name for p in snapshot.iterdir())
    assert names == sorted(
        shards
        + [
            "model.safetensors.index.json",
            "config.json",
            "generation_config.json",
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    assert not any("consolidated" in r.path for r in server.log)
    (row,) = hub.list_models()
    assert row.num_parameters == models["sharded"]["num_parameters"] == _safetensors_numel([source / s for s in shards])
    assert row.dtype == "bfloat16"
    assert row.architecture == "LlamaForCausalLM"


def test_resume_after_dropped_connection(server: HubServer, models) -> None:
    source = models["big"]["dir"] / "model.safetensors"
    size = source.stat().st_size
    server.drop_connection_once(BIG, "model.safetensors", at=11_000_000)
    console, buf = _console()

    snapshot = hub.pull(BIG, console=console)

    gets = [r for r in _downloads(server) if r.path.endswith("/model.safetensors")]
    assert len(gets) == 2
    assert gets[0].range is None
    match = re.fullmatch(r"bytes=(\d+)-", gets[1].range or "")
    assert match, gets[1].range
    resumed_from = int(match.group(1))
    assert 0 < resumed_from <= 11_000_000  # the retry asked only for what was missing
    assert _sha256(snapshot / "model.safetensors") == _sha256(source)
    out = buf.getvalue()
    assert "connection dropped while downloading model.safetensors" in out
    assert f"resuming with a Range request from byte {resumed_from}" in out
    from rich.filesize import decimal

    mb = decimal(size).split()[0]
    assert re.search(rf"✓ model\.safetensors\s.*100%\s+{re.escape(mb)}/{re.escape(mb)} MB", out), out


def test_resume_after_interrupted_pull(server: HubServer, models, cli) -> None:
    source = models["big"]["dir"] / "model.safetensors"
    sha = _sha256(source)
    server.break_download(BIG, "model.safetensors", at=11_000_000)

    with pytest.raises(HubError, match=rf"kept; run `llmctl pull {BIG}` again to resume"):
        hub.pull(BIG, progress=False)
    blobs = hub.hub_cache_dir() / "models--llmctl-test--big" / "blobs"
    partial = blobs / f"{sha}.incomplete"
    kept = partial.stat().st_size
    assert 0 < kept < source.stat().st_size
    assert partial.read_bytes() == source.read_bytes()[:kept]
    assert hub.find_cached_snapshot(BIG) is None
    assert f"partial download: {BIG}" in _invoke(cli, "ls").stdout

    server.repair(BIG, "model.safetensors")
    server.clear_log()
    snapshot = hub.pull(BIG, progress=False)
    gets = [r for r in _downloads(server) if r.path.endswith("/model.safetensors")]
    assert [g.range for g in gets] == [f"bytes={kept}-"]  # the next run picks up where the last one stopped
    assert _sha256(snapshot / "model.safetensors") == sha
    assert list(blobs.glob("*.incomplete")) == []


def test_corrupted_weights_are_detected_and_deleted(server: HubServer, models, cli) -> None:
    server.corrupt(TINY, "model.safetensors")
    with pytest.raises(HubError) as info:
        hub.pull(TINY, progress=False)
    message = str(info.value)
    assert message.startswith(f"checksum mismatch for model.safetensors of {TINY}@main: expected sha256 ")
    assert "the corrupted download was deleted" in message
    storage = hub.hub_cache_dir() / "models--llmctl-test--tiny"
    good = _sha256(models["tiny"]["dir"] / "model.safetensors")
    assert not (storage / "blobs" / good).exists()
    assert list((storage / "blobs").glob("*.incomplete")) == []
    assert hub.find_cached_snapshot(TINY) is None
    with pytest.raises(ModelNotFoundError):
        hub.resolve_model_dir(TINY, allow_pull=False)

    result = _invoke(cli, "pull", TINY)
    assert result.exit_code == 1
    last = result.stderr.strip().splitlines()[-1]  # above it: the progress bars, the file marked ✗
    assert last.startswith(f"error: checksum mismatch for model.safetensors of {TINY}@main"), result.stderr
    assert "✗ model.safetensors" in result.stderr

    server.corrupt(TINY, "model.safetensors", enabled=False)
    snapshot = hub.pull(TINY, progress=False)
    assert _sha256(snapshot / "model.safetensors") == good


def test_corrupted_small_file_is_checked_against_its_git_blob_id(server: HubServer, models) -> None:
    server.corrupt(TINY, "config.json")
    with pytest.raises(HubError, match=r"checksum mismatch for config\.json .*expected git-sha1 "):
        hub.pull(TINY, progress=False)
    assert hub.find_cached_snapshot(TINY) is None  # weights arrived, but no config.json: not a usable snapshot

    server.corrupt(TINY, "config.json", enabled=False)
    server.clear_log()
    snapshot = hub.pull(TINY, progress=False)
    assert [r.path.rsplit("/", 1)[1] for r in _downloads(server)] == ["config.json"]  # the rest was kept
    assert (snapshot / "config.json").read_bytes() == (models["tiny"]["dir"] / "config.json").read_bytes()


# ---------------------------------------------------------------------------------------------
# Errors a user can act on
# ---------------------------------------------------------------------------------------------


def test_missing_repo_and_revision_are_clear_errors(server: HubServer, cli) -> None:
    with pytest.raises(HubError) as info:
        hub.pull("llmctl-test/does-not-exist")
    assert str(info.value) == (
        f"repository llmctl-test/does-not-exist not found on {server.url} "
        "(check the id, or HF_TOKEN for gated/private repos)"
    )
    with pytest.raises(HubError) as info:
        hub.pull(f"{TINY}@no-such-branch")
    assert str(info.value).startswith(f"revision 'no-such-branch' not found in {TINY} on {server.url}")
    with pytest.raises(HubError, match="has no safetensors weights .*pytorch_model.bin"):
        hub.pull("llmctl-test/bin-only")
    with pytest.raises(ModelNotFoundError, match="not a Hugging Face repo id"):
        hub.pull("not a repo")

    result = _invoke(cli, "pull", "llmctl-test/does-not-exist")
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        f"error: repository llmctl-test/does-not-exist not found on {server.url} "
        "(check the id, or HF_TOKEN for gated/private repos)"
    ]
    assert hub.list_models() == []


def test_unreachable_endpoint(server: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    dead = closed_port_url()
    monkeypatch.setenv("HF_ENDPOINT", dead)
    with pytest.raises(HubError) as info:
        hub.pull(TINY)
    message = str(info.value)
    assert message.startswith(f"could not reach the Hugging Face hub at {dead} (HF_ENDPOINT={dead}): ")
    assert "refused" in message.lower()

    monkeypatch.setenv("HF_ENDPOINT", server.url)
    cached = hub.pull(TINY, progress=False)
    monkeypatch.setenv("HF_ENDPOINT", dead)
    console, buf = _console()
    assert hub.pull(TINY, console=console) == cached  # offline, but cached: use it and say so
    assert f"could not reach the Hugging Face hub at {dead}" in buf.getvalue()
    assert "using the cached snapshot" in buf.getvalue()

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert hub.pull(TINY, progress=False) == cached
    with pytest.raises(HubError, match=f"HF_HUB_OFFLINE is set and {BIG}@main is not in the cache"):
        hub.pull(BIG)


def test_gated_repo_uses_hf_token(server: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(HubError, match=rf"{GATED} is a gated repository on {re.escape(server.url)}: .*HF_TOKEN"):
        hub.pull(GATED, progress=False)
    with pytest.raises(HubError, match="the token in use has no access"):
        hub.pull(GATED, token="hf_wrong", progress=False)

    monkeypatch.delenv("HF_HUB_DISABLE_IMPLICIT_TOKEN")
    monkeypatch.setenv("HF_TOKEN", GATED_TOKEN)
    server.clear_log()
    snapshot = hub.pull(GATED, progress=False)
    assert (snapshot / "model.safetensors").is_file()
    resolves = [r for r in server.log if "/resolve/" in r.path]
    assert resolves and all(r.authorization == f"Bearer {GATED_TOKEN}" for r in resolves)


# ---------------------------------------------------------------------------------------------
# ls / rm / resolve_model_dir
# ---------------------------------------------------------------------------------------------


def test_ls_and_rm_with_stories260k(server: HubServer, stories_dir: Path, cli, monkeypatch) -> None:
    monkeypatch.setenv("LLMCTL_GPTQ_CACHE", "0")  # the session's GPTQ cache may hold entries: no extra line
    result = _invoke(cli, "pull", STORIES_ID)
    assert result.exit_code == 0, result.output
    snapshot = hub.find_cached_snapshot(STORIES_ID)
    assert snapshot is not None and f"✓ {STORIES_ID} → {snapshot}" in result.stdout
    assert "LlamaForCausalLM: runs here" in result.stdout
    assert "100%" in result.stderr  # the progress bars went to stderr
    assert not (snapshot / "LICENSE").exists()

    expected_params = _safetensors_numel([stories_dir / "model.safetensors"])
    pulled = [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
    expected_size = sum((stories_dir / n).stat().st_size for n in pulled)
    (row,) = hub.list_models()
    assert (row.repo_id, row.revision, row.architecture, row.dtype) == (
        STORIES_ID,
        "main",
        "LlamaForCausalLM",
        "float32",
    )
    assert row.num_parameters == expected_params
    assert row.size_on_disk == expected_size
    assert row.complete and row.path == snapshot

    result = _invoke(cli, "ls")
    assert result.exit_code == 0
    header, line, local = result.stdout.strip().splitlines()
    assert header.split() == ["NAME", "REVISION", "SIZE", "ARCHITECTURE", "PARAMS", "DTYPE", "BYTES/PARAM"]
    assert local.startswith("without a download: ")  # one line, however narrow the terminal
    assert local.endswith("tiny-random-llama (random weights, built in memory)")
    from rich.filesize import decimal

    assert line.split() == [
        STORIES_ID,
        "main",
        *decimal(expected_size).split(),
        "LlamaForCausalLM",
        f"{expected_params / 1e3:.1f}K",
        "float32",
        "4.00",
    ]

    result = _invoke(cli, "rm", STORIES_ID)
    assert result.exit_code == 0
    assert result.stdout.strip() == f"Removed {STORIES_ID} ({decimal(expected_size)} freed)"
    assert hub.list_models() == []
    assert not (hub.hub_cache_dir() / "models--llmctl-test--stories260k").exists()
    empty = _invoke(cli, "ls").stdout
    assert "No models in the Hugging Face cache" in empty and "without a download: " in empty
    assert stories_dir.joinpath("model.safetensors").is_file()  # the source was only read

    result = _invoke(cli, "rm", STORIES_ID)
    assert result.exit_code == 1 and "is not in the Hugging Face cache" in result.stderr


def test_ls_shows_the_gptq_cache(server: HubServer, cli, tmp_path: Path, monkeypatch) -> None:
    """`llmctl ls` names the GPTQ cache's folder, its entries and their bytes when it holds any
    (temporary files and other files in the folder are not entries); without torch."""
    from rich.filesize import decimal

    monkeypatch.setenv("LLMCTL_GPTQ_CACHE", str(tmp_path / "gptq"))
    assert "GPTQ cache" not in _invoke(cli, "ls").stdout  # no folder yet
    (tmp_path / "gptq").mkdir()
    (tmp_path / "gptq" / f"{'a' * 40}.safetensors").write_bytes(b"x" * 1500)
    (tmp_path / "gptq" / f"{'b' * 40}.safetensors").write_bytes(b"x" * 500)
    (tmp_path / "gptq" / f"{'c' * 40}.123.tmp").write_bytes(b"x" * 9000)
    (tmp_path / "gptq" / "notes.txt").write_bytes(b"x" * 9000)
    result = _invoke(cli, "ls")
    assert result.exit_code == 0
    assert f"GPTQ cache (--calibration results): 2 entries, {decimal(2000)} in {tmp_path / 'gptq'}" in result.stdout
    assert "No models in the Hugging Face cache" in result.stdout
    monkeypatch.setenv("LLMCTL_GPTQ_CACHE", "0")  # the cache off: nothing to show
    assert "GPTQ cache" not in _invoke(cli, "ls").stdout
    code = "import sys, llmctl.models.calibration_store; sys.exit('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], check=False).returncode
        == 0
    )


def test_rm_frees_a_partial_download(server: HubServer) -> None:
    server.break_download(BIG, "model.safetensors", at=11_000_000)
    with pytest.raises(HubError):
        hub.pull(BIG, progress=False)
    storage = hub.hub_cache_dir() / "models--llmctl-test--big"
    kept = sum(p.stat().st_size for p in storage.rglob("*") if p.is_file() and not p.is_symlink())
    assert hub.remove(BIG) == kept > 10_000_000
    assert not storage.exists()
    with pytest.raises(ModelNotFoundError, match=f"{BIG} is not in the Hugging Face cache"):
        hub.remove(BIG)


def test_resolve_model_dir(server: HubServer, stories_dir: Path, tmp_path: Path, monkeypatch) -> None:
    assert hub.resolve_model_dir(str(stories_dir)) == stories_dir
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        hub.resolve_model_dir(str(tmp_path / "empty"))
    with pytest.raises(ModelNotFoundError, match="no such model directory"):
        hub.resolve_model_dir("./no/such/dir")
    assert server.log == []

    monkeypatch.setattr(sys, "stdin", io.StringIO())  # not a terminal: never prompt
    for allow in (None, False):
        with pytest.raises(ModelNotFoundError) as info:
            hub.resolve_model_dir(TINY, allow_pull=allow)
        assert f"run `llmctl pull {TINY}` first" in str(info.value)
    assert server.log == []

    pulled = hub.resolve_model_dir(TINY, allow_pull=True, console=_console()[0])
    assert pulled.name == _commit(server, TINY) and (pulled / "config.json").is_file()
    server.clear_log()
    assert hub.resolve_model_dir(TINY) == pulled
    assert hub.resolve_model_dir(f"{TINY}@main", allow_pull=False) == pulled
    assert server.log == []
    with pytest.raises(ModelNotFoundError, match=f"llmctl pull {TINY}@v1"):
        hub.resolve_model_dir(f"{TINY}@v1", allow_pull=False)
    assert isinstance(HubError("x"), LlmctlError)


def test_incomplete_snapshot_says_so_and_offers_pull(server: HubServer, monkeypatch) -> None:
    """A snapshot `ls` shows as "(incomplete)" is not called missing: the error says incomplete."""
    pulled = hub.pull(TINY, console=_console()[0])
    (pulled / "model.safetensors").unlink()
    assert [m.complete for m in hub.list_models()] == [False]
    monkeypatch.setattr(sys, "stdin", io.StringIO())
    with pytest.raises(ModelNotFoundError) as info:
        hub.resolve_model_dir(TINY)
    assert "is in the Hugging Face cache" in str(info.value) and "but incomplete" in str(info.value)
    assert f"run `llmctl pull {TINY}` to complete it" in str(info.value)
    assert hub.resolve_model_dir(TINY, allow_pull=True, console=_console()[0]) == pulled


def _child_env(server: HubServer) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update({"PYTHONPATH": str(REPO_ROOT), "HF_HUB_DISABLE_TELEMETRY": "1", "COLUMNS": "160", "TERM": "xterm"})
    return env


def test_interactive_prompt_offers_to_pull(server: HubServer, tmp_path: Path) -> None:
    pexpect = pytest.importorskip("pexpect")
    script = tmp_path / "resolve.py"
    script.write_text(
        "import sys\nfrom llmctl.hub import resolve_model_dir\nprint('RESOLVED', resolve_model_dir(sys.argv[1]))\n"
    )
    child = pexpect.spawn(
        sys.executable,
        [str(script), TINY],
        env=_child_env(server),
        cwd=str(REPO_ROOT),
        encoding="utf-8",
        timeout=60,
        dimensions=(40, 160),
    )
    child.expect(rf"{TINY} is not in the Hugging Face cache\. Download it from {re.escape(server.url)}\?")
    child.sendline("y")
    child.expect(r"RESOLVED (\S+)")
    path = Path(child.match.group(1))
    child.expect(pexpect.EOF)
    assert path.name == _commit(server, TINY) and (path / "model.safetensors").is_file()


def test_cli_in_a_fresh_process(server: HubServer, tmp_path: Path) -> None:
    """HF_ENDPOINT / HF_HUB_CACHE are honoured by a new interpreter too (huggingface_hub reads them at import)."""
    script = tmp_path / "cli.py"
    script.write_text(
        "import typer\nfrom llmctl.hub import register_hub_commands\n"
        "app = typer.Typer()\nregister_hub_commands(app)\napp()\n"
    )

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, str(script), *args],
            env=_child_env(server),
            cwd=str(REPO_ROOT),
            capture_output=True,
            text=True,
            timeout=120,
        )

    pulled = run("pull", TINY)
    assert pulled.returncode == 0, pulled.stderr
    assert "✓ model.safetensors" in pulled.stderr and "100%" in pulled.stderr
    listed = run("ls")
    assert listed.returncode == 0 and re.search(rf"{TINY}\s+main\s+.*LlamaForCausalLM\s+\S+K\s+bfloat16", listed.stdout)
    missing = run("pull", "llmctl-test/nope")
    assert missing.returncode == 1
    assert missing.stderr.strip().splitlines() == [
        f"error: repository llmctl-test/nope not found on {server.url} "
        "(check the id, or HF_TOKEN for gated/private repos)"
    ]
    removed = run("rm", TINY)
    assert removed.returncode == 0 and removed.stdout.startswith(f"Removed {TINY} (")
    assert hub.list_models() == []


def test_pull_says_when_the_architecture_does_not_run_here(server: HubServer, cli) -> None:
    result = _invoke(cli, "pull", MAMBA)
    assert result.exit_code == 0, result.output
    assert "MambaForCausalLM: llmctl does not run it (it runs LlamaForCausalLM," in result.stdout, result.stdout
