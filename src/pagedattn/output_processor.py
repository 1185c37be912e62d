"""The postprocess of one engine step (paper §4.4, §4.5): sample, append, stop, free, build the outputs.

After the runner's forward pass, every sequence that ran gets one new token: beam groups pick theirs together
(``beam_search.step_groups``, §4.4), the others are sampled per request (``sampling.sample``, seeded per request).
A sequence stops on an EOS or stop token or at its length limit (``sampling.check_stop``); the scheduler then frees
the blocks of finished sequences, and each scheduled request gets a ``RequestOutput``. Requests that the scheduler
refused this step (they can never be served) finish with their error.

The processor knows the unfinished requests (``requests``) and their samplers' random generators; it never touches
the KV manager or the caches: block frees go through the scheduler, beam forks through ``Scheduler.fork``.
"""
from __future__ import annotations

import time

import torch

from pagedattn import beam_search
from pagedattn.detokenizer import IncrementalDetokenizer
from pagedattn.executor import StepResult
from pagedattn.sampling import SamplingRow, check_stop, sample
from pagedattn.scheduler import Scheduler, SchedulerOutputs
from pagedattn.sequence import CompletionOutput, RequestOutput, SequenceGroup


class OutputProcessor:
    """Turns a step's logits into tokens and a step's groups into ``RequestOutput``s."""

    def __init__(self, scheduler: Scheduler, tokenizer, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.scheduler, self.tokenizer = scheduler, tokenizer
        self.eos_token_ids, self.max_model_len = eos_token_ids, max_model_len
        self.requests: dict[str, SequenceGroup] = {}  # unfinished requests
        self.generators: dict[str, torch.Generator | None] = {}
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None

    def add(self, group: SequenceGroup, generator: torch.Generator | None) -> None:
        self.requests[group.request_id] = group
        self.generators[group.request_id] = generator

    def forget(self, request_id: str) -> None:
        g = self.requests.pop(request_id, None)
        self.generators.pop(request_id, None)
        if g is not None and self.detokenizer is not None:
            for s in g.seqs:
                self.detokenizer.forget(s.seq_id)

    def process(self, out: SchedulerOutputs, result: StepResult | None, finished_only: bool = False
                ) -> list[RequestOutput]:
        """The step's outputs: refused requests first, then the scheduled ones (``finished_only``: only those that
        finished). ``result`` is None when no forward pass ran."""
        outputs = [self.fail(g, g.error) for g in out.ignored]
        if result is None:
            if out.is_empty() and not (out.preempted or out.ignored) and self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler made no progress with requests left")
            return outputs
        self.scheduler.mark_computed(out)
        self._append_tokens(out, result)
        now = time.perf_counter()
        groups = out.scheduled_groups
        for g in groups:
            if g.metrics.first_token_time is None:
                g.metrics.first_token_time = now
            if g.is_finished():
                g.metrics.finish_time = now
                self.forget(g.request_id)
        self.scheduler.free_finished()
        return outputs + [self.output(g) for g in groups if not finished_only or g.is_finished()]

    def _append_tokens(self, out: SchedulerOutputs, result: StepResult) -> None:
        """One new token per sequence that ran, then its stop check."""
        rows, logits = result.inp.rows, result.logits
        keep = [i for i, (_, g) in enumerate(rows) if not beam_search.is_beam_group(g)]
        if len(keep) < len(rows):  # beam groups pick their tokens together (§4.4)
            beam_search.step_groups(self.scheduler, logits, rows)
            rows, logits = [rows[i] for i in keep], logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
        # log-probabilities only rank the samples of n > 1 / best_of requests; greedy n = 1 skips them
        want_logprobs = any(len(g.seqs) > 1 for g in out.scheduled_groups)
        tokens, logprobs = sample(logits, [SamplingRow(g.sampling_params, self.generators[g.request_id])
                                           for _, g in rows], want_logprobs) if rows else ([], None)
        for (s, g), tok, lp in zip(rows, tokens, logprobs or [0.0] * len(tokens)):
            s.append_token(tok, lp)
            reason = check_stop(s, g.sampling_params, self.eos_token_ids, self.max_model_len)
            if reason is not None:
                s.finish(reason)

    def fail(self, g: SequenceGroup, message: str | None) -> RequestOutput:
        """Finish a request that can never be served with ``message`` as its error."""
        g.error = message
        for s in g.seqs:
            s.status, s.finish_reason = "finished", "error"
        g.metrics.finish_time = time.perf_counter()
        self.forget(g.request_id)
        return self.output(g)

    def output(self, g: SequenceGroup) -> RequestOutput:
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
            outs.append(CompletionOutput(i, text, ids, s.cumulative_logprob, s.finish_reason))
        return RequestOutput(g.request_id, g.prompt, g.prompt_token_ids, outs, g.is_finished(), g.metrics, g.error)
