"""The engine driven through its public API only: add_request / step / abort / has_unfinished /
generate, and the stats surface (counters, stats_snapshot). No internals are read here."""

from __future__ import annotations

import pytest

from llmctl.engine.llm_engine import LLMEngine
from llmctl.sampling_params import SamplingParams

EXPECTED = ", there was a little girl named Lily. She loved to play outside in the park. One day,"


@pytest.fixture
def engine(stories_dir):
    return LLMEngine(model=str(stories_dir), kv_cache_memory=4 << 20, max_num_batched_tokens=8)


def run_streams(engine: LLMEngine) -> dict[str, list]:
    streams: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            streams.setdefault(out.request_id, []).append(out)
    return streams


def test_streams_stops_samples_and_abort(engine):
    greedy = engine.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=30))
    stopped = engine.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=30, stop=["Lily"]))
    samples = engine.add_request("Once upon a time", SamplingParams(n=3, seed=7, max_tokens=6, logprobs=2))
    doomed = engine.add_request("Once upon a time", SamplingParams(temperature=0, max_tokens=30))
    assert engine.abort(doomed) and not engine.abort(doomed)  # aborted while waiting: it never ran
    streams = run_streams(engine)

    assert "".join(o.outputs[0].delta_text for o in streams[greedy]) == EXPECTED
    assert streams[greedy][-1].outputs[0].finish_reason == "length"
    last = streams[stopped][-1].outputs[0]
    assert (last.text, last.finish_reason, last.stop_reason) == (", there was a little girl named ", "stop", "Lily")
    final = streams[samples][-1]
    assert final.finished and [o.index for o in final.outputs] == [0, 1, 2]
    for o in final.outputs:
        assert len(o.token_ids) == len(o.logprobs) == len(o.top_logprobs) == 6
        assert all(len(top) == 2 for top in o.top_logprobs)
    assert doomed not in streams

    counters = engine.counters()
    assert counters.requests_running == counters.requests_waiting == 0
    assert counters.kv_free_blocks == counters.kv_num_blocks and counters.kv_usage == 0
    assert counters.requests_added_total == 4
    assert counters.requests_finished == {"stop": 1, "length": 2, "abort": 1, "error": 0}
    assert counters.generation_tokens_total == 30 + len(last.token_ids) + 3 * 6


def test_snapshot_counts_requests_not_sequences(engine):
    engine.add_request("Once upon a time", SamplingParams(n=4, seed=1, max_tokens=20))
    engine.add_request("The cat", SamplingParams(max_tokens=20))
    while not any(out.request_id == "req-0" for out in engine.step()):
        pass  # until the n=4 request has forked its samples
    snap = engine.stats_snapshot()
    assert snap["scheduler"]["running"] + snap["scheduler"]["waiting"] == 2
    assert sum(1 for r in snap["requests"] if r["id"].startswith("req-0#")) == 4
    counters = engine.counters()
    assert (counters.requests_running, counters.requests_waiting) == (
        snap["scheduler"]["running"],
        snap["scheduler"]["waiting"],
    )
    assert snap["kv"]["usage"] == counters.kv_usage > 0
    assert 0 < snap["kv"]["token_utilization"] <= 1
    run_streams(engine)
    snap = engine.stats_snapshot()
    assert snap["kv"]["free"] + snap["kv"]["cached"] == snap["kv"]["num_blocks"]
    assert snap["latency"]["count"] == 2 and snap["latency"]["ttft_s"]["p50"] > 0
