"""An OpenAI-compatible HTTP server for our engine: ``python -m pagedattn.serve MODEL`` (``make serve``).

The online setting of the paper's evaluation (§6.1): requests arrive over HTTP at any time and are batched at the
iteration level (§4.5) by ``AsyncEngine``. Endpoints (the full endpoint and field table is ``docs/SERVING.md``):
``POST /v1/completions`` (text or token-id prompts, several per request), ``POST /v1/chat/completions`` (the
tokenizer's chat template), both streaming as server-sent events; ``POST /tokenize``, ``POST /detokenize``,
``GET /v1/models``, ``GET /health``, ``GET /version`` and ``GET /metrics`` (Prometheus, vLLM's metric names,
``serve_metrics``). Each completion choice carries its ``token_ids`` beside ``text`` (a model without a tokenizer
has empty text). Request bodies are checked by ``openai_protocol``.

Bad input gets a 4xx in OpenAI's shape, ``{"error": {"message", "type": "invalid_request_error", "param"}}``, naming
the field or the limit: a body over ``--max-body-bytes`` gets a 413 before it is parsed, a prompt over
``--max-prompt-chars`` a 400 before it is tokenized, and text is tokenized off the engine's thread, so that no input
stalls the streams in flight. A request whose prompts would take more than ``--max-queued`` places among those
waiting for their first token gets a 503 before any work. A client that disconnects has its request cancelled (the
prompts not yet added included) and its KV blocks freed. A request the engine fails (a beam search that could not be
preempted for want of CPU swap space, ``--swap-space``; parallel samples are then recomputed one by one) gets an
HTTP error or a streamed error event with the engine's message, never a 200. ``--kv-manager orca_max|orca_pow2|orca_oracle`` serves the same model under Orca's
contiguous reservation (§2.3, §6.1), so the paper's comparison runs on live servers.

MODEL is a local checkpoint folder (``save_pretrained``) or ``tiny:opt``, the random-weight tiny OPT of the CPU-scale
experiments (no weights needed). The server binds to 127.0.0.1 unless ``--host`` says otherwise.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from pathlib import Path
from typing import Any

import pagedattn
from pagedattn.extras import missing_extra

try:
    import prometheus_client  # noqa: F401  (checked here, imported where used: /metrics, and ``main``'s server)
    import uvicorn  # noqa: F401
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:  # ``pip install pagedattn`` alone: the engine without its server
    missing_extra("serve", "pagedattn.serve", e, main=__name__ == "__main__")

from pagedattn.async_engine import AsyncEngine, EngineOverloaded
from pagedattn.openai_protocol import (ParsedRequest, RequestError, check_text, error_body, field_of, fit_max_tokens,
                                       parse_chat, parse_completion)
from pagedattn.sequence import RequestOutput

TINY_SPEC = "tiny:opt"
KV_MANAGERS = ("paged", "orca_max", "orca_pow2", "orca_oracle")
#: seconds an idle keep-alive connection stays open: longer than the clients' own idle limits (httpx 5 s, aiohttp
#: 15 s), so that a client never sends a request on a connection the server is closing at that moment (the race
#: that uvicorn's 5 s default, equal to httpx's, loses now and then: a ReadError on a request never received)
KEEP_ALIVE_S = 20
MAX_BODY_BYTES = 16 << 20  # a 2,048-token prompt is at most ~100 KB of JSON; vLLM users rarely send 1 MB
GIB = 1 << 30

__all__ = ["build_app", "field_of", "load_engine", "serve_in_thread", "RequestError", "error_body"]


def _error(e: Exception, status: int = 400, kind: str = "invalid_request_error",
           param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(str(e), param, kind, status), status_code=status)


async def read_json(request: Request, limit: int):
    """The request's JSON body, read up to ``limit`` bytes (413 beyond, before parsing) and parsed off the event loop
    (a deeply nested or huge document is a 400, never a 500)."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise RequestError(f"the request body has {int(size):,} bytes, more than this server's limit of "
                           f"{limit:,} (--max-body-bytes)", None, 413)
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise RequestError(f"the request body is larger than this server's limit of {limit:,} bytes "
                               "(--max-body-bytes)", None, 413)
        chunks.append(chunk)
    try:
        return await asyncio.to_thread(json.loads, b"".join(chunks))
    except RecursionError:
        raise RequestError("the request body is nested too deeply", None) from None
    except ValueError as e:
        raise RequestError(f"the request body is not valid JSON: {str(e)[:200]}", None) from None


