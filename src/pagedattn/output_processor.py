"""The outputs of one engine step (paper §4.4, §4.5): each scheduled request's ``RequestOutput``.

After the scheduler has applied the step's tokens (``Scheduler.update_from_output``), every scheduled request gets a
``RequestOutput``: its samples (the ``n`` most likely when ``best_of`` is larger), or its best beams, with text from
the incremental detokenizer. Requests that the scheduler refused (they can never be served, finished there) come out
with their error.

The processor knows the unfinished requests (``requests``) and their detokenizer state; it touches neither the
scheduler nor the KV manager.
"""
from __future__ import annotations

from pagedattn import beam_search
from pagedattn.detokenizer import IncrementalDetokenizer
from pagedattn.sequence import CompletionOutput, RequestOutput, SequenceGroup


class OutputProcessor:
    """Turns a step's groups into ``RequestOutput``s."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, SequenceGroup] = {}  # unfinished requests
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None

    def add(self, group: SequenceGroup) -> None:
        self.requests[group.request_id] = group

    def forget(self, request_id: str) -> None:
        g = self.requests.pop(request_id, None)
        if g is not None and self.detokenizer is not None:
            for s in g.seqs:
                self.detokenizer.forget(s.seq_id)

    def outputs(self, groups: list[SequenceGroup], finished_only: bool = False) -> list[RequestOutput]:
        """The outputs of a step's scheduled ``groups`` (``finished_only``: of those that finished); samples split
        off one request (``SequenceGroup.root``) give one output, the request's."""
        roots = {id(g.root): g.root for g in groups}
        return [self.output(g) for g in roots.values() if not finished_only or g.is_finished()]

    def output(self, g: SequenceGroup) -> RequestOutput:
        g = g.root
        if beam_search.is_beam_group(g):  # the best beams, best first
            return RequestOutput(g.request_id, g.prompt, g.prompt_token_ids, beam_search.outputs(g, self.tokenizer),
                                 g.is_finished(), g.metrics, g.error)
        seqs = g.seqs
        if g.is_finished() and len(seqs) > g.sampling_params.n:  # best_of: keep the n most likely
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: g.sampling_params.n]
        outs = []
        for i, s in enumerate(seqs):
            ids = s.output_token_ids
            text = self.detokenizer.text(s.seq_id, ids, final=g.is_finished()) if self.detokenizer else None
            if text is not None and s.stop_text_len is not None:  # a stop string ended it (sampling.Sampler.stop)
                text = text[:s.stop_text_len]
            logprobs = list(s.output_logprobs) if g.sampling_params.logprobs is not None else None
            outs.append(CompletionOutput(i, text, ids, s.cumulative_logprob, s.finish_reason, logprobs, s.stop_reason))
        return RequestOutput(g.request_id, g.prompt, g.prompt_token_ids, outs, g.is_finished(), g.metrics, g.error)
