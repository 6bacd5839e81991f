"""``llmctl pull`` of a repo of GGUF files against the hub-compatible test server: one file chosen
by ``:TAG`` / ``--include`` / the Q4_K_M default, with progress and checksum checks as for
safetensors; the snapshot then loads (``generate`` finds the .gguf), and ``ls`` reads its facts."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from gguf_factory import write_tiny_gguf
from hub_server import HubServer
from rich.console import Console
from typer.testing import CliRunner

from llmctl import hub
from llmctl.errors import HubError
from llmctl.hub.layout import gguf_tag_matches, select_gguf_file
from llmctl.hub.refs import split_gguf_tag

REPO = "llmctl-test/tiny-GGUF"


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> bytes:
    root = tmp_path_factory.mktemp("hub-gguf")
    return write_tiny_gguf(root / "tiny.gguf", root / "hf").read_bytes()


@pytest.fixture
def server(gguf_bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    hub_server = HubServer()
    # the same model under three quant names (the bytes do not matter for choosing), plus a projector
    files = {f"tiny-{tag}.gguf": gguf_bytes for tag in ("Q4_K_M", "Q4_K_S", "Q8_0")}
    files.update({"mmproj-tiny-f16.gguf": b"not a model", "README.md": b"# tiny gguf\n"})
    hub_server.add_repo(REPO, None, extra=files)
    hub_server.add_repo("llmctl-test/one-gguf", None, extra={"model.Q4_1.gguf": gguf_bytes})
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


def _fetched(server: HubServer) -> list[str]:
    return sorted(r.path.rsplit("/", 1)[1] for r in server.requests("GET", "/resolve/"))


def test_tags_and_choice():
    assert split_gguf_tag("org/name:Q4_K_M") == ("org/name", "Q4_K_M")
    assert split_gguf_tag("org/name@v1:q8_0") == ("org/name@v1", "q8_0")
    assert split_gguf_tag("https://huggingface.co/org/name") == ("https://huggingface.co/org/name", None)
    assert gguf_tag_matches("SmolLM2-135M-Instruct.Q4_1.gguf", "q4_1")
    assert not gguf_tag_matches("tiny-Q4_K_M.gguf", "Q4_K")  # Q4_K is not Q4_K_M
    files = ["a-Q4_K_M.gguf", "a-Q8_0.gguf", "mmproj-a-f16.gguf", "README.md"]
    assert select_gguf_file(files, None, None, "r") == "a-Q4_K_M.gguf"
    assert select_gguf_file(files, "Q8_0", None, "r") == "a-Q8_0.gguf"
    assert select_gguf_file(files, None, "*Q8_0.gguf", "r") == "a-Q8_0.gguf"
    with pytest.raises(ValueError, match="matches none of its GGUF files.*a-Q4_K_M.gguf, a-Q8_0.gguf"):
        select_gguf_file(files, "Q2_K", None, "r")
    with pytest.raises(ValueError, match="matches 2 GGUF files"):
        select_gguf_file(files, None, "*.gguf", "r")


def test_pull_by_tag_fetches_that_file_verified_with_progress(server):
    buf = io.StringIO()
    path = hub.pull(f"{REPO}:Q8_0", console=Console(file=buf, width=140, color_system=None))
    assert path.name == "tiny-Q8_0.gguf" and path.is_file() and path.is_symlink()
    assert path.read_bytes() == server.repos[REPO].revisions["main"].files["tiny-Q8_0.gguf"].read()
    assert _fetched(server) == ["tiny-Q8_0.gguf"]  # nothing else: no README, no other quant, no projector
    out = buf.getvalue()
    assert "1 file(s) to download" in out and re.search(r"✓ tiny-Q8_0\.gguf\s.*100%", out), out
    # cached now: the same pull asks the hub for nothing new
    server.clear_log()
    assert hub.pull(f"{REPO}:Q8_0", progress=False) == path
    assert _fetched(server) == []


def test_default_is_q4_k_m_and_include_picks_by_glob(server):
    assert hub.pull(REPO, progress=False).name == "tiny-Q4_K_M.gguf"
    assert hub.pull(REPO, progress=False, include="*Q4_K_S.gguf").name == "tiny-Q4_K_S.gguf"
    assert hub.pull("llmctl-test/one-gguf", progress=False).name == "model.Q4_1.gguf"  # the only one


def test_a_corrupted_gguf_is_rejected_and_not_kept(server):
    server.corrupt(REPO, "tiny-Q8_0.gguf")
    with pytest.raises(HubError, match="tiny-Q8_0.gguf"):
        hub.pull(f"{REPO}:Q8_0", progress=False)
    assert not list((Path(hub.hub_cache_dir())).rglob("tiny-Q8_0.gguf"))
    server.corrupt(REPO, "tiny-Q8_0.gguf", enabled=False)
    assert hub.pull(f"{REPO}:Q8_0", progress=False).is_file()


def test_an_unknown_tag_lists_the_choices(server):
    with pytest.raises(HubError, match=r"tag 'Q2_K' matches none .*tiny-Q4_K_M\.gguf"):
        hub.pull(f"{REPO}:Q2_K", progress=False)


def test_generate_and_ls_find_the_pulled_gguf(server):
    from llmctl.cli_options import resolve_model
    from llmctl.engine.llm_engine import LLMEngine
    from llmctl.sampling_params import SamplingParams

    hub.pull(f"{REPO}:Q8_0", progress=False)
    hub.pull(f"{REPO}:Q4_K_M", progress=False)  # two files in one snapshot: the tag says which
    resolved = resolve_model(f"{REPO}:Q8_0", allow_pull=False)
    assert resolved.endswith("tiny-Q8_0.gguf")
    engine = LLMEngine(model=resolved, dtype="float32", kv_cache_memory=8 << 20)
    out = engine.generate(["the quick brown"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3

    import typer

    app = typer.Typer()
    hub.register_hub_commands(app)
    result = CliRunner().invoke(app, ["ls"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if line.startswith(REPO)]
    assert [row.split()[0] for row in rows] == [f"{REPO}:Q4_K_M", f"{REPO}:Q8_0"], result.output
    from gguf import GGUFReader

    reader = GGUFReader(resolved)
    params = sum(int(t.n_elements) for t in reader.tensors)
    per_param = sum(int(t.n_bytes) for t in reader.tensors) / params
    for row in rows:  # architecture, parameters and bytes per parameter from the header alone
        cells = row.split()  # NAME REVISION SIZE(2) ARCHITECTURE PARAMS DTYPE BYTES/PARAM
        assert (cells[4], cells[-1]) == ("llama", f"{per_param:.2f}"), result.output
        assert cells[6] == "Q8_0+Q6_K+Q4_K+…", result.output  # the types holding most parameters
    assert [m.num_parameters for m in hub.list_models()] == [params, params]


def test_pull_says_the_gguf_architecture_runs_here(server):
    import typer
    from typer.testing import CliRunner

    app = typer.Typer()
    hub.register_hub_commands(app)
    result = CliRunner().invoke(app, ["pull", "--quiet", f"{REPO}:Q8_0"])
    assert result.exit_code == 0, result.output
    assert "llama: runs here" in result.stdout, result.stdout
