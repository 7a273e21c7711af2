"""The stop-string matcher against a brute-force reference (the text searched again after each
piece, as the engine and the streams did before the matcher) on random strings, and a stream
with long stop strings from a real server on ``dummy:tiny``."""

from __future__ import annotations

import json
import statistics
import time

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_utils import server_process

from flashserve.engine.stop_strings import StopMatcher

# a small alphabet makes overlaps, repeats and partial matches frequent
TEXT = st.text(alphabet="abc", max_size=8)
STOPS = st.lists(st.text(alphabet="abc", min_size=1, max_size=6), min_size=1, max_size=4)


def _reference(text: str, piece: int, stops: list[str]) -> tuple[int | None, int]:
    """(where the earliest stop string that the last ``piece`` characters of ``text``
    completed begins, or None; the longest tail of ``text`` that is a proper prefix of a stop
    string), by searching the whole text."""
    ends = [(i, len(s)) for s in stops for i in range(len(text) - len(s) + 1)
            if text.startswith(s, i) and i + len(s) > len(text) - piece]  # fmt: skip
    cut = min((i for i, _ in ends), default=None)
    tail = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return cut, tail


@settings(max_examples=400, deadline=None)
@given(stops=STOPS, pieces=st.lists(TEXT, max_size=12))
def test_matcher_equals_searching_the_whole_text(stops, pieces):
    matcher, text = StopMatcher(stops), ""
    for piece in pieces:
        text += piece
        cut = matcher.feed(piece)
        want_cut, want_tail = _reference(text, len(piece), stops)
        assert cut == want_cut, (text, piece, stops)
        if cut is not None:
            return  # the request ends here
        assert matcher.held_back == want_tail, (text, stops)


def test_earliest_start_wins_when_one_piece_completes_several():
    """The stop "abc" begins before "b", though "b" completes first: the cut is at "abc"."""
    matcher = StopMatcher(["b", "abc"])
    assert matcher.feed("xa") is None and matcher.held_back == 1
    assert matcher.feed("bc") == 1


def test_no_stop_strings():
    matcher = StopMatcher([])
    assert matcher.feed("anything") is None and matcher.held_back == 0


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match="empty"):
        StopMatcher(["a", ""])


def test_cost_per_piece_does_not_grow_with_the_text_or_the_stop_length():
    """16 stop strings of 100 KB that share the text's prefix (the worst case for a rescan):
    the last 200 pieces of a 6000-character text cost about what the first 200 did."""
    text = "ab" * 3000
    stops = [text[:-2] + "x" * 100_000 + str(i) for i in range(16)]
    matcher = StopMatcher(stops)
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]

    def timed(chunk: list[str]) -> float:
        t0 = time.perf_counter()
        for p in chunk:
            assert matcher.feed(p) is None
        return time.perf_counter() - t0

    first = timed(pieces[:200])
    timed(pieces[200:-200])
    last = timed(pieces[-200:])
    assert matcher.held_back == len(text) - 2  # (ab)^2999 ends the text and begins each stop
    assert last < 3 * first + 0.005, f"first 200 pieces {first:.4f} s, last 200 {last:.4f} s"


# ---- against the server ------------------------------------------------------------------------

# 16 stop strings of 100 KB (the case): letters, so that runs of one letter in the output
# are held back a while, but 100 KB of one letter never comes
LONG_STOPS = [chr(ord("a") + i) * 100_000 for i in range(16)]


@pytest.fixture(scope="module")
def tiny_url():
    # 16 x 100 KB of stop strings: a body past the default limit (32 bytes a context token)
    with server_process("--model", "dummy:tiny", "--max-request-bytes", str(4 * 2**20)) as base:
        yield base


def _stream_text(client: httpx.Client, body: dict) -> tuple[str, list[float]]:
    """The streamed completion's text, and the arrival time of each of its chunks."""
    text, times = "", []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[len("data: ") :])["choices"][0]["text"]
                times.append(time.monotonic())
    return text, times


def test_long_stop_strings_cost_the_same_per_token_all_along_the_stream(tiny_url):
    """Before the matcher, each token rescanned the text for every stop string: the time per
    token grew with the text (4x from the first 100 chunks to the last 100 here; 1.2x now).
    Compared as the median gap between chunks, over two streams if the first is off: a busy
    machine stretches some gaps (once by 3.7x over 100 chunks' sum, in a CI run sharing the
    CPU), where a rescan stretches every gap of the later chunks, in each stream."""
    # seeded sampling: random tokens, half of them placeholders "<|id|>" of 7 characters
    body = {"prompt": "hello", "max_tokens": 800, "seed": 7, "ignore_eos": True}
    seen = []
    with httpx.Client(base_url=tiny_url, timeout=300) as client:
        plain = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        for _ in range(2):
            text, times = _stream_text(client, {**body, "stop": LONG_STOPS})
            assert text == plain, "no stop string matches: the stream is the whole text"
            assert len(times) > 400 and len(plain) > 2000, (len(times), len(plain))
            gaps = [b - a for a, b in zip(times, times[1:])]
            # from the second chunk: the first one waits for the prefill
            first, last = statistics.median(gaps[1:101]), statistics.median(gaps[-100:])
            seen.append(f"{first * 1e3:.2f} -> {last * 1e3:.2f} ms")
            if last < 2.5 * first + 1e-3:
                return
    pytest.fail(f"median gap between chunks, first 100 -> last 100: {seen}")