# ------------------------------------------------------------------------------------------------ responses
def token_text(tokenizer, token_id: int) -> str:
    """A token's text for ``logprobs`` (vLLM's ``token_id:N`` form for a model without a tokenizer)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id])


def _top(d: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(d.items(), key=lambda kv: -kv[1])[:k]


def _by_text(tokenizer, top: list[tuple[int, float]]) -> dict[str, float]:
    """``{token text: log-probability}``, most likely first; tokens whose texts collide (byte pieces of one
    character all decode to U+FFFD) keep the most likely one's value."""
    out: dict[str, float] = {}
    for t, v in top:
        out.setdefault(token_text(tokenizer, t), v)
    return out


def completion_logprobs(tokenizer, ids: list[int], lps: list[dict[int, float]], k: int, offset: int = 0) -> dict:
    """OpenAI's completions ``logprobs`` object for tokens ``ids``: tokens, their log-probabilities, the top ``k``
    per token and each token's character offset in the text (from ``offset``)."""
    tokens = [token_text(tokenizer, t) for t in ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [d.get(t) for t, d in zip(ids, lps)],
            "top_logprobs": [_by_text(tokenizer, _top(d, k)) for d in lps],
            "text_offset": offsets}


def chat_logprobs(tokenizer, ids: list[int], lps: list[dict[int, float]], k: int) -> dict:
    """OpenAI's chat ``logprobs`` object: one entry per token with its top ``k`` alternatives."""
    def entry(t: int, v: float | None) -> dict:
        text = token_text(tokenizer, t)
        return {"token": text, "logprob": v, "bytes": list(text.encode("utf-8", "replace"))}

    return {"content": [{**entry(t, d.get(t)), "top_logprobs": [entry(a, v) for a, v in _top(d, k)]}
                        for t, d in zip(ids, lps)]}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n"


