"""LoRA adapters in a ``llmctl serve --config`` file, against a live server: two base models each
serving adapters by name (the tokens transformers + peft give), the Anthropic, Responses and Ollama
routes running an adapter named as their ``model`` with the tokens the OpenAI routes give, and bad
adapters (too wide for the model's ``max_lora_rank``, a missing directory) failing their own
model's load alone, naming the model and the adapter."""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
from lora.lora_factory import ALL_LINEAR, ATTENTION, make_adapter, merged_greedy

pytestmark = pytest.mark.timeout(900)
MAX_NEW = 6
PROMPT = [5, 17, 42, 99, 3, 250, 7, 64]
HI = [{"role": "user", "content": "hi there"}]


def _base_with_tokenizer(family: str, out_dir: Path, seed: int) -> Path:
    """A tiny random-weight model with a byte-level BPE tokenizer and a ChatML template."""
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
def setup(start_server, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_config")
    llama = _base_with_tokenizer("llama", root / "llama", 41)
    qwen = _base_with_tokenizer("qwen3", root / "qwen3", 42)
    adapters = {  # name -> (base model name, base dir, adapter dir)
        "sql": ("llama", llama, make_adapter(llama, root / "sql", rank=8, targets=ATTENTION, seed=11)),
        "code": ("llama", llama, make_adapter(llama, root / "code", rank=32, targets=ALL_LINEAR, seed=12, std=0.1)),
        "qa": ("qwen", qwen, make_adapter(qwen, root / "qa", rank=8, targets=ALL_LINEAR, seed=13)),
    }
    wide = make_adapter(qwen, root / "wide", rank=16, targets=ATTENTION, seed=14)
    config = root / "models.yaml"
    config.write_text(
        "keep_alive: -1\n"
        "models:\n"
        f"  - name: llama\n    model: {llama}\n    max_lora_rank: 32\n    max_loras: 2\n"
        f"    lora_modules:\n      sql: {adapters['sql'][2]}\n      code: {adapters['code'][2]}\n"
        f"  - name: qwen\n    model: {qwen}\n    max-lora-rank: 8\n"
        f"    lora_modules: [qa={adapters['qa'][2]}]\n"
        f"  - name: too-wide\n    model: {qwen}\n    max_lora_rank: 8\n    lora_modules: {{wide: {wide}}}\n"
        f"  - name: missing\n    model: {llama}\n    lora_modules: {{gone: {root / 'gone'}}}\n"
    )
    server = start_server(f"--config={config}", "--dtype", "float32", "--device", "cpu", "--kv-cache-memory", "8MiB")
    return server, {"llama": llama, "qwen": qwen}, adapters


def _completion(server, model: str) -> str:
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.model == model and out.usage.completion_tokens == MAX_NEW
    return out.choices[0].text


def _expected(base: Path, adapter: Path | None) -> str:
    """The text of transformers + peft's (merged) greedy tokens."""
    from tokenizer_factory import byte_level_bpe

    return byte_level_bpe().decode(merged_greedy(base, adapter, [PROMPT], MAX_NEW)[0])


def test_config_adapters_answer_by_name(setup) -> None:
    server, bases, adapters = setup
    for name, (_, base, path) in adapters.items():
        text = _completion(server, name)
        assert text == _expected(base, path), name
        assert text != _expected(base, None), name  # the adapter does change the answer
    assert _completion(server, "qwen") == _expected(bases["qwen"], None)
    cards = {m.id: m.model_extra for m in openai.OpenAI(base_url=server.base_url, api_key="none").models.list().data}
    for name, (parent, _, path) in adapters.items():
        assert cards[name]["parent"] == parent and cards[name]["root"] == str(path)


def _openai_chat(server, model: str) -> tuple[str, int]:
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
    out = client.chat.completions.create(model=model, messages=HI, max_completion_tokens=MAX_NEW, temperature=0)
    return out.choices[0].message.content, out.usage.completion_tokens


@pytest.mark.parametrize("adapter", ["code", "qa"])
def test_other_dialects_run_the_adapter(setup, adapter: str) -> None:
    server, _, adapters = setup
    expected, tokens = _openai_chat(server, adapter)
    assert (expected, tokens) != _openai_chat(server, adapters[adapter][0])  # the base model answers otherwise

    message = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120).messages.create(
        model=adapter, max_tokens=MAX_NEW, messages=HI, extra_body={"temperature": 0}
    )
    assert message.model == adapter
    assert (message.content[0].text, message.usage.output_tokens) == (expected, tokens)

    responses = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120).responses
    response = responses.create(model=adapter, input="hi there", max_output_tokens=MAX_NEW, temperature=0)
    assert (response.output_text, response.usage.output_tokens) == (expected, tokens)

    local = ollama.Client(host=server.url, timeout=120)
    options = {"temperature": 0, "num_predict": MAX_NEW}
    chat = local.chat(model=adapter, messages=HI, options=options)
    assert (chat.message.content, chat.eval_count) == (expected, tokens)
    generated = local.generate(model=f"{adapter}:latest", prompt="hi there", options=options)
    assert (generated.response, generated.eval_count) == (expected, tokens)
    raw = local.generate(model=adapter, prompt="hi there", raw=True, options=options)  # the completions path
    completion = openai.OpenAI(base_url=server.base_url, api_key="none").completions.create(
        model=adapter, prompt="hi there", max_tokens=MAX_NEW, temperature=0
    )
    assert raw.response == completion.choices[0].text

    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0).messages.create(
            model="no-such-adapter", max_tokens=2, messages=HI
        )
    with pytest.raises(ollama.ResponseError, match="not found"):
        local.chat(model="no-such-adapter", messages=HI)
    with pytest.raises(ollama.ResponseError, match=f"'{adapter}' is a LoRA adapter"):  # the base model's routes
        local.embed(model=adapter, input="hi there")


def test_a_bad_adapter_fails_its_model_alone(setup) -> None:
    server, bases, adapters = setup
    client = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=120)
    for model, words in [
        ("too-wide", ["`too-wide`", "LoRA adapter wide", "rank 16 exceeds --max-lora-rank 8"]),
        ("wide", ["`too-wide`", "LoRA adapter wide", "rank 16 exceeds --max-lora-rank 8"]),  # the adapter's name
        ("missing", ["`missing`", "LoRA adapter gone", "no such directory"]),
    ]:
        with pytest.raises(openai.InternalServerError) as failed:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
        error = failed.value.body
        assert error["code"] == "model_load_failed", error
        assert all(word in error["message"] for word in words), error["message"]
    status = {m["name"]: m for m in httpx.get(f"{server.base_url}/models/status", timeout=30).json()["models"]}
    assert status["too-wide"]["status"] == status["missing"]["status"] == "failed"
    assert "LoRA adapter gone" in status["missing"]["last_error"]
    assert _completion(server, "qa") == _expected(bases["qwen"], adapters["qa"][2])  # the others serve on
    assert httpx.get(f"{server.url}/health", timeout=30).json()["status"] == "ok"
