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
import json
from dataclasses import dataclass, field
from typing import Any

from pagedattn.sequence import SamplingParams

#: fields passed to ``SamplingParams`` under the same name, with the default when absent or null
SAMPLING_FIELDS = {"temperature": 1.0, "top_p": 1.0, "n": 1, "best_of": None, "seed": None, "top_k": -1,
                   "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                   "min_tokens": 0, "ignore_eos": False, "stop_token_ids": None, "stop": None,
                   "include_stop_str_in_output": False, "use_beam_search": False, "length_penalty": 1.0,
                   "early_stopping": False}
#: the request fields of vLLM 0.32 (the release ``make vllm-venv`` installs), in its order: ``CompletionRequest`` of
#: ``vllm/entrypoints/openai/completion/protocol.py`` and ``ChatCompletionRequest`` of
#: ``vllm/entrypoints/openai/chat_completion/protocol.py``. Each is ``SUPPORTED``, ``NO_EFFECT`` or ``UNSUPPORTED``
#: (refused with a 400 naming it unless at an "off" value); ``docs/SERVING.md``'s field table is ``field_table()``.
VLLM_COMPLETION_FIELDS = (
    "model", "prompt", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty",
    "seed", "stop", "stream", "stream_options", "suffix", "temperature", "top_p", "user", "use_beam_search", "top_k",
    "min_p", "repetition_penalty", "watermarking", "length_penalty", "stop_token_ids", "include_stop_str_in_output",
    "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "truncation_side", "allowed_token_ids", "prompt_logprobs", "logprob_token_ids", "bad_words", "prompt_embeds",
    "add_special_tokens", "response_format", "structured_outputs", "priority", "request_id", "session_id",
    "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start", "return_token_offsets",
    "mm_payload", "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params", "vllm_xargs",
    "repetition_detection", "thinking_token_budget", "stream_interval")
VLLM_CHAT_FIELDS = (
    "messages", "model", "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "max_tokens",
    "max_completion_tokens", "n", "presence_penalty", "response_format", "seed", "stop", "stream", "stream_options",
    "temperature", "top_p", "tools", "tool_choice", "reasoning_effort", "thinking_token_budget", "include_reasoning",
    "parallel_tool_calls", "user", "use_beam_search", "top_k", "min_p", "repetition_penalty", "watermarking",
    "length_penalty", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens",
    "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "truncation_side",
    "prompt_logprobs", "logprob_token_ids", "allowed_token_ids", "bad_words", "echo", "add_generation_prompt",
    "continue_final_message", "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
    "media_io_kwargs", "mm_processor_kwargs", "structured_outputs", "priority", "request_id", "session_id",
    "return_tokens_as_token_ids", "return_token_ids", "routed_experts_prompt_start", "return_token_offsets",
    "return_prompt_text", "mm_payload", "return_mm_kwargs", "cache_salt", "kv_transfer_params", "ec_transfer_params",
    "vllm_xargs", "repetition_detection", "stream_interval")
