"""An OpenAI-compatible HTTP server for our engine: ``python -m pagedattn.serve MODEL`` (``make serve``).

The online setting of the paper's evaluation (§6.1): requests arrive over HTTP at any time and are batched at the
iteration level (§4.5) by ``AsyncEngine``. Endpoints: ``POST /v1/completions`` (a text or token-id prompt;
``max_tokens``, ``temperature``, ``top_p``, ``n``, ``best_of``, ``seed``, ``stream`` as server-sent events, and the
extras ``top_k``, ``ignore_eos``, ``stop_token_ids`` that vLLM's server accepts too), ``GET /v1/models`` and
``GET /health``. Each choice carries its ``token_ids`` beside ``text`` (a model without a tokenizer has empty text).

Bad input gets a 400 in OpenAI's shape, ``{"error": {"message", "type": "invalid_request_error", "param"}}``, naming
the field; more than ``--max-queued`` requests waiting for their first token get a 503. A client that disconnects has
its request aborted and its KV blocks freed. ``--kv-manager orca_max|orca_pow2|orca_oracle`` serves the same model
under Orca's contiguous reservation (§2.3, §6.1), so the paper's comparison runs on live servers.

MODEL is a local checkpoint folder (``save_pretrained``) or ``tiny:opt``, the random-weight tiny OPT of the CPU-scale
experiments (no weights needed). The server binds to 127.0.0.1 unless ``--host`` says otherwise.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedattn.async_engine import AsyncEngine, EngineOverloaded
from pagedattn.sequence import SamplingParams

TINY_SPEC = "tiny:opt"
KV_MANAGERS = ("paged", "orca_max", "orca_pow2", "orca_oracle")
#: request fields passed to ``SamplingParams`` (OpenAI's, then vLLM's extras), with OpenAI's defaults
SAMPLING_FIELDS = {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "n": 1, "best_of": None, "seed": None,
                   "top_k": -1, "ignore_eos": False, "stop_token_ids": None}
#: accepted only at their "off" value: the server does not implement them
UNSUPPORTED = {"stop": (None, [], ""), "logprobs": (None, 0), "echo": (False, None), "suffix": (None, ""),
               "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {})}


class RequestError(ValueError):
    """A bad request: its message and the field it names (OpenAI's ``param``)."""

    def __init__(self, message: str, param: str | None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def field_of(message: str) -> str:
    """The request field an engine or ``SamplingParams`` ``ValueError`` is about (their messages name it first)."""
    first = message.split(" ", 1)[0].split("=", 1)[0]
    if first in SAMPLING_FIELDS:
        return first
    if message.startswith("stop token"):
        return "stop_token_ids"
    if message.startswith(("request of", "request reserves")):  # Orca reserves prompt + max_tokens (§2.3)
        return "max_tokens"
    return "prompt"


def parse_prompt(prompt):
    """One prompt: a string or a list of token ids (a list holding one of those is unwrapped)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError("one prompt per request: send the prompts as separate requests", "prompt")
    raise RequestError("prompt must be a string or a list of integer token ids", "prompt")


def parse_completion(body, model_name: str) -> tuple[object, SamplingParams, bool, bool]:
    """A ``/v1/completions`` body -> (prompt, sampling params, stream, include_usage); ``RequestError`` naming the
    field when it is bad. Unknown fields are ignored, as OpenAI's API ignores them."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None)
    if body.get("model") not in (None, model_name):
        raise RequestError(f"the model {body['model']!r} does not exist; this server serves {model_name!r}",
                           "model", 404)
    if "prompt" not in body:
        raise RequestError("prompt is required", "prompt")
    prompt = parse_prompt(body["prompt"])
    for name, off in UNSUPPORTED.items():
        if body.get(name) not in off:
            raise RequestError(f"{name} is not supported by this server" +
                               ("; use stop_token_ids" if name == "stop" else ""), name)
    kw = {k: body[k] if body.get(k) is not None else default for k, default in SAMPLING_FIELDS.items()}
    kw["stop_token_ids"] = kw["stop_token_ids"] or []
    try:
        params = SamplingParams(**kw)
    except ValueError as e:
        raise RequestError(str(e), field_of(str(e))) from None
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"stream must be true or false, got {stream!r}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise RequestError("stream_options must be an object like {\"include_usage\": true}", "stream_options")
    if stream and params.best_of is not None and params.best_of > params.n:
        raise RequestError("best_of > n cannot be streamed: the best n are known only at the end", "best_of")
    return prompt, params, stream, options.get("include_usage", False)


# ------------------------------------------------------------------------------------------------ responses
def _choice(c, text: str, token_ids: list[int], finish_reason) -> dict:
    return {"index": c.index, "text": text, "token_ids": token_ids, "logprobs": None, "finish_reason": finish_reason}


def _usage(output) -> dict:
    prompt, completion = len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj) if not isinstance(obj, str) else obj}\n\n"