class Choices:
    """Builds the choices of one request's responses, streamed or whole, for completions and chat alike. A request
    with several prompts has ``n`` choices per prompt, numbered ``prompt * n + index`` (OpenAI's order)."""

    def __init__(self, req: ParsedRequest, tokenizer, head: dict) -> None:
        self.req, self.tokenizer, self.head = req, tokenizer, head
        self.n = req.params.n
        # stop strings: text that may be the start of one is held back until the next piece decides
        self.hold = max((len(s) for s in req.params.stop), default=1) - 1
        self.sent: dict[int, tuple[int, int]] = {}  # choice -> (tokens sent, characters sent)
        self.ended: set[int] = set()  # choices whose finish reason was sent

    def _logprobs(self, c, start: int, text_offset: int):
        if self.req.logprobs is None or c.logprobs is None:
            return None
        ids, lps = c.token_ids[start:], c.logprobs[start:]
        tokenizer = None if self.req.token_ids_as_text else self.tokenizer  # None: tokens as "token_id:N"
        if self.req.chat:
            return chat_logprobs(tokenizer, ids, lps, self.req.logprobs)
        return completion_logprobs(tokenizer, ids, lps, self.req.logprobs, text_offset)

    def _choice(self, index: int, c, text: str, start: int, first: bool, text_offset: int,
                prompt_ids: list[int]) -> dict:
        logprobs = self._logprobs(c, start, text_offset)
        if self.req.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": c.finish_reason,
                      "stop_reason": c.stop_reason}
            if self.req.return_token_ids:
                choice["token_ids"] = c.token_ids[start:]
        else:
            choice = {"index": index, "text": text, "token_ids": c.token_ids[start:], "logprobs": logprobs,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.req.return_token_ids and first:  # vLLM's return_token_ids: the prompt's ids with the first piece
            choice["prompt_token_ids"] = prompt_ids
        return choice

    def delta(self, prompt_index: int, out: RequestOutput) -> list[dict]:
        """The new pieces of one prompt's choices since the last call: a choice's first piece (with the role, for
        chat), then its new tokens and text, every ``stream_interval`` tokens; its last piece has its finish reason.
        A choice still running keeps back any text that may be the start of a stop string."""
        interval = self.req.stream_interval
        choices = []
        for c in out.outputs:
            index = prompt_index * self.n + c.index
            if index in self.ended:
                continue
            first = index not in self.sent
            n_tok, n_chr = self.sent.get(index, (0, 0))
            text = c.text or ""
            end = len(text) if c.finish_reason else max(n_chr, len(text) - self.hold)
            if first or c.finish_reason or len(c.token_ids) - n_tok >= interval or interval == 1 and end > n_chr:
                choices.append(self._choice(index, c, text[n_chr:end], n_tok, first, n_chr, out.prompt_token_ids))
                self.sent[index] = (len(c.token_ids), end)
                if c.finish_reason:
                    self.ended.add(index)
        return choices

    def whole(self, outs: list[RequestOutput]) -> dict:
        """The response body of a request that is done."""
        choices = []
        for i, out in enumerate(outs):
            for c in out.outputs:
                ch = self._choice(i * self.n + c.index, c, c.text or "", 0, True, 0, out.prompt_token_ids)
                if self.req.chat:
                    ch["message"] = ch.pop("delta")
                choices.append(ch)
        return {**self.head, "choices": choices, "usage": usage(outs)}


def usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def engine_message(message: str) -> str:
    """An engine error as the server's user reads it: the scheduler's advice to raise ``num_cpu_blocks`` names the
    server's option for it (the scheduler's own text stays as the simulator's golden digests pin it)."""
    return message.replace("(raise num_cpu_blocks)", "(raise num_cpu_blocks: this server's --swap-space GiB)")


def failure(out: RequestOutput) -> JSONResponse:
    """The HTTP error for a request the engine failed: a 400 when it never ran (it can never be served), else a 503
    (it was refused mid-run: it could not be preempted, for want of CPU swap space)."""
    ran = any(c.token_ids for c in out.outputs)
    message = engine_message(out.error or "the engine failed this request")
    if ran:
        return JSONResponse(error_body(message, None, "server_error", 503), status_code=503)
    return JSONResponse(error_body(message, field_of(message)), status_code=400)


async def until_disconnected(request: Request) -> None:
    """Return when the client of ``request`` (its body already read) goes away."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def unless_disconnected(request: Request, work):
    """Await the coroutine ``work``; cancel it and raise ``ClientGone`` if the client disconnects first (a request
    waiting for its prompts to be added, or for its whole answer, is cancelled at once, as vLLM cancels it)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(until_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (gone, task):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if not task.done() or task.cancelled():
        raise ClientGone()
    return task.result()


class EventStream(StreamingResponse):
    """A ``StreamingResponse`` of server-sent events that runs ``on_close`` however the stream ends (finished, or
    cancelled by Starlette when the client disconnects, perhaps before its first event)."""

    def __init__(self, content, on_close) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined,union-attr]
            self.on_close()


async def stream_events(source, choices: Choices, include_usage: bool):
    """Server-sent events in OpenAI's format: one chunk per new piece of each choice, the finish reason with a
    choice's last piece, an error event (with the engine's message) if the engine fails the request, then the
    usage chunk if asked, then ``data: [DONE]``."""
    last: dict[int, RequestOutput] = {}
    try:
        async for i, out in source:
            last[i] = out
            if out.error is not None:
                ran = any(c.token_ids for c in out.outputs)
                yield _sse(error_body(engine_message(out.error), None if ran else field_of(out.error),
                                      "server_error", 503 if ran else 400))
                break
            pieces = choices.delta(i, out)
            if pieces:
                yield _sse({**choices.head, "choices": pieces})
    except RuntimeError as e:  # the engine failed
        yield _sse(error_body(str(e), None, "server_error", 500))
    if include_usage and last:
        yield _sse({**choices.head, "choices": [], "usage": usage(list(last.values()))})
    yield _sse("[DONE]")


# ------------------------------------------------------------------------------------------------ the app
def build_app(engine: AsyncEngine, model_name: str, max_body_bytes: int = MAX_BODY_BYTES,
              max_prompt_chars: int | None = None, chat_template: str | None = None):
    """The FastAPI application serving ``engine`` under ``model_name``; the engine loop runs for its lifetime.
    ``max_prompt_chars`` defaults to 32 characters per token of the context, ``max_model_len``; ``chat_template``
    (a Jinja template) replaces the tokenizer's."""
    from pagedattn.serve_metrics import ServerMetrics
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await engine.stop()

    app = FastAPI(title="pagedattn", lifespan=lifespan)
    created = int(time.time())
    llm = engine.engine
    tokenizer: Any = llm.tokenizer
    max_chars = max_prompt_chars if max_prompt_chars is not None else 32 * llm.max_model_len
    metrics = ServerMetrics(llm, model_name)
    engine.observer = metrics

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), None, code=exc.status_code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):  # a bug: OpenAI's shape; uvicorn logs the traceback
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", None, "server_error", 500),
                            status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok", "in_flight": engine.num_in_flight, "queued": engine.num_queued}

    @app.get("/version")
    async def version():
        return {"version": pagedattn.__version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "pagedattn",
                "max_model_len": llm.max_model_len, "vocab_size": llm.vocab_size}
        return {"object": "list", "data": [card]}

    async def chat_ids(messages: list[dict], req: ParsedRequest) -> list[int]:
        """The token ids of ``messages`` rendered with the request's ``chat_template``, else ``--chat-template``,
        else the tokenizer's, with the request's template options."""
        tok = tokenizer
        template = req.chat_template or chat_template
        if tok is None or not (template or getattr(tok, "chat_template", None)):
            raise RequestError(f"the model {model_name!r} has no chat template (its tokenizer defines none, and "
                               "neither --chat-template nor the request's chat_template gives one), so it cannot "
                               "serve chat; use /v1/completions", "messages")
        options = {"add_generation_prompt": req.add_generation_prompt, **req.template_kwargs,
                   **({"continue_final_message": True} if req.continue_final_message else {})}

        def render() -> list[int]:
            text = tok.apply_chat_template(messages, chat_template=template, tokenize=False, **options)
            # the template holds the special tokens: none added unless asked (vLLM's default for chat)
            return list(tok(text, add_special_tokens=req.add_special_tokens)["input_ids"])

        try:
            return await engine.run_tokenizer(render)
        except Exception as e:  # a template that refuses the conversation (jinja's raise_exception) or fails
            raise RequestError(f"the chat template refused these messages: {type(e).__name__}: {e}",
                               "chat_template" if req.chat_template else "messages") from None

    async def token_ids(req: ParsedRequest) -> list[list[int]]:
        out = []
        for p in req.prompts:
            if req.chat:
                ids = await chat_ids(p, req)
            elif isinstance(p, str):
                try:
                    ids = await engine.tokenize(p, req.add_special_tokens)
                except (ValueError, TypeError) as e:  # no tokenizer; text a tokenizer refuses
                    raise RequestError(f"the prompt could not be tokenized: {e}", "prompt") from None
            else:
                ids = p
            if req.truncate is not None:  # vLLM's truncate_prompt_tokens: keep the last (left) or first tokens
                keep = llm.max_model_len if req.truncate == -1 else req.truncate
                ids = ids[-keep:] if req.truncation_side == "left" else ids[:keep]
            out.append(ids)
        return out

    async def generate(request: Request, chat: bool):
        rids: list[str] = []
        try:
            body = await read_json(request, max_body_bytes)
            req = (parse_chat if chat else parse_completion)(body, model_name, max_chars)
            rid = f"{'chatcmpl' if chat else 'cmpl'}-{req.request_id or uuid.uuid4().hex}"
            prompt_ids = [f"{rid}-{i}" for i in range(len(req.prompts))]
            engine.reserve(prompt_ids)  # counted against --max-queued before any work: a 503 costs nothing
            rids = prompt_ids

            async def add() -> None:
                prompts = await token_ids(req)
                params = [fit_max_tokens(req, len(ids), llm.max_model_len) for ids in prompts]
                await engine.add(rids, prompts, params)
                for p in params:
                    metrics.observe_params(p.n, p.max_tokens)

            await unless_disconnected(request, add())
        except (RequestError, EngineOverloaded, ValueError, RuntimeError, ClientGone) as e:
            engine.release(rids)
            return refused(e)
        head = {"id": rid, "object": "chat.completion.chunk" if chat and req.stream else
                "chat.completion" if chat else "text_completion", "created": int(time.time()), "model": model_name}
        choices = Choices(req, llm.tokenizer, head)
        if req.stream:
            return EventStream(stream_events(engine.outputs(rids), choices, req.include_usage),
                               on_close=lambda: engine.release(rids))

        async def collect() -> list[RequestOutput]:
            final: dict[int, RequestOutput] = {}
            async for i, out in engine.outputs(rids):
                final[i] = out
            return [final[i] for i in range(len(rids))]

        try:
            final = await unless_disconnected(request, collect())
        except (RuntimeError, ClientGone) as e:
            return refused(e)
        finally:
            engine.release(rids)
        failed = next((o for o in final if o.error is not None), None)
        if failed is not None:
            return failure(failed)
        return choices.whole(final)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's ``/tokenize``: ``{"prompt": text}`` or ``{"messages": [...]}`` -> the token ids and their count."""
        try:
            body = await read_json(request, max_body_bytes)
            if isinstance(body, dict) and "messages" in body:
                keys = ("messages", "model", "add_generation_prompt", "continue_final_message", "add_special_tokens",
                        "chat_template", "chat_template_kwargs", "documents")
                req = parse_chat({k: v for k, v in body.items() if k in keys}, model_name, max_chars)
                ids = await chat_ids(req.prompts[0], req)
            else:
                if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
                    raise RequestError("send {\"prompt\": text} or {\"messages\": [...]}", "prompt")
                add = body.get("add_special_tokens", True)
                if not isinstance(add, bool):
                    raise RequestError("add_special_tokens must be true or false", "add_special_tokens")
                text = check_text(body["prompt"], "prompt", max_chars)
                try:
                    ids = await engine.tokenize(text, add)
                except ValueError as e:
                    raise RequestError(str(e), "prompt") from None
        except RequestError as e:
            return _error(e, e.status, param=e.param)
        return {"count": len(ids), "max_model_len": llm.max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        """vLLM's ``/detokenize``: ``{"tokens": [ids]}`` -> ``{"prompt": text}``."""
        try:
            body = await read_json(request, max_body_bytes)
            ids = body.get("tokens") if isinstance(body, dict) else None
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                    and 0 <= t < llm.vocab_size for t in ids):
                raise RequestError(f"tokens must be a list of token ids from 0 to {llm.vocab_size - 1}", "tokens")
            if tokenizer is None:
                raise RequestError("this model has no tokenizer: its token ids have no text", "tokens")
            text = await engine.run_tokenizer(lambda: tokenizer.decode(ids))
        except RequestError as e:
            return _error(e, e.status, param=e.param)
        return {"prompt": text}

    return app


