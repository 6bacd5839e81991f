"""Pooling requests (embeddings) against sentence-transformers as the oracle: alone, batched,
prefilled in chunks, in the same steps as generation requests, under preemption; every KV block
comes back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from model_factory import make_hf_model, random_prompts
from tokenizer_factory import MIXED_TEXT, byte_level_bpe

from llmctl.engine.llm_engine import LLMEngine
from llmctl.engine.pooler import read_sentence_transformers, resolve_pooler_config
from llmctl.errors import InvalidRequestError
from llmctl.pooling_params import PoolingParams
from llmctl.sampling_params import SamplingParams

ATOL = 1e-5
TEXTS = [
    "hi",
    "Once upon a time",
    MIXED_TEXT[:40],
    MIXED_TEXT,
    "café naïve façade " * 3,
    MIXED_TEXT * 5,  # about 125 tokens: several chunks of 32
    "🙂",
]
ST_POOLING = {"last": "lasttoken", "mean": "mean", "cls": "cls"}


def make_sentence_transformer(
    family: str, out_dir: Path, pooling: str, normalize: bool = True, seed: int = 7, bare: bool = False
) -> Path:
    """A tiny random causal LM saved as a sentence-transformers directory: its Transformer module
    reads the causal LM's own checkpoint (config.json + model.safetensors, ``model.`` prefixed
    names and an LM head), which llmctl loads as it is; ``bare``: the checkpoint sentence-transformers
    itself saves, the bare decoder (``Qwen3Model``: no LM head, no ``model.`` prefix)."""
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers >= 6
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    except ImportError:
        from sentence_transformers.models import Normalize, Pooling, Transformer

    causal = make_hf_model(family, out_dir / "causal", seed=seed, vocab_size=512)
    tokenizer = byte_level_bpe()
    tokenizer.backend.add_tokens(["yes", "no"])
    tokenizer.backend.save(str(causal / "tokenizer.json"))
    (causal / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "</s>",
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    word = Transformer(str(causal))
    width = (
        word.get_embedding_dimension()
        if hasattr(word, "get_embedding_dimension")
        else word.get_word_embedding_dimension()
    )
    modules = [word, Pooling(width, pooling_mode=ST_POOLING[pooling])]
    if normalize:
        modules.append(Normalize())
    st_dir = out_dir / "st"
    SentenceTransformer(modules=modules, device="cpu").save(str(st_dir))
    if not bare:
        for name in ("config.json", "model.safetensors"):  # the causal LM's checkpoint, as many repos have it
            shutil.copy(causal / name, st_dir / name)
    return st_dir


def st_encode(st_dir: Path, inputs: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(st_dir), device="cpu")
    return model.encode(inputs, convert_to_tensor=True, batch_size=4).float()


CASES = {"qwen3-last": ("qwen3", "last"), "qwen2-mean": ("qwen2", "mean"), "qwen3-cls": ("qwen3", "cls")}


@pytest.fixture(scope="module")
def st_models(tmp_path_factory) -> dict[str, tuple[Path, torch.Tensor]]:
    """Each case's directory and sentence-transformers' embeddings of TEXTS."""
    built = {}
    for name, (family, pooling) in CASES.items():
        st_dir = make_sentence_transformer(family, tmp_path_factory.mktemp(name), pooling)
        built[name] = (st_dir, st_encode(st_dir, TEXTS))
    return built


def make_engine(model_dir: Path, **kw) -> LLMEngine:
    kw.setdefault("kv_cache_memory", 8 << 20)
    kw.setdefault("max_num_batched_tokens", 32)
    return LLMEngine(model=str(model_dir), dtype="float32", **kw)


def params_of(model_dir: Path) -> PoolingParams:
    return resolve_pooler_config(model_dir).params()


def run(engine: LLMEngine, requests: list[tuple[str | list[int], object]], check_blocks: bool = True) -> list:
    """Add all requests, step until done (checking the block invariants after every step)."""
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if check_blocks:
            engine.block_manager.check_invariants(engine.live_sequences())
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.pooler.num_partial == 0
    return [final[i] for i in ids]


def record_steps(engine: LLMEngine) -> list[tuple[int, int, list[int]]]:
    """Per step: (pooling chunks, sampling rows, pooling chunk lengths)."""
    steps: list[tuple[int, int, list[int]]] = []
    execute = engine.runner.execute

    def recording(sched):
        chunks = [item.num_new_tokens for item in sched.prefills if item.seq.pooling is not None]
        steps.append((len(chunks), len(sched.sampling), chunks))
        return execute(sched)

    engine.runner.execute = recording
    return steps


@pytest.mark.parametrize("case", list(CASES))
def test_embeddings_match_sentence_transformers(st_models, case):
    st_dir, expected = st_models[case]
    engine = make_engine(st_dir)
    params = params_of(st_dir)
    assert params.pooling == CASES[case][1] and params.normalize
    steps = record_steps(engine)
    together = run(engine, [(text, params) for text in TEXTS])
    assert max(len(s[2]) for s in steps) > 1  # several inputs in one step
    got = torch.stack([out.pooled for out in together])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    for text, want in zip(TEXTS, expected):
        (alone,) = run(engine, [(text, params)])
        torch.testing.assert_close(alone.pooled, want, atol=ATOL, rtol=0)
        assert alone.outputs[0].finish_reason == "stop" and alone.outputs[0].token_ids == []


def test_a_bare_decoder_checkpoint_embeds_as_sentence_transformers(tmp_path):
    st_dir = make_sentence_transformer("qwen3", tmp_path, "last", bare=True)
    config = json.loads((st_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3Model"]  # what the test stands for
    engine = make_engine(st_dir)
    assert engine.model.config.architecture == "Qwen3ForCausalLM"
    outs = run(engine, [(text, params_of(st_dir)) for text in TEXTS])
    torch.testing.assert_close(torch.stack([out.pooled for out in outs]), st_encode(st_dir, TEXTS), atol=ATOL, rtol=0)


def test_long_input_prefilled_in_chunks(st_models):
    st_dir, expected = st_models["qwen2-mean"]
    engine = make_engine(st_dir, max_num_batched_tokens=16)
    steps = record_steps(engine)
    (out,) = run(engine, [(TEXTS[5], params_of(st_dir))])
    assert len(out.prompt_token_ids) > 100
    assert len(steps) == -(-len(out.prompt_token_ids) // 16)  # one 16-token chunk per step
    torch.testing.assert_close(out.pooled, expected[5], atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", ["qwen3-last", "qwen2-mean"])
def test_mixed_with_generation_in_the_same_steps(st_models, case):
    st_dir, expected = st_models[case]
    prompts = random_prompts(6, 400, 3, 40, seed=11)
    gen_params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True) for _ in prompts]
    alone = [o.outputs[0].token_ids for o in make_engine(st_dir).generate(prompts, gen_params)]

    engine = make_engine(st_dir)
    steps = record_steps(engine)
    pooling = params_of(st_dir)
    requests = [(p, sp) for p, sp in zip(prompts, gen_params)]
    requests[2:2] = [(text, pooling) for text in TEXTS]  # embeddings join between generations
    outs = run(engine, requests)
    assert any(chunks and sampling for chunks, sampling, _ in steps)  # pooled and sampled in one step
    generated = [o.outputs[0].token_ids for o in outs if o.pooled is None]
    assert generated == alone
    got = torch.stack([o.pooled for o in outs if o.pooled is not None])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_preemption_recomputes_a_pooled_prompt(st_models):
    """A pool so small that decodes preempt the prompts being prefilled, pooling ones included."""
    st_dir, expected = st_models["qwen2-mean"]
    # 13 blocks of 16 tokens; the ~125-token input needs 8 of them
    block_bytes = 2 * 2 * 2 * 16 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, fp32
    engine = make_engine(st_dir, kv_cache_memory=13 * block_bytes, max_model_len=200, max_num_batched_tokens=16)
    preempted_pooling = []
    schedule = engine.scheduler.schedule

    def watching():
        out = schedule()
        preempted_pooling.extend(s for s in out.preempted if s.pooling is not None)
        return out

    engine.scheduler.schedule = watching
    prompts = random_prompts(4, 400, 20, 40, seed=2)
    requests = [(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) for p in prompts]
    requests += [(text, params_of(st_dir)) for text in TEXTS]
    outs = run(engine, requests)
    assert preempted_pooling, "no pooling request was preempted: the test no longer tests that"
    got = torch.stack([o.pooled for o in outs if o.pooled is not None])
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


def test_prefix_cache_serves_last_pooling_only(st_models):
    for case, hits in (("qwen3-last", True), ("qwen2-mean", False)):
        st_dir, expected = st_models[case]
        engine = make_engine(st_dir)
        params = params_of(st_dir)
        (first,) = run(engine, [(TEXTS[3], params)])
        (second,) = run(engine, [(TEXTS[3], params)])
        assert first.num_cached_tokens == 0
        assert (second.num_cached_tokens > 0) is hits
        torch.testing.assert_close(second.pooled, expected[3], atol=ATOL, rtol=0)


def test_a_last_pending_token_runs_as_a_decode_row(st_models):
    """A chunk that leaves one token: the scheduler runs it as a decode, beside a generation's rows."""
    st_dir, _ = st_models["qwen3-last"]
    prompt = random_prompts(1, 400, 17, 17, seed=9)[0]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    (alone,) = run(make_engine(st_dir), [(prompt, PoolingParams())])
    (gen_alone,) = run(make_engine(st_dir), [([5, 6, 7], greedy)])
    engine = make_engine(st_dir, max_num_batched_tokens=16)
    steps = record_steps(engine)
    pooled, gen = run(engine, [(prompt, PoolingParams()), ([5, 6, 7], greedy)])
    assert steps[0] == (1, 0, [16]) and steps[1] == (0, 1, [])  # step 2: its 17th token as a decode row
    assert gen.outputs[0].token_ids == gen_alone.outputs[0].token_ids
    torch.testing.assert_close(pooled.pooled, alone.pooled, atol=ATOL, rtol=0)


