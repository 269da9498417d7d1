"""Dynamic batching for the served model: the sentences of requests that are in the server at the
same time are translated by one length-sorted batched search, as `transformer translate` translates
a file, instead of one small search a request competing for the same cores."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class _Request:
    lines: list[str]
    tokens: int  # source tokens, as decoding counts them
    deadline: float  # time.monotonic() after which no one waits for the answer
    since: float = field(default_factory=time.monotonic)
    answer: Future = field(default_factory=Future)


class Batcher:
    """Translates the requests of concurrent callers together, in one thread of its own.

    A caller announces itself as soon as it starts on a request (`arrival`), prepares it (tokenizing
    and checking take a few milliseconds) and hands over its sentences; the decoding thread then
    takes every request waiting, up to `max_tokens` source tokens (and always the oldest, however
    large), and translates them with one call of `translate(lines, timeout)`. While other callers
    are still preparing, it waits for them, at most `window` seconds from the oldest waiting
    request; after a search that served several requests it waits out the window from that
    search's end, since under load the callers it answered are about to send again. A lone request
    on a quiet server is translated at once, and requests arriving together share a search.
    Requests that come in while a search runs wait for the next one. A single decoding thread also
    keeps torch's thread pool to one caller, so concurrent requests do not oversubscribe the cores.

    Each request's answer is its own translations; a request whose deadline passes while it waits
    gets a TimeoutError without being translated; an error in a search is raised to every request
    of that search, and the next search runs as usual."""

    def __init__(self, translate: Callable[[list[str], float], list[str]], *, window: float, max_tokens: int):
        self.translate, self.window, self.max_tokens = translate, window, max_tokens
        self._changed = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._preparing = 0
        self._served, self._ended = 0, 0.0  # the last search's requests, and when it ended
        threading.Thread(target=self._serve, name="translation batcher", daemon=True).start()

    @property
    def waiting(self) -> int:
        """Requests handed over and not yet taken by a search."""
        with self._changed:
            return len(self._waiting)

    @contextmanager
    def arrival(self) -> Iterator[Callable[[list[str], int, float], Future]]:
        """Counts the caller as on its way while it prepares its request, and yields the function that
        hands the request over (lines, source tokens, deadline) and returns the future of its answer.
        Leaving without handing one over (a bad request) stops the count all the same."""
        handed = False

        def hand_over(lines: list[str], tokens: int, deadline: float) -> Future:
            nonlocal handed
            request = _Request(lines, tokens, deadline)
            with self._changed:
                self._preparing, handed = self._preparing - 1, True
                self._waiting.append(request)
                self._changed.notify_all()
            return request.answer

        with self._changed:
            self._preparing += 1
        try:
            yield hand_over
        finally:
            if not handed:
                with self._changed:
                    self._preparing -= 1
                    self._changed.notify_all()

    def _serve(self) -> None:
        while True:
            batch = self._next_batch()
            self._run(batch)
            with self._changed:
                self._served, self._ended = len(batch), time.monotonic()

    def _next_batch(self) -> list[_Request]:
        with self._changed:
            self._changed.wait_for(lambda: self._waiting)
            # Under load, the callers the last search answered send their next requests within moments:
            # after a search of several requests, wait out the window for them as for callers preparing.
            loaded = self._served > 1
            closes = max(self._waiting[0].since, self._ended if loaded else 0) + self.window
            while (self._preparing or loaded) and sum(r.tokens for r in self._waiting) < self.max_tokens:
                if not self._changed.wait(closes - time.monotonic()):
                    break  # the window closed
            batch, tokens = [], 0
            while self._waiting and (not batch or tokens + self._waiting[0].tokens <= self.max_tokens):
                batch.append(self._waiting.popleft())
                tokens += batch[-1].tokens
        return batch

    def _run(self, batch: list[_Request]) -> None:
        now = time.monotonic()
        for late in (r for r in batch if r.deadline <= now):
            late.answer.set_exception(TimeoutError("the request's time ran out while it waited"))
        batch = [r for r in batch if r.deadline > now]
        if not batch:
            return
        try:
            found = self.translate([line for r in batch for line in r.lines], max(r.deadline for r in batch) - now)
        except Exception as e:  # the search's failure is each of its requests'; the thread goes on
            for request in batch:
                request.answer.set_exception(e)
            return
        start = 0
        for request in batch:
            request.answer.set_result(found[start : start + len(request.lines)])
            start += len(request.lines)