def refused(e: Exception) -> Response:
    """The HTTP error for a request refused before its answer: a bad request (its field named), an engine over
    ``--max-queued`` (503), a prompt the engine refuses (400 naming the limit), an engine failure (500), or a client
    already gone (499, nginx's code; nobody reads it)."""
    if isinstance(e, RequestError):
        return _error(e, e.status, param=e.param)
    if isinstance(e, EngineOverloaded):
        return _error(e, 503, "overloaded_error")
    if isinstance(e, ClientGone):
        return Response(status_code=499)
    if isinstance(e, ValueError):
        return _error(e, param=field_of(str(e)))
    return _error(e, 500, "server_error")


@contextlib.contextmanager
def serve_in_thread(app, host: str = "127.0.0.1"):
    """Serve ``app`` with uvicorn on an ephemeral port of ``host`` in a background thread (tests, notebooks); yields
    the base URL and always shuts the server down (in-flight streams get 5 s to end)."""
    import socket
    import threading

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5,
                                           timeout_keep_alive=KEEP_ALIVE_S))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the server failed to start")
            time.sleep(0.01)
        yield f"http://{host}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


# ------------------------------------------------------------------------------------------------ CLI
def cpu_blocks_for(swap_space: float, config, block_size: int, max_num_seqs: int, max_model_len: int,
                   dtype_bytes: int = 4) -> int:
    """CPU swap blocks in ``swap_space`` GiB (vLLM v0's ``--swap-space``): K and V of every layer for one block of
    ``block_size`` tokens each. Capped at what ``max_num_seqs`` full-length sequences hold: no admission happens
    while a group is swapped out (§4.5), so the running and swapped sequences together are at most that many, and a
    larger pool would only take memory (the executor zero-fills its CPU cache)."""
    if not swap_space >= 0:
        raise ValueError(f"swap_space must be a number of GiB >= 0, got {swap_space!r}")
    num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    block_bytes = 2 * config.num_hidden_layers * num_kv * head_dim * block_size * dtype_bytes
    return min(int(swap_space * GIB) // block_bytes, max_num_seqs * -(-max_model_len // block_size))


def load_engine(model, kv_manager: str = "paged", num_slots: int = 8192, block_size: int = 16,
                max_model_len: int | None = None, seed: int = 0, max_step_metrics: int | None = 10_000,
                swap_space: float = 0.0, **engine_kw):
    """An ``LLMEngine`` for MODEL (a checkpoint folder, ``tiny:opt``, or a model already built) under
    ``kv_manager`` over ``num_slots`` token slots (``EngineArgs.kv_manager``, the systems the simulator replays;
    ``paged_auto``: paged with automatic prefix caching; ``ft``: ``static``), keeping the metrics of the last ``max_step_metrics`` steps (a server runs for days). ``swap_space``
    GiB of CPU blocks (``cpu_blocks_for``) let a paged engine preempt a request of several sequences by swapping
    (the scheduler swaps such groups, §4.4-§4.5; without swap space it recomputes parallel samples one by one and
    fails beam searches). The server's engine:
    ``repro.experiments.online_serving`` builds its in-process engine here too."""
    from pagedattn.engine import LLMEngine
    from pagedattn.memory.systems import engine_system
    from pagedattn.model.tiny import tiny_opt

    if not isinstance(model, (str, Path)):
        model_obj, config = model, model.config
    elif model == TINY_SPEC:
        model_obj = tiny_opt(seed)
        config = model_obj.config
    else:
        from transformers import AutoConfig

        if not (Path(model) / "config.json").is_file():  # else transformers would read it as a hub repo id
            raise FileNotFoundError(f"{model}: not a checkpoint folder (no config.json); pass a folder saved with "
                                    f"save_pretrained, or {TINY_SPEC} for the random-weight tiny OPT")
        model_obj, config = str(model), AutoConfig.from_pretrained(model)
    limit = config.max_position_embeddings
    max_model_len = min(max_model_len or limit, limit)
    if swap_space and kv_manager.startswith("paged") and "num_cpu_blocks" not in engine_kw:
        import torch

        dtype = engine_kw.get("dtype") or torch.float32  # the CPU engine's default; a smaller one: more blocks
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, torch.float32)
        engine_kw["num_cpu_blocks"] = cpu_blocks_for(swap_space, config, block_size,
                                                     engine_kw.get("max_num_seqs", 256), max_model_len,
                                                     torch.empty((), dtype=dtype).element_size())
    name, caching = engine_system(kv_manager)
    return LLMEngine(model_obj, engine_kw.pop("tokenizer", None), name, num_slots=num_slots, block_size=block_size,
                     max_model_len=max_model_len, num_cpu_blocks=engine_kw.pop("num_cpu_blocks", 0),
                     enable_prefix_caching=caching, max_step_metrics=max_step_metrics, **engine_kw)