#: fields this server implements, with what they do (the table's notes)
SUPPORTED = {
    "model": "Must be the served name (`--served-model-name`, default MODEL), else 404 naming `model`.",
    "prompt": "A string, a list of token ids, or a list of those (several prompts: `n` choices each, numbered "
              "`prompt * n + index`). Empty: 400.",
    "messages": "Roles `system`, `user`, `assistant`, `developer`, `tool`; `content` a string or text parts; `name`, "
                "`tool_calls` and `tool_call_id` reach the template; image/audio parts: 400.",
    "max_tokens": "Default 16 (completions) or the context left after the prompt (chat). Beyond the context left: "
                  "400 (as vLLM).",
    "max_completion_tokens": "OpenAI's newer name of `max_tokens`; both at once: 400.",
    "temperature": "Below 0.01 (but above 0) raised to 0.01 with a warning, as vLLM does.",
    "top_p": "In (0, 1].", "n": "Up to `--max-num-seqs`.", "seed": "Below 2**64.",
    "stream": "Server-sent events.",
    "stream_options": "`include_usage`; without `stream: true`: 400 (as vLLM); `continuous_usage_stats: true`: 400.",
    "stop": "A string or up to 16; `finish_reason: \"stop\"`, `stop_reason` = the string.",
    "logprobs": "Completions: 0 to 20 top tokens; chat: true/false with `top_logprobs`.",
    "top_logprobs": "0 to 20, only with `logprobs: true`.",
    "frequency_penalty": "-2 to 2.", "presence_penalty": "-2 to 2.",
    "repetition_penalty": "> 0 (Hugging Face's definition).", "top_k": "`-1` or `0` = off.", "min_p": "In [0, 1].",
    "min_tokens": "At most `max_tokens`.", "ignore_eos": "", "stop_token_ids": "",
    "include_stop_str_in_output": "", "use_beam_search": "The engine's beam search (§4.4); not streamable.",
    "length_penalty": "Beam search's.",
    "truncate_prompt_tokens": "Keep this many prompt tokens (`-1`: `max_model_len`), cut on `truncation_side`.",
    "truncation_side": "`left` (default: keep the last tokens) or `right`.",
    "add_special_tokens": "Completions: default true (the tokenizer's BOS); chat: default false (the template "
                          "holds them).",
    "request_id": "The response's id (`cmpl-` / `chatcmpl-` + it); one in flight already: 400.",
    "return_tokens_as_token_ids": "Log-probability tokens as `token_id:N`.",
    "return_token_ids": "Each choice gets `prompt_token_ids` (and, for chat, `token_ids`; completion choices always "
                        "have them).",
    "stream_interval": "Stream a choice every this many tokens (its first and last piece at once).",
    "add_generation_prompt": "Default true.",
    "continue_final_message": "The template continues the last message (not with `add_generation_prompt`).",
    "documents": "Passed to the chat template.",
    "chat_template": "A Jinja template for this request (else `--chat-template`, else the tokenizer's).",
    "chat_template_kwargs": "Extra variables for the chat template.",
}
#: fields accepted and documented as having no effect here, with the reason
NO_EFFECT = {"user": "Metadata, no effect on the output (as in vLLM).",
             "session_id": "Routes a session to one engine; this server has one."}
#: fields of OpenAI's or vLLM's API this server does not implement: accepted only at one of their "off" values
UNSUPPORTED = {"echo": (False, None), "suffix": (None, ""), "logit_bias": (None, {}), "prompt_logprobs": (None,),
               "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
               "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
               "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
               "structured_outputs": (None,), "lora_request": (None,), "audio": (None,), "modalities": (None, ["text"]),
               "prediction": (None,), "skip_special_tokens": (None, True),
               "spaces_between_special_tokens": (None, True), "allowed_token_ids": (None,), "bad_words": (None, []),
               "logits_processors": (None, []), "parallel_tool_calls": (None, True), "reasoning_effort": (None,),
               "web_search_options": (None,), "watermarking": (None,), "logprob_token_ids": (None,),
               "prompt_embeds": (None,), "priority": (None, 0), "routed_experts_prompt_start": (None, 0),
               "return_token_offsets": (None, False), "mm_payload": (None, "tensors"),
               "return_mm_kwargs": (None, False), "cache_salt": (None,), "kv_transfer_params": (None,),
               "ec_transfer_params": (None,), "vllm_xargs": (None,), "repetition_detection": (None,),
               "thinking_token_budget": (None,), "include_reasoning": (None, True), "media_io_kwargs": (None,),
               "mm_processor_kwargs": (None,), "return_prompt_text": (None, False)}
#: why each unsupported field of vLLM 0.32 is refused (the table's notes)
WHY_UNSUPPORTED = {
    "priority": "Any value but 0: the scheduler is the paper's FCFS (§4.5), as vLLM refuses it without "
                "`--scheduling-policy priority`.",
    "cache_salt": "The prefix cache is not salted.",
    "skip_special_tokens": "Only true.", "spaces_between_special_tokens": "Only true.",
}


def field_table() -> str:
    """``docs/SERVING.md``'s table of vLLM 0.32's request fields (``python -m pagedattn.openai_protocol`` prints it):
    for each, which endpoint has it and what this server does with it."""
    rows = ["| Field | Completions | Chat | Here | Notes |", "| --- | --- | --- | --- | --- |"]
    for name in dict.fromkeys(VLLM_COMPLETION_FIELDS + VLLM_CHAT_FIELDS):
        if name in SUPPORTED:
            status, note = "supported", SUPPORTED[name]
        elif name in NO_EFFECT:
            status, note = "accepted, no effect", NO_EFFECT[name]
        else:
            off = ", ".join("null" if v is None else json.dumps(v) for v in UNSUPPORTED[name])
            status, note = "refused (400)", WHY_UNSUPPORTED.get(name, f"Unless {off}.")
        rows.append(f"| `{name}` | {'yes' if name in VLLM_COMPLETION_FIELDS else ''} | "
                    f"{'yes' if name in VLLM_CHAT_FIELDS else ''} | {status} | {note} |")
    return "\n".join(rows)


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
    if message.startswith("request id"):
        return "request_id"
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
    # vLLM's extras (``_options``)
    add_special_tokens: bool = True
    truncate: int | None = None  # truncate_prompt_tokens (-1: max_model_len)
    truncation_side: str = "left"
    request_id: str | None = None
    token_ids_as_text: bool = False  # return_tokens_as_token_ids
    return_token_ids: bool = False
    stream_interval: int = 1
    continue_final_message: bool = False
    chat_template: str | None = None
    template_kwargs: dict = field(default_factory=dict)  # chat_template_kwargs and documents


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
    if body.get("stream_options") is not None and not stream:
        raise RequestError("stream_options can only be given with stream: true", "stream_options")  # vLLM's rule
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


