"""Tiny synthetic GGUF files written with ``gguf.GGUFWriter`` (the format authors' writer), and the
transformers checkpoint holding exactly the weights they stand for (the oracle).

A random transformers model is converted the way llama.cpp's converter does it: renamed, Q/K rows
interleaved per head for the ``llama`` architecture, each matrix stored in the GGML type asked
for. Types ``gguf`` can quantize (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0) are quantized from the weights;
K-quants (which ``gguf`` only reads) are random blocks with small scales. The oracle checkpoint
then receives ``gguf.quants.dequantize`` of what was written, so both sides hold the same values.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import dequantize, quantize

T = GGMLQuantizationType
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)
CORPUS = (
    "the quick brown fox jumps over the lazy dog while a small engine serves many stories "
    "to readers who ask at the same time and it keeps its memory in pages"
)

# Every type llmctl reads appears at least once, and the merged projections mix types.
LAYER_TYPES = [
    {
        "attn_q": T.Q4_0,
        "attn_k": T.Q4_1,
        "attn_v": T.Q8_0,
        "attn_output": T.Q5_0,
        "ffn_gate": T.Q5_1,
        "ffn_up": T.Q4_K,
        "ffn_down": T.Q6_K,
    },
    {
        "attn_q": T.Q4_K,
        "attn_k": T.Q5_K,
        "attn_v": T.Q6_K,
        "attn_output": T.F16,
        "ffn_gate": T.BF16,
        "ffn_up": T.Q8_0,
        "ffn_down": T.Q5_K,
    },
]
_HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """<unk> <s> </s>, the 256 byte-fallback pieces, then characters and every prefix of every
    ``▁word`` of the corpus (so each word is reachable by merges), scored best-first."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    pieces: list[str] = ["▁"] + sorted(set(CORPUS.replace(" ", "")))
    for word in CORPUS.split():
        word = "▁" + word
        pieces += [word[:i] for i in range(2, len(word) + 1)]
    pieces = list(dict.fromkeys(pieces))
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    return tokens + pieces, scores, types + [TokenType.NORMAL] * len(pieces)


def _llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_k_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)

    def half(scale: float, n: int) -> np.ndarray:
        return np.abs(rng.normal(scale, scale / 4, (raw.shape[0], n))).astype(np.float16).view(np.uint8)

    if qtype == T.Q6_K:
        raw[:, 208:210] = half(0.05 / (127 * 32), 1)
    else:  # Q4_K, Q5_K: d and dmin
        raw[:, 0:4] = half(0.05 / (63 * 31), 2)
    return raw.reshape(rows, -1)


def encode_tensor(w: np.ndarray, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """The bytes (or float array) GGUF stores for a float32 matrix ``w`` [rows, cols]."""
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        return _random_k_blocks(qtype, *w.shape, rng)
    return quantize(np.ascontiguousarray(w, dtype=np.float32), qtype)


def decode_tensor(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == T.F32:
        return data
    return dequantize(data, qtype)


def write_tiny_gguf(
    path: Path,
    hf_dir: Path,
    *,
    arch: str = "llama",
    tie: bool = False,
    seed: int = 0,
    layer_types: list[dict] = LAYER_TYPES,
) -> Path:
    """Write ``path`` (GGUF) and ``hf_dir`` (the transformers checkpoint with the same values)."""
    from model_factory import make_config
    from transformers import AutoModelForCausalLM

    tokens, scores, types = sentencepiece_vocab()
    family = "llama" if arch == "llama" else "qwen2"
    config = make_config(
        family,
        vocab_size=len(tokens),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_scaling=None,
        tie_word_embeddings=tie,
        initializer_range=0.05,
        rms_norm_eps=1e-5,
    )  # rope theta: the default 10000
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch=arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)

    state = {}
    for name, param in model.state_dict().items():
        w = param.detach().numpy().astype(np.float32)
        gguf_name, qtype = _gguf_name_and_type(name, layer_types)
        if gguf_name is None or (tie and name == "lm_head.weight"):  # tied: llama.cpp writes no output.weight
            continue
        heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(
            gguf_name.split(".")[-2]
        )
        stored_w = _llama_cpp_permute(w, heads) if (arch == "llama" and heads) else w
        data = encode_tensor(stored_w, qtype, rng)
        writer.add_tensor(gguf_name, data, raw_dtype=qtype)
        value = decode_tensor(data, qtype).reshape(w.shape)
        if arch == "llama" and heads:  # undo the interleave: the oracle holds the model's own layout
            value = _llama_cpp_permute_inverse(value, heads)
        state[name] = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_state_dict(state, strict=False)
    if tie:
        model.tie_weights()
    model.save_pretrained(hf_dir)
    return path


def _llama_cpp_permute_inverse(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name_and_type(hf_name: str, layer_types: list[dict]) -> tuple[str | None, GGMLQuantizationType]:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight", T.Q8_0
    if hf_name == "model.norm.weight":
        return "output_norm.weight", T.F32
    if hf_name == "lm_head.weight":
        return "output.weight", T.Q6_K
    parts = hf_name.split(".")  # model.layers.N.<module path>.<weight|bias>
    if parts[:2] != ["model", "layers"]:
        return None, T.F32
    layer, module, kind = int(parts[2]), ".".join(parts[3:-1]), parts[-1]
    short = _HF_TO_GGUF[module]
    qtype = layer_types[layer].get(short, T.F32) if kind == "weight" else T.F32
    return f"blk.{layer}.{short}.{kind}", qtype
