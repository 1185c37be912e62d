"""Next-token sampling for a whole step, batched: greedy, temperature, top-k, top-p (nucleus), per-request seeds.

One row of logits per sequence. Greedy rows (``temperature == 0``) take the argmax. The other rows are divided by
their temperature, filtered by top-k and top-p in one sort, and sampled with the exponential-race trick
(``argmax(p / q)``, ``q ~ Exp(1)``), which equals multinomial sampling but lets each seeded request draw its noise
from its own ``torch.Generator``, so a seeded request gives the same tokens whatever else shares its batch.
Stop conditions (EOS, stop ids, ``max_tokens``, ``max_model_len``) are checked by ``check_stop``. ``Sampler`` turns a
step's logits into its ``scheduler.ModelOutput``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedattn import beam_search
from pagedattn.kernels import cpu
from pagedattn.scheduler import ModelOutput
from pagedattn.sequence import FinishReason, SamplingParams, Sequence


@dataclass
class SamplingRow:
    """One sequence's sampling settings for this step."""

    params: SamplingParams
    generator: torch.Generator | None = None


def _filter_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask (to -inf) tokens outside each row's top-k and top-p; ``top_k <= 0`` / ``top_p >= 1`` disable a filter.

    Top-k first, then top-p over the renormalised survivors (vLLM's order). Top-p keeps the nucleus: the fewest most
    likely tokens whose mass reaches ``top_p`` (a token is dropped once the mass before it is ``>= top_p``)."""
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    cum = probs.cumsum(dim=-1) - probs  # mass strictly before each token: keep the token that reaches top_p
    drop |= (cum >= top_p[:, None]) & (top_p[:, None] < 1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


def sample(logits: Tensor, rows: list[SamplingRow], want_logprobs: bool = True
           ) -> tuple[list[int], list[float] | None]:
    """Pick one token per row; returns the token ids and (when ``want_logprobs``) their log-probabilities under
    the raw logits. Skipping the log-probabilities saves a pass over the vocabulary on the hot path."""
    logits = logits.float()
    greedy = [r.params.temperature == 0 for r in rows]
    if all(greedy):
        # = argmax (first maximum on ties); torch's max(dim) takes ~300 us on [64, 8192] logits on one CPU thread
        tokens = cpu.argmax_cpu(logits) if cpu.takes(logits) else logits.max(dim=-1).indices
    else:
        tokens = _sample_rows(logits, rows, greedy)
    if not want_logprobs:
        return tokens.tolist(), None
    chosen = logits.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()


def _sample_rows(logits: Tensor, rows: list[SamplingRow], greedy: list[bool]) -> Tensor:
    dev = logits.device
    temp = torch.tensor([r.params.temperature or 1.0 for r in rows], device=dev)
    top_k = torch.tensor([r.params.top_k for r in rows], device=dev)
    top_p = torch.tensor([r.params.top_p for r in rows], device=dev)
    scaled = logits / temp[:, None]
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for i, r in enumerate(rows):
        noise[i].exponential_(generator=r.generator)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(torch.tensor(greedy, device=dev), logits.argmax(dim=-1), sampled)


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A per-request generator when the request has a seed (reproducible), else None (the global RNG)."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def check_stop(seq: Sequence, params: SamplingParams, eos_token_ids: frozenset[int], max_model_len: int
               ) -> FinishReason | None:
    """Why ``seq`` stops after its last token, or None (vLLM's order: stop tokens, then length limits)."""
    last = seq.last_token_id
    if not params.ignore_eos and last in eos_token_ids:
        return "stop"
    if last in params.stop_token_ids:
        return "stop"
    if seq.get_output_len() >= params.max_tokens or seq.get_len() >= max_model_len:
        return "length"
    return None


class Sampler:
    """A step's new tokens (§4.4 for n > 1 and beams): beam groups pick theirs together (``beam_search.step_groups``,
    which also decides their forks), every other sequence is sampled per request (``sample``, seeded by the
    request's own generator). It returns them as a ``scheduler.ModelOutput`` with the engine's stop rule
    (``check_stop``): the scheduler applies them (``Scheduler.update_from_output``). It keeps each unfinished
    request's generator, and the EOS ids."""

    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.eos_token_ids, self.max_model_len = frozenset(eos_token_ids), max_model_len
        self.generators: dict[str, torch.Generator | None] = {}

    def add(self, request_id: str, generator: torch.Generator | None) -> None:
        self.generators[request_id] = generator

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)

    def stop(self, seq: Sequence, group) -> FinishReason | None:
        return check_stop(seq, group.sampling_params, self.eos_token_ids, self.max_model_len)

    def __call__(self, out, result) -> ModelOutput:
        """The tokens of ``result`` (``executor.StepResult``: one logits row per running sequence of ``out``)."""
        rows, logits = result.inp.rows, result.logits
        beams = beam_search.BeamStep()
        keep = [i for i, (_, g) in enumerate(rows) if g.beam_state is None]
        if len(keep) < len(rows):  # beam groups pick their tokens together (§4.4)
            beams = beam_search.step_groups(logits, rows)
            rows, logits = [rows[i] for i in keep], logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
        # log-probabilities only rank the samples of n > 1 / best_of requests; greedy n = 1 skips them
        want_logprobs = any(len(g.seqs) > 1 for g in out.scheduled_groups)
        tokens, logprobs = sample(logits, [SamplingRow(g.sampling_params, self.generators[g.request_id])
                                           for _, g in rows], want_logprobs) if rows else ([], None)
        return ModelOutput(tokens=[(s, g, tok, lp) for (s, g), tok, lp in
                                   zip(rows, tokens, logprobs or [0.0] * len(tokens))],
                           rewrites=beams.rewrites, forks=beams.forks, finished=beams.finished, stop=self.stop,
                           now=time.perf_counter())
