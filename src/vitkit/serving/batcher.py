"""Requests that arrive together are answered together: one forward pass over the uploads waiting at that moment.

Nothing waits for a batch to fill (no added latency for a lone request): a worker takes the first waiting upload and
whatever else is queued behind it, up to ``max_batch``, and runs them in a thread, off the event loop, so the page
and the API keep answering. ``workers`` such batches run at once. Past ``max_queue`` waiting uploads the server is
busy: ``submit`` raises ``Busy`` at once (HTTP 503 with Retry-After) instead of making everyone wait longer.
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable

import anyio


class Busy(Exception):
    """The queue is full: answer "busy, retry"."""


class Batcher:
    def __init__(self, fn: Callable[[list[Any]], list[Any]], workers: int = 1, max_batch: int = 16,
                 max_queue: int = 32) -> None:
        self.fn, self.workers, self.max_batch, self.max_queue = fn, max(1, workers), max(1, max_batch), max_queue
        self.pending = 0  # waiting or running
        self._queue: asyncio.Queue | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []

    def _start(self) -> asyncio.Queue:
        """The queue and its workers, on the running event loop (started on first use; again if the loop changed,
        as it does between requests of a TestClient used without ``with``)."""
        loop = asyncio.get_running_loop()
        if self._queue is None or self._loop is not loop:
            self._loop, self._queue = loop, asyncio.Queue()
            self._tasks = [loop.create_task(self._work(self._queue)) for _ in range(self.workers)]
        return self._queue

    async def submit(self, item: Any) -> Any:
        """``fn``'s result for ``item`` (or the exception it returned for it, raised here)."""
        if self.pending >= self.max_queue:
            raise Busy
        queue = self._start()
        future = asyncio.get_running_loop().create_future()
        self.pending += 1
        try:
            queue.put_nowait((item, future))
            result = await future
        finally:
            self.pending -= 1
        if isinstance(result, BaseException):
            raise result
        return result

    async def _work(self, queue: asyncio.Queue) -> None:
        while True:
            batch = [await queue.get()]
            while len(batch) < self.max_batch and not queue.empty():
                batch.append(queue.get_nowait())
            live = [(item, f) for item, f in batch if not f.done()]  # a client that left is not computed for
            if not live:
                continue
            try:
                results = await anyio.to_thread.run_sync(self.fn, [item for item, _ in live])
            except Exception as e:  # noqa: BLE001 - every request of the batch gets the error
                results = [e] * len(live)
            for (_, f), r in zip(live, results):
                if not f.done():
                    f.set_result(r)
