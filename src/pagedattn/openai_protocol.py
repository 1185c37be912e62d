"""OpenAI's request bodies, checked: ``/v1/completions`` and ``/v1/chat/completions`` bodies become the engine's
``SamplingParams`` and prompts, or a ``RequestError`` naming the field (OpenAI's ``param``).

The rules (the server's field table is in ``docs/SERVING.md``): every field the server implements is checked for
its type and range; a field of OpenAI's or vLLM's API that it does not implement is refused with a 400 naming it
unless it has its "off" value (never ignored); fields neither API knows are ignored, as vLLM ignores them. Text is
checked before any tokenizing: it must be valid Unicode (a lone surrogate such as ``"\\ud800"`` cannot be UTF-8 and
would crash a Rust tokenizer) and at most ``max_prompt_chars`` characters long. ``max_tokens`` beyond the context
left after the prompt is refused once the prompt's length is known (``fit_max_tokens``), as vLLM does.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pagedattn.sequence import SamplingParams

#: fields passed to ``SamplingParams`` under the same name, with the default when absent or null
SAMPLING_FIELDS = {"temperature": 1.0, "top_p": 1.0, "n": 1, "best_of": None, "seed": None, "top_k": -1,
                   "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                   "min_tokens": 0, "ignore_eos": False, "stop_token_ids": None, "stop": None,
                   "include_stop_str_in_output": False, "use_beam_search": False, "length_penalty": 1.0,
                   "early_stopping": False}
#: fields of OpenAI's or vLLM's API this server does not implement: accepted only at one of their "off" values
UNSUPPORTED = {"echo": (False, None), "suffix": (None, ""), "logit_bias": (None, {}), "prompt_logprobs": (None,),
               "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
               "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
               "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
               "structured_outputs": (None,), "lora_request": (None,), "audio": (None,), "modalities": (None, ["text"]),
               "prediction": (None,), "chat_template": (None,), "chat_template_kwargs": (None, {}),
               "continue_final_message": (None, False), "skip_special_tokens": (None, True),
               "spaces_between_special_tokens": (None, True), "truncate_prompt_tokens": (None,),
               "allowed_token_ids": (None,), "bad_words": (None, []), "logits_processors": (None, []),
               "parallel_tool_calls": (None,), "reasoning_effort": (None,), "web_search_options": (None,)}
#: the most top log-probabilities per token a request may ask for (OpenAI allows 5 for completions, 20 for chat)
MAX_LOGPROBS = 20
ROLES = ("system", "user", "assistant", "developer", "tool")


class RequestError(ValueError):
    """A bad request: its message, the field it names (OpenAI's ``param``) and the HTTP status."""

    def __init__(self, message: str, param: str | None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error", code: int = 400) -> dict:
    """OpenAI's error object; its ``code`` is the HTTP status, as vLLM's ``ErrorResponse`` gives it (text that
    cannot be UTF-8, a lone surrogate, is escaped: the body must encode)."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def field_of(message: str) -> str:
    """The request field an engine or ``SamplingParams`` ``ValueError`` is about (their messages name it first)."""
    if message.startswith("stop token"):
        return "stop_token_ids"
    first = message.split(" ", 1)[0].split("=", 1)[0]
    if first in SAMPLING_FIELDS or first in ("max_tokens", "logprobs", "beam_width"):
        return "use_beam_search" if first == "beam_width" else first
    if message.startswith("beam search"):
        return "use_beam_search"
    if message.startswith(("request of", "request reserves")):  # Orca reserves prompt + max_tokens (§2.3)
        return "max_tokens"
    return "prompt"


def check_text(text: str, param: str, max_chars: int | None = None) -> str:
    """``text`` if it is valid Unicode and at most ``max_chars`` characters long, else a ``RequestError``."""
    if max_chars is not None and len(text) > max_chars:
        raise RequestError(f"{param} has {len(text):,} characters, more than this server's limit of {max_chars:,} "
                           "(--max-prompt-chars)", param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{param} is not valid Unicode: {e.reason} at character {e.start}", param) from None
    return text


@dataclass
class ParsedRequest:
    """A checked request: its prompts (text or token ids; chat: one list of messages), the sampling parameters (their
    ``max_tokens`` is final only after ``fit_max_tokens``), and the output options."""

    prompts: list
    params: SamplingParams
    max_tokens: int | None  # as asked (None: as many as the context leaves)
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # top log-probabilities per token to return (None: none)
    chat: bool = False
    add_generation_prompt: bool = True
    extra: dict = field(default_factory=dict)


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None)
    return body


def _check_model(body: dict, model_name: str) -> None:
    if body.get("model") not in (None, model_name):
        raise RequestError(f"the model {str(body['model'])[:200]!r} does not exist; this server serves "
                           f"{model_name!r}", "model", 404)


def _check_unsupported(body: dict) -> None:
    for name, off in UNSUPPORTED.items():
        if name in body and not any(body[name] == o and type(body[name]) is type(o) for o in off):
            raise RequestError(f"{name} is not supported by this server", name)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{name} must be true or false, got {str(v)[:100]!r}", name)
    return v


def _max_tokens(body: dict, name: str, default: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise RequestError(f"{name} must be an integer >= 1, got {str(v)[:100]!r}", name)
    return v


def _sampling(body: dict, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    kw: dict[str, Any] = {k: body[k] if body.get(k) is not None else default for k, default in SAMPLING_FIELDS.items()}
    kw["stop_token_ids"] = kw["stop_token_ids"] if kw["stop_token_ids"] is not None else []
    kw["stop"] = kw["stop"] if kw["stop"] is not None else []
    if isinstance(kw["stop"], list) and len(kw["stop"]) > 16:
        raise RequestError("stop takes at most 16 strings", "stop")
    for s in kw["stop"] if isinstance(kw["stop"], list) else [kw["stop"]]:
        if isinstance(s, str):
            check_text(s, "stop", 1000)
    if kw["use_beam_search"] is True and body.get("temperature") is None:
        kw["temperature"] = 0.0  # beam search is deterministic: OpenAI's default temperature 1 would refuse it
    # a placeholder until the prompt's length is known (fit_max_tokens), so that every other field is checked now
    kw["max_tokens"] = max_tokens or max(1, kw["min_tokens"] if isinstance(kw["min_tokens"], int) else 1)
    try:
        return SamplingParams(**kw, logprobs=logprobs)
    except ValueError as e:
        raise RequestError(str(e), field_of(str(e))) from None


def _stream_options(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool) \
            or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise RequestError("stream_options must be an object like {\"include_usage\": true}", "stream_options")
    if options.get("continuous_usage_stats") not in (None, False):
        raise RequestError("stream_options.continuous_usage_stats is not supported by this server", "stream_options")
    return stream, options.get("include_usage", False)


def _check_stream(stream: bool, params: SamplingParams) -> None:
    if stream and params.use_beam_search:
        raise RequestError("beam search cannot be streamed: its beams are rewritten until the end", "use_beam_search")
    if stream and params.best_of is not None and params.best_of > params.n:
        raise RequestError("best_of > n cannot be streamed: the best n are known only at the end", "best_of")


def _prompt_list(prompt, max_chars: int | None) -> list:
    """A completion's ``prompt``: a string, a list of token ids, or a list of either (several prompts)."""
    def one(p):
        if isinstance(p, str):
            return check_text(p, "prompt", max_chars)
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        return None

    single = one(prompt)
    if single is not None:
        return [single]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        many = [one(p) for p in prompt]
        if all(p is not None for p in many):  # each within max_chars; the body limit bounds them together
            return many
    if isinstance(prompt, list) and not prompt or prompt == [[]]:
        raise RequestError("empty prompt: a request needs at least 1 prompt token", "prompt")
    raise RequestError("prompt must be a string, a list of integer token ids, or a list of those", "prompt")


def parse_completion(body, model_name: str, max_prompt_chars: int | None = None) -> ParsedRequest:
    """A ``/v1/completions`` body, checked."""
    body = _object(body)
    _check_model(body, model_name)
    if "prompt" not in body:
        raise RequestError("prompt is required", "prompt")
    prompts = _prompt_list(body["prompt"], max_prompt_chars)
    _check_unsupported(body)
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_LOGPROBS):
        raise RequestError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {str(logprobs)[:100]!r}",
                           "logprobs")
    max_tokens = _max_tokens(body, "max_tokens", 16)
    params = _sampling(body, max_tokens, logprobs)
    stream, include_usage = _stream_options(body)
    _check_stream(stream, params)
    return ParsedRequest(prompts, params, max_tokens, stream, include_usage, logprobs)