async def stream_events(outputs, head: dict, include_usage: bool):
    """Server-sent events in OpenAI's format: one chunk per new piece of each choice (its new text and token ids),
    the finish reason with a choice's last piece, then the usage chunk if asked, then ``data: [DONE]``."""
    sent: dict[int, tuple[int, int]] = {}  # choice index -> (tokens sent, characters sent)
    ended: set[int] = set()  # choices whose finish reason was sent
    last = None
    try:
        async for out in outputs:
            last = out
            if out.error is not None:
                yield _sse(error_body(out.error, field_of(out.error)))
                break
            choices = []
            for c in out.outputs:
                n_tok, n_chr = sent.get(c.index, (0, 0))
                text = c.text or ""
                if len(c.token_ids) > n_tok or (c.finish_reason and c.index not in ended):
                    choices.append(_choice(c, text[n_chr:], c.token_ids[n_tok:], c.finish_reason))
                    sent[c.index] = (len(c.token_ids), len(text))
                    if c.finish_reason:
                        ended.add(c.index)
            if choices:
                yield _sse({**head, "choices": choices})
    except RuntimeError as e:  # the engine failed
        yield _sse(error_body(str(e), None, "server_error"))
    if include_usage and last is not None:
        yield _sse({**head, "choices": [], "usage": _usage(last)})
    yield _sse("[DONE]")


def completion_body(out, head: dict) -> dict:
    choices = [_choice(c, c.text or "", c.token_ids, c.finish_reason) for c in out.outputs]
    return {**head, "choices": choices, "usage": _usage(out)}


# ------------------------------------------------------------------------------------------------ the app
def build_app(engine: AsyncEngine, model_name: str):
    """The FastAPI application serving ``engine`` under ``model_name``; the engine loop runs for its lifetime."""
    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await engine.stop()

    app = FastAPI(title="pagedattn", lifespan=lifespan)
    created = int(time.time())

    @app.get("/health")
    async def health():
        return {"status": "ok", "in_flight": engine.num_in_flight, "queued": engine.num_queued}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "pagedattn",
                "max_model_len": engine.engine.max_model_len, "vocab_size": engine.engine.vocab_size}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            try:
                body = json.loads(await request.body())
            except ValueError as e:
                raise RequestError(f"the request body is not valid JSON: {e}", None) from None
            prompt, params, stream, include_usage = parse_completion(body, model_name)
            rid = f"cmpl-{uuid.uuid4().hex}"
            outputs = engine.generate(rid, prompt, params)
            first = await anext(outputs)  # admission errors surface here, before any byte is sent
        except RequestError as e:
            return JSONResponse(error_body(str(e), e.param), status_code=e.status)
        except EngineOverloaded as e:
            return JSONResponse(error_body(str(e), None, "overloaded_error"), status_code=503)
        except ValueError as e:  # refused by the engine: the message names the limit
            return JSONResponse(error_body(str(e), field_of(str(e))), status_code=400)
        except RuntimeError as e:
            return JSONResponse(error_body(str(e), None, "server_error"), status_code=500)
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model_name}

        async def chained():
            try:
                yield first
                async for o in outputs:
                    yield o
            finally:
                await outputs.aclose()  # aborts the request if the client left early

        if stream:
            return StreamingResponse(stream_events(chained(), head, include_usage), media_type="text/event-stream")
        out = first
        try:
            async for out in outputs:
                if await request.is_disconnected():
                    break
        except RuntimeError as e:
            return JSONResponse(error_body(str(e), None, "server_error"), status_code=500)
        finally:
            await outputs.aclose()
        if out.error is not None and not any(c.token_ids for c in out.outputs):
            return JSONResponse(error_body(out.error, field_of(out.error)), status_code=400)
        return completion_body(out, head)

    return app


@contextlib.contextmanager
def serve_in_thread(app, host: str = "127.0.0.1"):
    """Serve ``app`` with uvicorn on an ephemeral port of ``host`` in a background thread (tests, notebooks); yields
    the base URL and always shuts the server down (in-flight streams get 5 s to end)."""
    import socket
    import threading

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
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
def load_engine(model, kv_manager: str = "paged", num_slots: int = 8192, block_size: int = 16,
                max_model_len: int | None = None, seed: int = 0, max_step_metrics: int | None = 10_000, **engine_kw):
    """An ``LLMEngine`` for MODEL (a checkpoint folder, ``tiny:opt``, or a model already built) under
    ``kv_manager`` over ``num_slots`` token slots (``experiments.common.make_engine``, the same systems the simulator
    replays), keeping the metrics of the last ``max_step_metrics`` steps (a server runs for days). The server's
    engine: ``repro.experiments.online_serving`` builds its in-process engine here too."""
    from pagedattn.repro.experiments.common import make_engine, tiny_opt

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
    return make_engine(model_obj, kv_manager, num_slots, block_size, max_model_len,
                       max_step_metrics=max_step_metrics, **engine_kw)


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
    p.add_argument("--max-queued", type=int, default=1000,
                   help="requests waiting for their first token beyond which new ones get a 503")
    p.add_argument("--max-step-metrics", type=int, default=10_000, help="engine steps whose metrics are kept")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0, help="the tiny model's weight seed")
    p.add_argument("--log-level", default="info")
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
                         max_num_seqs=a.max_num_seqs, max_step_metrics=a.max_step_metrics)
    app = build_app(AsyncEngine(engine, a.max_queued), a.served_model_name or a.model)
    print(f"pagedattn: serving {a.model} ({a.kv_manager}, {a.num_slots} slots, max_model_len "
          f"{engine.max_model_len}) on http://{a.host}:{a.port}/v1", flush=True)
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level)


if __name__ == "__main__":
    main()
