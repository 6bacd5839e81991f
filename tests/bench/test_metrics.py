"""The benchmark arithmetic against timelines computed by hand."""

from __future__ import annotations

import random

import numpy as np
import pytest

from llmctl.bench.metrics import Distribution, RequestRecord, Slo, percentile, summarize


def timeline() -> list[RequestRecord]:
    """Four requests on one clock (seconds):

    A: sent 0.0, chunks at 0.2 0.3 0.45 0.5, 4 tokens, done 0.5   -> TTFT 0.2, TPOT 0.3/3 = 0.1, ITL .1 .15 .05
    B: sent 1.0, one chunk at 1.5, 1 token, done 1.6               -> TTFT 0.5, no TPOT, no ITL, E2E 0.6
    C: sent 0.1, failed at 0.3                                      -> excluded from every latency
    D: sent 0.5, chunks at 0.6 0.8 1.0, 5 tokens (one chunk held 3), done 1.0 -> TTFT 0.1, TPOT 0.4/4 = 0.1,
       ITL .2 .2
    """
    return [
        RequestRecord(start=0.0, end=0.5, chunk_times=[0.2, 0.3, 0.45, 0.5], prompt_tokens=10, output_tokens=4),
        RequestRecord(start=1.0, end=1.6, chunk_times=[1.5], prompt_tokens=20, output_tokens=1),
        RequestRecord(start=0.1, end=0.3, prompt_tokens=30, ok=False, error="HTTP 500: boom"),
        RequestRecord(start=0.5, end=1.0, chunk_times=[0.6, 0.8, 1.0], prompt_tokens=40, output_tokens=5),
    ]


def test_per_request_figures():
    a, b, c, d = timeline()
    assert a.ttft == pytest.approx(0.2) and a.e2e == pytest.approx(0.5)
    assert a.tpot == pytest.approx((0.5 - 0.2) / (4 - 1))
    assert a.itls == pytest.approx([0.1, 0.15, 0.05])
    assert b.ttft == pytest.approx(0.5) and b.tpot is None and b.itls == []
    assert not c.succeeded and c.ttft is None and c.tpot is None
    assert d.ttft == pytest.approx(0.1) and d.e2e == pytest.approx(0.5)
    assert d.tpot == pytest.approx((0.5 - 0.1) / (5 - 1))
    assert d.itls == pytest.approx([0.2, 0.2])


def test_summary_of_hand_timeline():
    s = summarize(timeline())
    assert s.duration_s == pytest.approx(1.6)  # first send 0.0 -> last end 1.6
    assert (s.num_requests, s.completed, s.failed) == (4, 3, 1)
    assert s.input_tokens == 70 and s.output_tokens == 10  # the failed request's prompt is not counted
    assert s.request_throughput == pytest.approx(3 / 1.6)
    assert s.output_throughput == pytest.approx(10 / 1.6)
    assert s.total_token_throughput == pytest.approx(80 / 1.6)
    # TTFT ms: 200, 500, 100 -> sorted 100 200 500
    assert s.ttft_ms.count == 3
    assert s.ttft_ms.mean == pytest.approx(800 / 3)
    assert s.ttft_ms.median == pytest.approx(200)
    assert s.ttft_ms.p90 == pytest.approx(200 + 0.8 * 300)  # rank 0.9 * 2 = 1.8
    assert s.ttft_ms.p99 == pytest.approx(200 + 0.98 * 300)  # rank 1.98
    # TPOT: B has a single token and is left out
    assert s.tpot_ms.count == 2 and s.tpot_ms.mean == pytest.approx(100) and s.tpot_ms.p99 == pytest.approx(100)
    # ITL ms: 100 150 50 200 200 -> sorted 50 100 150 200 200
    assert s.itl_ms.count == 5
    assert s.itl_ms.mean == pytest.approx(140)
    assert s.itl_ms.median == pytest.approx(150)
    assert s.itl_ms.p90 == pytest.approx(200)  # rank 3.6 between 200 and 200
    # E2E ms: 500 600 500
    assert s.e2e_ms.mean == pytest.approx(1600 / 3)
    assert s.e2e_ms.p90 == pytest.approx(500 + 0.8 * 100)
    assert s.errors == ["HTTP 500: boom"]
    assert s.stream_tokens_per_s_p99 == pytest.approx(10.0)  # 1 / 100 ms


def test_goodput_counts_requests_meeting_every_slo():
    records = timeline()
    both = summarize(records, Slo(ttft_ms=300, tpot_ms=150))
    assert both.good_requests == 2  # A and D; B misses TTFT; C failed
    assert both.goodput == pytest.approx(2 / 1.6)
    tpot_only = summarize(records, Slo(tpot_ms=50))
    assert tpot_only.good_requests == 1  # only B: a single-token request has no TPOT to miss
    none = summarize(records, Slo())
    assert none.good_requests == 3 and none.goodput == pytest.approx(3 / 1.6)
    boundary = summarize(records, Slo(ttft_ms=200, tpot_ms=100))  # "at most": equal values meet it
    assert boundary.good_requests == 2


def test_explicit_duration_is_used_for_every_rate():
    s = summarize(timeline(), Slo(), duration_s=4.0)
    assert s.request_throughput == pytest.approx(0.75) and s.output_throughput == pytest.approx(2.5)


def test_percentile_edges_and_numpy_agreement():
    assert percentile([7.0], 99) == 7.0
    assert percentile([3, 1, 2], 0) == 1 and percentile([3, 1, 2], 100) == 3
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile([10, 20], 90) == pytest.approx(19)
    rng = random.Random(1)
    for n in (2, 3, 10, 101):
        values = [rng.uniform(0, 1000) for _ in range(n)]
        for p in (0, 1, 50, 90, 99, 100):
            assert percentile(values, p) == pytest.approx(float(np.percentile(values, p)))
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_empty_and_all_failed_runs():
    assert Distribution.of_seconds([]) == Distribution(0)
    s = summarize([RequestRecord(start=0.0, end=1.0, ok=False, error="refused")])
    assert s.completed == 0 and s.failed == 1 and s.ttft_ms.count == 0 and s.goodput == 0
    assert s.stream_tokens_per_s_p99 is None
    ok_but_empty = RequestRecord(start=0.0, end=1.0)  # the server answered but streamed nothing
    assert not ok_but_empty.succeeded
    assert summarize([]).duration_s == 0
