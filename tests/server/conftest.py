"""Real ``llmctl serve`` processes on free ports of 127.0.0.1, shared by the server tests."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from server_helpers import API_KEY, ServerProcess


@pytest.fixture(scope="session")
def start_server(tmp_path_factory) -> Iterator:
    """A factory: ``start_server(model, *flags)``; every server started is killed at the end."""
    started: list[ServerProcess] = []

    def start(model: str, *args: str, env: dict[str, str] | None = None, **kwargs) -> ServerProcess:
        log = tmp_path_factory.mktemp("serve") / "server.log"
        server = ServerProcess(model, *args, log_path=log, env=env, **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


@pytest.fixture(scope="session")
def stories_server(start_server, stories_dir) -> ServerProcess:
    """The pretrained base model (no chat template), behind an API key."""
    return start_server(
        str(stories_dir), "--api-key", API_KEY, "--kv-cache-memory", "64MiB", "--served-model-name", "stories"
    )


@pytest.fixture(scope="session")
def chat_server(start_server) -> ServerProcess:
    """The embedded random-weight model with a ChatML template; API key from the environment."""
    return start_server(
        "tiny-random-llama", "--max-model-len", "64", "--kv-cache-memory", "64MiB", env={"LLMCTL_API_KEY": API_KEY}
    )


@pytest.fixture
def http(stories_server) -> Iterator[httpx.Client]:
    """Raw HTTP to the stories server, authenticated."""
    with httpx.Client(
        base_url=stories_server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as client:
        yield client


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory) -> str:
    """A tiny random-weight Llama with a byte-level BPE tokenizer (CJK and emoji split over several
    tokens) and a ChatML template: loads in a second, so fuzzing and soaking spend their time on
    requests. Its text is noise."""
    import json

    from model_factory import make_hf_model
    from tokenizer_factory import byte_level_bpe

    model_dir = make_hf_model(
        "llama", tmp_path_factory.mktemp("tiny_chat") / "model", seed=5, vocab_size=512, max_position_embeddings=256
    )
    tokenizer = byte_level_bpe()
    tokenizer.backend.save(str(model_dir / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template})
    )
    return str(model_dir)