def chat_template_arg(value: str | None) -> str | None:
    """``--chat-template``: a file's text when ``value`` names a file, else ``value`` itself (vLLM's rule)."""
    if value is None:
        return None
    path = Path(value)
    return path.read_text() if len(value) < 4096 and path.is_file() else value


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pagedattn.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", help=f"a local checkpoint folder (save_pretrained), or {TINY_SPEC}")
    p.add_argument("--tiny-opt", action="store_true", help=f"serve the random-weight tiny OPT (same as {TINY_SPEC})")
    p.add_argument("--served-model-name", help="the name clients send as 'model' (default: MODEL)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--kv-manager", choices=KV_MANAGERS, default="paged")
    p.add_argument("--num-slots", type=int, default=8192, help="KV token slots, the same budget for every manager")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template, or a file holding one, replacing the tokenizer's (vLLM's flag)")
    p.add_argument("--max-queued", type=int, default=1000,
                   help="requests waiting for their first token beyond which new ones get a 503")
    p.add_argument("--max-step-metrics", type=int, default=10_000, help="engine steps whose metrics are kept")
    p.add_argument("--swap-space", type=float, default=4.0,
                   help="GiB of CPU swap space for preempted requests of several sequences (n > 1), as vLLM v0's")
    p.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES,
                   help="larger request bodies get a 413 before they are read")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longer prompts get a 400 before they are tokenized (default: 32 per token of the context)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs for decode steps (vLLM's flag; a GPU only: a CPU never takes them)")
    p.add_argument("--seed", type=int, default=0, help="the tiny model's weight seed")
    p.add_argument("--log-level", default="info")
    p.add_argument("--timeout-keep-alive", type=float, default=KEEP_ALIVE_S,
                   help="seconds an idle keep-alive connection stays open (longer than the clients' idle limits)")
    a = p.parse_args(argv)
    if a.tiny_opt:
        a.model = TINY_SPEC
    if not a.model:
        p.error("give MODEL (a checkpoint folder) or --tiny-opt")
    return a


def main(argv=None) -> None:
    import uvicorn

    a = parse_args(argv)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    engine = load_engine(a.model, a.kv_manager, a.num_slots, a.block_size, a.max_model_len, a.seed,
                         max_num_seqs=a.max_num_seqs, max_step_metrics=a.max_step_metrics, swap_space=a.swap_space,
                         enforce_eager=a.enforce_eager)
    app = build_app(AsyncEngine(engine, a.max_queued), a.served_model_name or a.model, a.max_body_bytes,
                    a.max_prompt_chars, chat_template_arg(a.chat_template))
    print(f"pagedattn: serving {a.model} ({a.kv_manager}, {a.num_slots} slots, {engine.kv.cache_layout()[2]} CPU "
          f"swap blocks, max_model_len {engine.max_model_len}) on http://{a.host}:{a.port}/v1", flush=True)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, timeout_keep_alive=a.timeout_keep_alive)


if __name__ == "__main__":
    main()
