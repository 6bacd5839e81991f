"""A live ``llmctl serve`` with two base models and three LoRA adapters in one process, through the
real ``openai`` client: every name answers with the tokens transformers + peft (merged) give,
requests for all five run at once, ``/v1/models`` lists adapters with their parent, adapters load
and unload at run time, and a bad adapter fails alone with a clear 400."""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from lora_factory import ALL_LINEAR, ATTENTION, make_adapter, merged_greedy
from server.server_helpers import ServerProcess

pytestmark = pytest.mark.timeout(900)
MAX_NEW = 6
PROMPT = [5, 17, 42, 99, 3, 250, 7, 64]


def _base_with_tokenizer(family: str, out_dir, seed: int):
    from model_factory import make_hf_model
    from tokenizer_factory import byte_level_bpe

    model_dir = make_hf_model(family, out_dir, seed=seed, vocab_size=512, max_position_embeddings=256)
    byte_level_bpe().backend.save(str(model_dir / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": template}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return model_dir


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    bases = {
        "tiny-llama": _base_with_tokenizer("llama", root / "llama", 31),
        "tiny-qwen": _base_with_tokenizer("qwen3", root / "qwen3", 32),
    }
    adapters = {  # name -> (base, path)
        "sql": ("tiny-llama", make_adapter(bases["tiny-llama"], root / "sql", rank=8, targets=ATTENTION, seed=1)),
        "code": (
            "tiny-llama",
            make_adapter(bases["tiny-llama"], root / "code", rank=64, targets=ALL_LINEAR, seed=2, std=0.08),
        ),
        "qa": ("tiny-qwen", make_adapter(bases["tiny-qwen"], root / "qa", rank=8, targets=ALL_LINEAR, seed=3)),
    }
    late = make_adapter(bases["tiny-qwen"], root / "late", rank=16, targets=["q_proj", "v_proj"], seed=4)
    modules = [json.dumps({"name": n, "path": str(p), "base_model_name": b}) for n, (b, p) in adapters.items()]
    server = ServerProcess(
        f"tiny-llama={bases['tiny-llama']}",
        f"tiny-qwen={bases['tiny-qwen']}",
        "--lora-modules",
        *modules,
        "--max-lora-rank",
        "64",
        "--max-loras",
        "2",
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--kv-cache-memory",
        "16MiB",
        "--keep-alive",
        "-1",
        "--enable-lora-runtime-updates",
        log_path=root / "server.log",
    )
    yield server, bases, adapters, late, root
    server.kill()


def _text(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.model == model and out.usage.completion_tokens == MAX_NEW
    return out.choices[0].text


def _expected(base, adapter) -> str:
    """The text of transformers + peft's (merged) greedy tokens."""
    from tokenizer_factory import byte_level_bpe

    return byte_level_bpe().decode(merged_greedy(base, adapter, [PROMPT], MAX_NEW)[0])


def test_two_bases_three_adapters_answer_by_name(setup) -> None:
    server, bases, adapters, _, _ = setup
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    names = ["tiny-llama", "tiny-qwen", *adapters]
    with ThreadPoolExecutor(len(names) * 2) as pool:  # all at once: adapters and bases share batches
        got = list(zip(names * 2, pool.map(lambda n: _text(client, n), names * 2)))
    for name, text in got:
        base, path = (name, None) if name in bases else adapters[name]
        assert text == _expected(bases[base], path), name
        if path is not None:  # the adapter does change the answer
            assert text != _expected(bases[base], None), name
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == set(names)
    for name, (base, path) in adapters.items():
        assert cards[name].model_extra["parent"] == base and cards[name].model_extra["root"] == str(path)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _text(client, "no-such-adapter")
    chat = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0
    )
    assert chat.model == "sql"


def test_runtime_load_unload_and_bad_adapters(setup) -> None:
    server, bases, _, late, root = setup
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    before = _text(client, "qa")
    corrupt = shutil.copytree(late, root / "corrupt")
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with httpx.Client(base_url=server.base_url, timeout=120) as http:
        for body, message in [
            ({"lora_name": "x", "lora_path": str(root / "missing")}, "no such directory"),
            ({"lora_name": "x", "lora_path": str(corrupt), "base_model_name": "tiny-qwen"}, "cannot read"),
            ({"lora_name": "x", "lora_path": str(late)}, "another base model"),  # a Qwen adapter on the Llama
            ({"lora_name": "sql", "lora_path": str(late)}, "already served"),
        ]:
            answer = http.post("/load_lora_adapter", json=body)
            assert answer.status_code == 400 and message in answer.json()["error"]["message"], answer.text
        loaded = http.post(
            "/load_lora_adapter", json={"lora_name": "late", "lora_path": str(late), "base_model_name": "tiny-qwen"}
        )
        assert loaded.status_code == 200, loaded.text
        assert _text(client, "late") == _expected(bases["tiny-qwen"], late)
        assert "late" in {m.id for m in client.models.list().data}
        assert http.post("/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
        assert http.post("/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        _text(client, "late")
    assert _text(client, "qa") == before  # the others were never touched
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
