"""``AsyncEngine``: one ``LLMEngine`` serving requests as they arrive, for an asyncio server (``pagedattn.serve``).

This is the online setting of the paper's evaluation (§6.1): requests arrive while others run, join the running
batch at the next iteration (iteration-level scheduling, §4.5) and leave when done. The engine loop is a background
asyncio task; each ``LLMEngine`` call (``add_request``, ``abort_request``, ``step``) runs on one worker thread, so
exactly one thread ever touches the engine and the event loop stays free to accept requests and stream tokens while
a step computes. The loop sleeps when no request is in flight.

Each request's outputs reach its consumer through a ``_Stream`` that keeps only the latest ``RequestOutput`` (outputs
are cumulative, so a slow consumer skips intermediate ones and memory stays bounded); the last one, with every
sequence finished, always reaches it. The prompts of one HTTP request are counted against ``max_queued`` before any
work, added in chunks between steps, and released together: a consumer that stops early (a client that disconnected)
has every prompt aborted, the ones not yet added included, which frees their blocks before the next step.

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
    """The latest output of one request. ``event`` is set when a newer one (or the end) arrives; the prompts of one
    HTTP request share it, so that one consumer waits for all of them."""

    def __init__(self, event: asyncio.Event) -> None:
        self.latest: RequestOutput | None = None
        self.error: str | None = None  # set when the engine failed; the request ends
        self.done = False
        self.event = event

    def put(self, output: RequestOutput) -> None:
        self.latest = output
        self.done = output.finished
        self.event.set()

    def fail(self, message: str) -> None:
        self.error, self.done = message, True
        self.event.set()


#: prompts of one request added per call on the engine's thread: steps run and a disconnect stops the rest in between
ADD_CHUNK = 256


class AsyncEngine:
    """Serve an ``LLMEngine`` from asyncio. A request of several prompts is ``reserve``d (counted against
    ``max_queued`` before any work), ``add``ed, and read with ``outputs``, which releases it at the end; ``generate``
    does all three for one prompt.

    ``max_queued`` bounds the requests (prompts) admitted but not yet given a first token (reserved, waiting in the
    scheduler's queue or about to be added); beyond it ``reserve`` raises ``EngineOverloaded`` instead of queueing
    without limit. Call ``start()`` inside the running event loop and ``await stop()`` at shutdown."""

    def __init__(self, engine: LLMEngine, max_queued: int = 1000, observer: OutputObserver | None = None) -> None:
        self.engine = engine
        self.max_queued = max_queued
        self.observer = observer
        self.num_added = 0  # requests given to the engine since the start
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._tokenizer_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")
        self._streams: dict[str, _Stream] = {}
        self._queued: set[str] = set()  # reserved, no output yet
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

    def reserve(self, request_ids: list[str]) -> None:
        """Count ``request_ids`` (the prompts of one HTTP request) against ``max_queued`` up front, before any
        tokenizing or adding: ``EngineOverloaded`` when they do not all fit, ``ValueError`` for an id in use. The
        caller must ``release`` them (``outputs`` does) however the request ends."""
        if len(self._queued) + len(request_ids) > self.max_queued:
            raise EngineOverloaded(f"{len(self._queued)} requests are waiting for their first token and this one "
                                   f"adds {len(request_ids)} (max_queued={self.max_queued}); retry later")
        used = next((r for r in request_ids if r in self._streams), None)
        if used is not None:
            raise ValueError(f"request id {used!r} is already in use")
        event = asyncio.Event()
        for rid in request_ids:
            self._streams[rid] = _Stream(event)
        self._queued.update(request_ids)

    async def add(self, request_ids: list[str], prompts: list, params: list[SamplingParams]) -> None:
        """Give reserved requests to the engine, ``ADD_CHUNK`` per call on its thread, so that steps run between
        chunks. Raises the engine's ``ValueError`` (naming the limit) for a prompt it refuses. Cancelled (the client
        went away), it adds no more; ``release`` aborts the ones added."""
        assert self._wake is not None  # (made when the loop starts)
        for start in range(0, len(request_ids), ADD_CHUNK):
            end = start + ADD_CHUNK
            await self._call(self._add_chunk, request_ids[start:end], prompts[start:end], params[start:end])
            self._wake.set()

    def _add_chunk(self, request_ids: list[str], prompts: list, params: list[SamplingParams]) -> None:
        for rid, prompt, p in zip(request_ids, prompts, params):
            self.engine.add_request(rid, prompt, p)
            self.num_added += 1

    async def outputs(self, request_ids: list[str]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(index in request_ids, output)`` for each new output of the requests (cumulative: each holds every
        token so far; a slow consumer skips intermediate ones), every request's final output included, until all
        are finished. An engine failure is raised as ``RuntimeError``. However it ends (closed early: the client
        disconnected), the requests are released: the unfinished ones are aborted and their blocks freed."""
        streams = [self._streams[r] for r in request_ids]
        event = streams[0].event if streams else asyncio.Event()
        sent: list[RequestOutput | None] = [None] * len(streams)
        try:
            while streams:
                await event.wait()
                event.clear()
                # read each stream's output and end together: one that finishes while we yield is read next round
                now = [(s.latest, s.done, s.error) for s in streams]
                for i, (latest, _, error) in enumerate(now):
                    if error is not None:
                        raise RuntimeError(error)
                    if latest is not None and latest is not sent[i]:
                        sent[i] = latest
                        yield i, latest
                if all(done for _, done, _ in now):
                    return
        finally:
            self.release(request_ids)

    async def generate(self, request_id: str, prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """One prompt: reserve, add, and yield its outputs until it finishes (its final output last). Raises
        ``ValueError`` (naming the limit) for a request the engine refuses, ``EngineOverloaded`` when ``max_queued``
        requests already wait. Closing the iterator early aborts the request and frees its blocks."""
        self.reserve([request_id])
        try:
            await self.add([request_id], [prompt], [params])
        except BaseException:  # refused, or cancelled while the worker adds it: take it out again
            self.release([request_id])
            raise
        async for _, out in self.outputs([request_id]):
            yield out

    def release(self, request_ids: list[str]) -> None:
        """Forget reserved requests; the unfinished ones are aborted at the next step (blocks freed on the worker).
        Aborting a request that never reached the engine is harmless."""
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is None:
                continue
            if not stream.done:
                self._aborts.add(rid)
            self._queued.discard(rid)
            if self.observer is not None:
                self.observer.forget(rid)
        if self._aborts and self._wake is not None:
            self._wake.set()

    def abort(self, request_id: str) -> None:
        """Abort a request at the next step (its blocks are freed on the worker thread)."""
        self._aborts.add(request_id)
        if self._wake is not None:
            self._wake.set()

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
                if stream is None:  # released (its client went away): its abort is on its way
                    continue
                self._queued.discard(o.request_id)
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
