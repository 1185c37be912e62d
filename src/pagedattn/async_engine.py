"""``AsyncEngine``: one ``LLMEngine`` serving requests as they arrive, for an asyncio server (``pagedattn.serve``).

This is the online setting of the paper's evaluation (§6.1): requests arrive while others run, join the running
batch at the next iteration (iteration-level scheduling, §4.5) and leave when done. The engine loop is a background
asyncio task; each ``LLMEngine`` call (``add_request``, ``abort_request``, ``step``) runs on one worker thread, so
exactly one thread ever touches the engine and the event loop stays free to accept requests and stream tokens while
a step computes. The loop sleeps when no request is in flight.

Each request's outputs reach its consumer through a ``_Stream`` that keeps only the latest ``RequestOutput`` (outputs
are cumulative, so a slow consumer skips intermediate ones and memory stays bounded). A consumer that stops early (a
client that disconnected) has its request aborted, which frees its blocks before the next step.

Text is tokenized (``tokenize``, ``run_tokenizer``) on a second worker thread, never the engine's: a long prompt
costs its own request time, while the steps of the requests in flight go on. Requests reach the engine as token ids.
"""
from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Protocol

from pagedattn.engine import LLMEngine
from pagedattn.sequence import RequestOutput, SamplingParams

log = logging.getLogger(__name__)


class OutputObserver(Protocol):
    """What watches every output the loop delivers (the server's Prometheus metrics, ``serve_metrics``)."""

    def observe(self, output: RequestOutput) -> None: ...

    def forget(self, request_id: str) -> None: ...


class EngineOverloaded(Exception):
    """More requests wait for their first token than ``max_queued`` allows; the server answers 503."""


class _Stream:
    """The latest output of one request and an event set when a newer one (or the end) arrives."""

    def __init__(self) -> None:
        self.latest: RequestOutput | None = None
        self.error: str | None = None  # set when the engine failed; the request ends
        self.done = False
        self.event = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        self.latest = output
        self.done = output.finished
        self.event.set()

    def fail(self, message: str) -> None:
        self.error, self.done = message, True
        self.event.set()


class AsyncEngine:
    """Serve an ``LLMEngine`` from asyncio: ``generate`` adds a request and yields its outputs as steps produce them.

    ``max_queued`` bounds the requests admitted but not yet given a first token (waiting in the scheduler's queue or
    about to be added); beyond it ``generate`` raises ``EngineOverloaded`` instead of queueing without limit.
    Call ``start()`` inside the running event loop and ``await stop()`` at shutdown."""

    def __init__(self, engine: LLMEngine, max_queued: int = 1000, observer: OutputObserver | None = None) -> None:
        self.engine = engine
        self.max_queued = max_queued
        self.observer = observer
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._tokenizer_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._streams: dict[str, _Stream] = {}
        self._queued: set[str] = set()  # admitted, no output yet
        self._aborts: set[str] = set()  # to abort on the worker before the next step
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    # ------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        for s in self._streams.values():
            s.fail("the server is shutting down")
        self._worker.shutdown(wait=True)
        self._tokenizer_worker.shutdown(wait=True)

    async def _call(self, fn, *args):
        """Run ``fn(*args)`` on the engine's worker thread."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    async def run_tokenizer(self, fn: Callable, *args):
        """Run ``fn(*args)`` (tokenizing, a chat template) on the tokenizer's thread: off the engine's thread and the
        event loop, so that a long text stalls neither the steps in flight nor the streams."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_worker, fn, *args)

    async def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """A text's token ids, on the tokenizer's thread; ``ValueError`` without a tokenizer."""
        tokenizer: Any = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; this model has none: send token ids")
        return await self.run_tokenizer(lambda: list(tokenizer(prompt, add_special_tokens=add_special_tokens)
                                                     ["input_ids"]))

    # ------------------------------------------------------------------------------------------- requests
    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    async def generate(self, request_id: str, prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Add the request and yield its outputs (cumulative: each holds every token so far) until it finishes.
        Raises ``ValueError`` (naming the limit) for a request the engine refuses, ``EngineOverloaded`` when
        ``max_queued`` requests already wait. Closing the iterator early aborts the request and frees its blocks."""
        if len(self._queued) >= self.max_queued:
            raise EngineOverloaded(f"{len(self._queued)} requests are waiting for their first token "
                                   f"(max_queued={self.max_queued}); retry later")
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = self._streams[request_id] = _Stream()
        self._queued.add(request_id)
        try:
            await self._call(self.engine.add_request, request_id, prompt, params)
        except ValueError:  # refused: never reached the engine
            self._forget(request_id)
            raise
        except BaseException:  # cancelled while the worker adds it: take it out again
            self._forget(request_id)
            self.abort(request_id)
            raise
        assert self._wake is not None  # (made when the loop starts)
        self._wake.set()
        try:
            while True:
                await stream.event.wait()
                stream.event.clear()
                if stream.error is not None:
                    raise RuntimeError(stream.error)
                if stream.latest is not None:
                    yield stream.latest
                if stream.done:
                    return
        finally:
            if not stream.done:  # the consumer left early (client disconnected): free its blocks
                self.abort(request_id)
            self._forget(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request at the next step (its blocks are freed on the worker thread)."""
        self._aborts.add(request_id)
        if self._wake is not None:
            self._wake.set()

    def _forget(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._queued.discard(request_id)
        if self.observer is not None:
            self.observer.forget(request_id)

    # ---------------------------------------------------------------------------------------- engine loop
    def _step(self, aborts: list[str]) -> tuple[list[RequestOutput], bool]:
        """On the worker: abort, then one engine step if any request is left. Returns the outputs and whether
        requests remain."""
        if aborts:
            self.engine.abort_request(aborts)
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        return outputs, self.engine.has_unfinished_requests()

    async def _loop(self) -> None:
        busy = False
        wake = self._wake
        assert wake is not None  # (made when the loop starts)
        while True:
            if not busy and not self._aborts:
                await wake.wait()
            wake.clear()
            aborts, self._aborts = list(self._aborts), set()
            try:
                outputs, busy = await self._call(self._step, aborts)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug in a step: fail the requests in flight, keep serving new ones
                log.exception("engine step failed")
                busy = await self._reset(f"engine step failed: {type(e).__name__}: {e}")
                continue
            for o in outputs:
                stream = self._streams.get(o.request_id)
                self._queued.discard(o.request_id)
                if stream is not None:
                    stream.put(o)
                if self.observer is not None:
                    self.observer.observe(o)
            await asyncio.sleep(0)  # let handlers stream and new requests arrive between steps

    async def _reset(self, message: str) -> bool:
        rids = list(self._streams)
        for rid in rids:
            self._streams[rid].fail(message)
        try:
            await self._call(lambda: self.engine.abort_request(list(self.engine.requests)))
        except Exception:
            log.exception("aborting the requests of a failed step failed too")
        return False