def _int_or_none(body: dict, name: str, low: int) -> int | None:
    v = body.get(name)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
        raise RequestError(f"{name} must be an integer >= {low}, got {str(v)[:100]!r}", name)
    return v


def _options(body: dict, chat: bool) -> dict:
    """vLLM's extras that are not sampling parameters, checked, as ``ParsedRequest`` fields."""
    out: dict[str, Any] = {"add_special_tokens": _bool(body, "add_special_tokens", not chat),
                           "token_ids_as_text": _bool(body, "return_tokens_as_token_ids"),
                           "return_token_ids": _bool(body, "return_token_ids"),
                           "stream_interval": _int_or_none(body, "stream_interval", 1) or 1}
    truncate = body.get("truncate_prompt_tokens")
    if truncate is not None and (isinstance(truncate, bool) or not isinstance(truncate, int)
                                 or truncate < 1 and truncate != -1):
        raise RequestError("truncate_prompt_tokens must be an integer >= 1, or -1 (max_model_len)",
                           "truncate_prompt_tokens")
    out["truncate"] = truncate
    side = body.get("truncation_side")
    if side not in (None, "left", "right"):
        raise RequestError("truncation_side must be \"left\" or \"right\"", "truncation_side")
    out["truncation_side"] = side or "left"
    rid = body.get("request_id")
    if rid is not None and (not isinstance(rid, str) or not rid or len(rid) > 200):
        raise RequestError("request_id must be a string of 1 to 200 characters", "request_id")
    out["request_id"] = rid if rid is None else check_text(rid, "request_id")
    if not chat:
        return out
    out["continue_final_message"] = _bool(body, "continue_final_message")
    if out["continue_final_message"] and _bool(body, "add_generation_prompt", True):
        raise RequestError("continue_final_message needs add_generation_prompt: false", "continue_final_message")
    template = body.get("chat_template")
    if template is not None and not isinstance(template, str):
        raise RequestError("chat_template must be a string (a Jinja template)", "chat_template")
    out["chat_template"] = template if template is None else check_text(template, "chat_template", 100_000)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise RequestError("chat_template_kwargs must be an object", "chat_template_kwargs")
    taken = set(kwargs) & {"messages", "conversation", "add_generation_prompt", "continue_final_message",
                           "tokenize", "chat_template", "documents", "tools"}
    if taken:
        raise RequestError(f"chat_template_kwargs may not set {', '.join(sorted(taken))}", "chat_template_kwargs")
    documents = body.get("documents")
    if documents is not None and (not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents)):
        raise RequestError("documents must be a list of objects", "documents")
    out["template_kwargs"] = {**kwargs, **({"documents": documents} if documents is not None else {})}
    return out


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
    return ParsedRequest(prompts, params, max_tokens, stream, include_usage, logprobs, **_options(body, False))


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


def _message_extras(message: dict, i: int) -> dict:
    """A message's ``name``, ``tool_calls`` and ``tool_call_id``, kept for the chat template (OpenAI's shapes)."""
    out = {}
    for key, kind in (("name", str), ("tool_call_id", str), ("tool_calls", list)):
        v = message.get(key)
        if v is None:
            continue
        if not isinstance(v, kind) or key == "tool_calls" and not all(isinstance(c, dict) for c in v):
            raise RequestError(f"messages[{i}].{key} must be a {'list of objects' if kind is list else 'string'}",
                               f"messages[{i}].{key}")
        out[key] = v
    return out


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
        checked.append({"role": m["role"], "content": text, **_message_extras(m, i)})
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
                         add_generation_prompt=_bool(body, "add_generation_prompt", True), **_options(body, True))


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


if __name__ == "__main__":
    print(field_table())