def test_abort_mid_prefill_gives_everything_back(st_models):
    st_dir, _ = st_models["qwen2-mean"]
    engine = make_engine(st_dir, max_num_batched_tokens=16)
    request_id = engine.add_request(TEXTS[5], params_of(st_dir))
    engine.step()
    engine.step()
    assert engine.pooler.num_partial == 1
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    assert engine.abort(request_id)
    assert engine.pooler.num_partial == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_unfinished()


def test_dimensions_truncate_then_normalize(st_models):
    st_dir, _ = st_models["qwen3-last"]
    engine = make_engine(st_dir)
    (raw,) = run(engine, [(TEXTS[3], PoolingParams("last", normalize=False))])
    (short,) = run(engine, [(TEXTS[3], PoolingParams("last", normalize=True, dimensions=16))])
    assert short.pooled.shape == (16,)
    torch.testing.assert_close(short.pooled, torch.nn.functional.normalize(raw.pooled[:16], dim=-1))
    with pytest.raises(InvalidRequestError, match="hidden size"):
        engine.add_request("x", PoolingParams(dimensions=65))


def test_last_position_logits_of_a_few_tokens(st_models):
    """``logit_token_ids``: the LM head at the last position, those ids only (a reranker's yes/no)."""
    from transformers import AutoModelForCausalLM

    st_dir, _ = st_models["qwen3-last"]
    engine = make_engine(st_dir)
    ids = [7, 300, 11]
    prompts = random_prompts(3, 400, 5, 70, seed=4)
    outs = run(engine, [(p, PoolingParams("last", normalize=False, logit_token_ids=ids)) for p in prompts])
    hf = AutoModelForCausalLM.from_pretrained(st_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        for prompt, out in zip(prompts, outs):
            want = hf(torch.tensor([prompt])).logits[0, -1, ids]
            torch.testing.assert_close(out.pooled, want, atol=1e-4, rtol=0)


def test_a_pooling_prompt_may_fill_the_context(st_models):
    st_dir, _ = st_models["qwen3-last"]
    engine = make_engine(st_dir, max_model_len=64)
    (out,) = run(engine, [(list(range(3, 67)), PoolingParams())])
    assert out.pooled.shape == (64,)
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        engine.add_request(list(range(3, 68)), PoolingParams())


def test_pooler_config_from_sentence_transformers_files(st_models, tmp_path):
    for case, (_, pooling) in CASES.items():
        st_dir, _ = st_models[case]
        assert read_sentence_transformers(st_dir) == (pooling, True)
    st_dir, _ = st_models["qwen3-last"]
    config = resolve_pooler_config(st_dir)
    assert (config.pooling, config.normalize, config.matryoshka_dimensions) == ("last", True, None)
    assert "sentence-transformers" in config.source
    overridden = resolve_pooler_config(st_dir, "mean", False, True)
    assert (overridden.pooling, overridden.normalize, overridden.matryoshka_dimensions) == ("mean", False, [])
    # no sentence-transformers files: last token, normalized
    plain = resolve_pooler_config(tmp_path)
    assert (plain.pooling, plain.normalize) == ("last", True) and "default" in plain.source
    # the older layout (one boolean per mode), and modes llmctl refuses
    legacy = tmp_path / "legacy"
    (legacy / "1_Pooling").mkdir(parents=True)
    (legacy / "modules.json").write_text(
        json.dumps(
            [
                {"path": "", "type": "sentence_transformers.models.Transformer"},
                {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )
    (legacy / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False})
    )
    assert read_sentence_transformers(legacy) == ("mean", False)
    (legacy / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "max"}))
    with pytest.raises(ValueError, match="not one llmctl runs"):
        read_sentence_transformers(legacy)
    (legacy / "config.json").write_text(json.dumps({"matryoshka_dimensions": [16, 32]}))
    (legacy / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "cls"}))
    assert resolve_pooler_config(legacy).matryoshka_dimensions == [16, 32]
