"""The served model's dynamic batching (transformer.serving.batcher), on a scripted translation: what
waits for what, which requests share a search, and whose failure is whose."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest

from transformer.serving.batcher import Batcher


class Scripted:
    """A translation that upper-cases each line and records the lines of every search; `gate`, while
    unset, holds the search in progress."""

    def __init__(self, fail_on: str | None = None):
        self.searches: list[list[str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.fail_on = fail_on

    def __call__(self, lines: list[str], timeout: float) -> list[str]:
        self.searches.append(list(lines))
        self.gate.wait(10)
        if self.fail_on in lines:
            raise RuntimeError(f"search failed on {self.fail_on!r}")
        return [line.upper() for line in lines]


def _send(batcher: Batcher, lines: list[str], deadline: float | None = None) -> Future:
    with batcher.arrival() as hand_over:
        return hand_over(
            lines, tokens=sum(len(line.split()) + 1 for line in lines), deadline=deadline or time.monotonic() + 60
        )


def _wait_until(condition, seconds: float = 10) -> None:
    until = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < until, "timed out"
        time.sleep(0.005)


def _queued_behind_a_search(batcher: Batcher, translate: Scripted, requests: list[list[str]]) -> list[Future]:
    """Sends `requests` while a first search, of the line "hold", runs; that search ends once they all wait."""
    translate.gate.clear()
    _send(batcher, ["hold"])
    _wait_until(lambda: translate.searches)
    answers = [_send(batcher, lines) for lines in requests]
    _wait_until(lambda: batcher.waiting == len(requests))
    translate.gate.set()
    return answers


def test_requests_waiting_behind_a_search_share_the_next_one_and_each_gets_its_own_lines():
    translate = Scripted()
    batcher = Batcher(translate, window=0.01, max_tokens=1000)
    waiting = _queued_behind_a_search(batcher, translate, [[f"x{i}", f"y{i} z"] for i in range(5)])
    assert [w.result(10) for w in waiting] == [[f"X{i}", f"Y{i} Z"] for i in range(5)]
    assert translate.searches == [["hold"], [line for i in range(5) for line in (f"x{i}", f"y{i} z")]]


def test_a_lone_request_is_translated_at_once_however_long_the_window():
    batcher = Batcher(Scripted(), window=30, max_tokens=1000)
    started = time.monotonic()
    assert _send(batcher, ["ein Hund"]).result(10) == ["EIN HUND"]
    assert time.monotonic() - started < 2


def test_a_request_waits_for_one_still_being_prepared_but_not_past_the_window():
    translate = Scripted()
    batcher = Batcher(translate, window=0.3, max_tokens=1000)
    with batcher.arrival():  # a caller still tokenizing, which never hands its request over
        started = time.monotonic()
        answer = _send(batcher, ["ein Hund"])
        assert answer.result(10) == ["EIN HUND"]
        waited = time.monotonic() - started
    assert 0.29 <= waited < 2, waited


def test_a_request_being_prepared_within_the_window_joins_the_search():
    translate = Scripted()
    batcher = Batcher(translate, window=5, max_tokens=1000)
    with batcher.arrival() as hand_over:
        first = _send(batcher, ["a"])
        time.sleep(0.1)  # the search waits for the caller still preparing
        second = hand_over(["b"], tokens=2, deadline=time.monotonic() + 60)
    assert (first.result(10), second.result(10), translate.searches) == (["A"], ["B"], [["a", "b"]])


def test_a_failed_search_fails_each_of_its_requests_and_the_next_search_runs():
    translate = Scripted(fail_on="boom")
    batcher = Batcher(translate, window=0.01, max_tokens=1000)
    for answer in _queued_behind_a_search(batcher, translate, [["boom"], ["fine"]]):
        with pytest.raises(RuntimeError, match="search failed on 'boom'"):
            answer.result(10)
    assert _send(batcher, ["after"]).result(10) == ["AFTER"]


def test_the_token_cap_splits_the_waiting_requests_and_a_larger_request_still_goes_alone():
    translate = Scripted()
    batcher = Batcher(translate, window=0.01, max_tokens=4)
    answers = _queued_behind_a_search(batcher, translate, [["a"], ["b"], ["c d e f g h"], ["i"]])  # 2, 2, 7, 2 tokens
    assert [a.result(10) for a in answers] == [["A"], ["B"], ["C D E F G H"], ["I"]]
    assert translate.searches[1:] == [["a", "b"], ["c d e f g h"], ["i"]]


def test_a_request_whose_deadline_passed_while_it_waited_is_not_translated():
    translate = Scripted()
    batcher = Batcher(translate, window=0.01, max_tokens=1000)
    translate.gate.clear()
    _send(batcher, ["hold"])
    _wait_until(lambda: translate.searches)
    late, on_time = _send(batcher, ["late"], deadline=time.monotonic() + 0.05), _send(batcher, ["on time"])
    time.sleep(0.1)
    translate.gate.set()
    with pytest.raises(TimeoutError):
        late.result(10)
    assert on_time.result(10) == ["ON TIME"] and translate.searches[1:] == [["on time"]]


def test_after_a_search_of_several_requests_the_next_waits_out_the_window_for_more():
    translate = Scripted()
    batcher = Batcher(translate, window=0.5, max_tokens=1000)
    pair = _queued_behind_a_search(batcher, translate, [["x"], ["y"]])
    assert [answer.result(10) for answer in pair] == [["X"], ["Y"]]  # one search served both
    first = _send(batcher, ["a"])
    time.sleep(0.1)  # a caller answered by that search sends again, within the window
    second = _send(batcher, ["b"])
    assert (first.result(10), second.result(10)) == (["A"], ["B"])
    assert translate.searches == [["hold"], ["x", "y"], ["a", "b"]]
