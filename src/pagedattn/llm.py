"""The ``LLM`` facade (vLLM's offline API): ``LLM(model).generate(prompts, sampling_params)`` over an ``LLMEngine``.

It adds requests, steps the engine until every request is done (with a progress bar) and returns the outputs in
input order. A prompt that can never be served (``add_request`` raises ``ValueError`` naming the limit) gets an
output with ``error`` set and finish reason ``"error"`` while the other requests run normally.
"""
from __future__ import annotations

import itertools
from typing import cast

from pagedattn.engine import LLMEngine
from pagedattn.sequence import CompletionOutput, RequestMetrics, RequestOutput, SamplingParams, as_int, as_token_ids


def error_output(request_id: str, prompt, message: str) -> RequestOutput:
    """The output of a request rejected before it reached the scheduler."""
    now = LLMEngine.now()
    try:
        ids = as_token_ids(prompt)
    except ValueError:
        ids = []
    return RequestOutput(request_id, prompt if isinstance(prompt, str) else None, ids,
                         [CompletionOutput(0, None, [], 0.0, "error")], True, RequestMetrics(now, None, now), message)


def _prompt_list(prompts) -> list:
    """``generate``'s prompts as a list of per-request prompts: one string or one sequence of token ids is a single
    prompt; a list (or tuple, or 2-d array) holds one prompt per request, each checked by ``add_request``."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (bytes, dict, set)) or not hasattr(prompts, "__len__") or getattr(prompts, "ndim", 1) == 0:
        raise ValueError(f"prompts must be a string, a sequence of integer token ids, or a list of those; got "
                         f"{type(prompts).__name__}")
    if len(prompts) and as_int(prompts[0]) is not None:  # one prompt of token ids
        return [prompts]
    return list(prompts)


def _params_from_dict(sp: dict) -> SamplingParams:
    try:
        return SamplingParams(**sp)
    except TypeError as e:  # an unknown key
        raise ValueError(f"sampling_params: {e}") from None


class LLM:
    """Offline batched generation (vLLM's ``LLM``): ``LLM(model).generate(prompts, sampling_params)``."""

    def __init__(self, model, tokenizer=None, **engine_kwargs) -> None:
        self.engine = LLMEngine(model, tokenizer, **engine_kwargs)
        self._counter = itertools.count()

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids); outputs come back in input order. A prompt that can
        never be served gets an output with ``error`` set and finish reason ``"error"``; the others still run."""
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, (SamplingParams, dict)):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)):
            raise ValueError(f"sampling_params must be a SamplingParams, a dict, or a list of those; got "
                             f"{type(sampling_params).__name__}")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        results: list[RequestOutput | None] = [None] * len(prompts)
        index: dict[str, int] = {}
        for i, (prompt, sp) in enumerate(zip(prompts, sampling_params)):
            rid = str(next(self._counter))
            try:
                if isinstance(sp, dict):
                    sp = _params_from_dict(sp)
                self.engine.add_request(rid, prompt, sp)
                index[rid] = i
            except ValueError as e:
                results[i] = error_output(rid, prompt, str(e))
        from tqdm.auto import tqdm

        with tqdm(total=len(prompts), desc="generate", disable=not use_tqdm, initial=len(prompts) - len(index)) as bar:
            while self.engine.has_unfinished_requests():
                for o in self.engine.step(finished_only=True):
                    if o.finished and o.request_id in index:
                        results[index.pop(o.request_id)] = o
                        bar.update(1)
        return cast(list[RequestOutput], results)  # every prompt has its output by now
