"""``llmctl serve`` on a float mixture-of-experts checkpoint with ``--quantization int4``: the
experts quantized at load (llmctl/layers/moe.py), the server up and answering."""

from __future__ import annotations

import json

import httpx
from model_factory import make_hf_model
from tokenizer_factory import byte_level_bpe


def test_serve_quantizes_a_moe_checkpoint_and_answers(start_server, tmp_path):
    model_dir = make_hf_model("qwen3_moe", tmp_path / "model", seed=3, vocab_size=512)
    byte_level_bpe().backend.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    server = start_server(str(model_dir), "--quantization", "int4", "--kv-cache-memory", "16MiB")
    body = {"prompt": "hello there", "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    response = httpx.post(f"{server.base_url}/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 5