def _content(message: dict, i: int, max_chars: int | None) -> str:
    content = message.get("content")
    param = f"messages[{i}].content"
    if content is None:
        return ""
    if isinstance(content, str):
        return check_text(content, param, max_chars)
    if isinstance(content, list):  # OpenAI's content parts: text only
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"{param}: only text parts ({{\"type\": \"text\", \"text\": ...}}) are supported",
                                   param)
            parts.append(check_text(part["text"], param, max_chars))
        return "\n".join(parts)
    raise RequestError(f"{param} must be a string or a list of text parts", param)


def parse_chat(body, model_name: str, max_prompt_chars: int | None = None) -> ParsedRequest:
    """A ``/v1/chat/completions`` body, checked; its one prompt is the list of messages as ``{"role", "content"}``."""
    body = _object(body)
    _check_model(body, model_name)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    checked, total = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}] must be an object with a role among {', '.join(ROLES)}",
                               f"messages[{i}].role")
        text = _content(m, i, max_prompt_chars)
        total += len(text)
        checked.append({"role": m["role"], "content": text})
    if max_prompt_chars is not None and total > max_prompt_chars:
        raise RequestError(f"the messages have {total:,} characters, more than this server's limit of "
                           f"{max_prompt_chars:,} (--max-prompt-chars)", "messages")
    _check_unsupported(body)
    if "prompt" in body:
        raise RequestError("prompt is a completions field; a chat request sends messages", "prompt")
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_LOGPROBS):
        raise RequestError(f"top_logprobs must be an integer from 0 to {MAX_LOGPROBS}", "top_logprobs")
    if top is not None and not body.get("logprobs"):
        raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (top or 0) if _bool(body, "logprobs") else None
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise RequestError("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _max_tokens(body, name, None)
    params = _sampling(body, max_tokens, logprobs)
    stream, include_usage = _stream_options(body)
    _check_stream(stream, params)
    return ParsedRequest([checked], params, max_tokens, stream, include_usage, logprobs, chat=True,
                         add_generation_prompt=_bool(body, "add_generation_prompt", True))


def fit_max_tokens(req: ParsedRequest, prompt_len: int, max_model_len: int) -> SamplingParams:
    """The request's sampling parameters for a prompt of ``prompt_len`` tokens: ``max_tokens`` as asked, or all the
    context left when not given (chat); more than the context leaves is a 400 naming ``max_tokens`` (vLLM's rule)."""
    left = max_model_len - prompt_len
    param = "max_tokens"
    if left < 1:
        raise RequestError(f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                           f"{prompt_len}, which leaves no room for a completion", "prompt")
    if req.max_tokens is not None and req.max_tokens > left:
        raise RequestError(f"this model's maximum context length is {max_model_len} tokens; you asked for "
                           f"{prompt_len + req.max_tokens} ({prompt_len} in the prompt, {req.max_tokens} in the "
                           f"completion): max_tokens may be at most {left}", param)
    try:
        return dataclasses.replace(req.params, max_tokens=req.max_tokens or left)
    except ValueError as e:
        raise RequestError(str(e), field_of(str(e))) from None
