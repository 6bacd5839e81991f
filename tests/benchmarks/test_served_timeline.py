"""benchmarks/served_timeline.py splits serve's hand-over into its parts by matching each post of
the engine thread to the event loop's next delivery, SSE chunk and socket write."""

from __future__ import annotations

import pytest

from benchmarks.served_timeline import analyse, hand_over

US = 1e-6


def _token(t0: float, post_us: float, write_us: float) -> list[tuple[str, float, float]]:
    """One token's spans: a 3 ms step, then the next step's post with the loop's work inside it."""
    step_end = t0 + 3000 * US
    post = step_end + 50 * US
    delivery = post + 40 * US
    encoded = delivery + 80 * US
    write = encoded + 30 * US
    return [
        ("step", t0, step_end),
        ("post", post, post + post_us * US),
        ("delivery", delivery, delivery + 5 * US),
        ("sse", encoded, encoded),
        ("write", write, write + write_us * US),
    ]


def test_each_post_is_split_into_wake_python_send_and_write():
    spans = [s for i in range(5) for s in _token(i * 4000 * US, post_us=300 + i, write_us=100 + 2 * i)]
    parts = hand_over(spans, first=0.0, last=1.0)
    assert parts["post"] == pytest.approx(302, abs=0.1)  # the median of 300..304
    assert parts["wake"] == pytest.approx(40, abs=0.1)
    assert parts["python"] == pytest.approx(80, abs=0.1)
    assert parts["send"] == pytest.approx(30, abs=0.1)
    assert parts["write"] == pytest.approx(104, abs=0.1)


def test_posts_outside_the_stream_and_unanswered_posts_are_left_out():
    spans = _token(0.0, post_us=300, write_us=100) + _token(4000 * US, post_us=900, write_us=900)
    spans.append(("post", 9000 * US, 9100 * US))  # no delivery followed it
    assert hand_over(spans, first=0.0, last=3500 * US)["post"] == pytest.approx(300, abs=0.1)
    assert hand_over(spans, first=0.0, last=1.0)["post"] == pytest.approx(600, abs=0.1)  # the 9 ms post has none


def test_analyse_adds_the_hand_over_only_where_posts_were_recorded():
    spans = [s for i in range(4) for s in _token(i * 4000 * US, post_us=300, write_us=100)]
    receives = [i * 4000 * US + 3400 * US for i in range(4)]
    assert "hand-over" in analyse(spans, receives)
    assert "hand-over" not in analyse([s for s in spans if s[0] == "step"], receives)
