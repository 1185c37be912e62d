"""Next-token sampling for a whole step, batched: greedy, temperature, top-k, top-p (nucleus), min-p, penalties,
per-request seeds.

One row of logits per sequence. Rows that ask for them first get vLLM's logits processing, in vLLM's order:
``min_tokens`` bans the stop tokens, then the repetition, frequency and presence penalties (``apply_penalties``).
Greedy rows (``temperature == 0``) take the argmax. The other rows are divided by
their temperature, filtered by top-k and top-p in one sort, then by min-p, and sampled with the exponential-race trick
(``argmax(p / q)``, ``q ~ Exp(1)``), which equals multinomial sampling but lets each seeded request draw its noise
from its own ``torch.Generator``, so a seeded request gives the same tokens whatever else shares its batch.
Stop conditions (EOS, stop ids, ``max_tokens``, ``max_model_len``) are checked by ``check_stop``; stop strings by
``Sampler.stop``, on the text of an incremental detokenizer. ``Sampler`` turns a step's logits into its
``scheduler.ModelOutput`` and records the top log-probabilities of the requests that ask for them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from pagedattn import beam_search
from pagedattn.detokenizer import IncrementalDetokenizer
from pagedattn.kernels import cpu
from pagedattn.scheduler import ModelOutput
from pagedattn.sequence import FinishReason, SamplingParams, Sequence


@dataclass
class SamplingRow:
    """One sequence's sampling settings for this step."""

    params: SamplingParams
    generator: torch.Generator | None = None
    seq: Sequence | None = None  # its tokens, for penalties and min_tokens (None: neither applies)


def apply_penalties(logits: Tensor, rows: list[SamplingRow], eos_token_ids: frozenset[int] = frozenset()) -> Tensor:
    """``logits`` after ``min_tokens`` and the penalties of the rows that ask for them (a new fp32 tensor; ``logits``
    itself when no row does). vLLM's definitions: a sequence short of ``min_tokens`` output tokens cannot sample EOS
    (unless ``ignore_eos``) or a stop token id; ``repetition_penalty`` divides a positive logit, and multiplies a
    negative one, of every token in the prompt or the output (CTRL, Keskar et al. 2019; Hugging Face's
    ``RepetitionPenaltyLogitsProcessor``); ``frequency_penalty`` is subtracted once per occurrence of a token in the
    output, ``presence_penalty`` once if it occurs at all (OpenAI's definition)."""
    todo = [i for i, r in enumerate(rows) if r.params.processes_logits and r.seq is not None and (
        r.params.has_penalties or r.seq.get_output_len() < r.params.min_tokens)]
    if not todo:
        return logits
    logits = logits.to(torch.float32, copy=True)
    vocab = logits.shape[-1]
    for i in todo:
        p, seq = rows[i].params, rows[i].seq
        assert seq is not None
        if seq.get_output_len() < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            ids = [t for t in banned if t < vocab]
            if ids:
                logits[i, ids] = float("-inf")
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
            x = logits[i, seen]
            logits[i, seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and seq.get_output_len():
            counts = torch.bincount(torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device),
                                    minlength=vocab)[:vocab].to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


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


def _filter_min_p(probs: Tensor, min_p: Tensor) -> Tensor:
    """Zero the probabilities below ``min_p`` times their row's largest (the most likely token always stays)."""
    return probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)


def sample(logits: Tensor, rows: list[SamplingRow], want_logprobs: bool = True,
           eos_token_ids: frozenset[int] = frozenset()) -> tuple[list[int], list[float] | None]:
    """Pick one token per row; returns the token ids and (when ``want_logprobs``) their log-probabilities under
    the raw logits. Skipping the log-probabilities saves a pass over the vocabulary on the hot path."""
    raw = logits
    logits = apply_penalties(logits, rows, eos_token_ids)
    greedy = [r.params.temperature == 0 for r in rows]
    if all(greedy):
        # = argmax (first maximum on ties), in C++ on fp32 logits or the model's bf16 ones as they are: torch's
        # max(dim) takes ~300 us on [64, 8192] fp32 logits on one CPU thread, and bf16's copy to fp32 ~100 us
        tokens = (cpu.argmax_cpu(logits) if cpu.takes(logits, dtypes=cpu.LAYER_DTYPES)
                  else logits.float().max(dim=-1).indices)
    else:
        tokens = _sample_rows(logits.float(), rows, greedy)
    if not want_logprobs:
        return tokens.tolist(), None
    chosen = raw.float().log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()


def top_logprobs(logits: Tensor, tokens: list[int], ks: list[int]) -> list[dict[int, float]]:
    """Per row: {token id: log-probability} of its chosen token and its ``ks[i]`` most likely tokens, under the
    raw logits (vLLM V1's default; OpenAI's ``logprobs``)."""
    lp = logits.float().log_softmax(dim=-1)
    k = min(max(ks, default=0), lp.shape[-1])
    values, ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    out = []
    for i, (tok, ki) in enumerate(zip(tokens, ks)):
        d = {tok: float(lp[i, tok])}
        d.update((int(t), float(v)) for t, v in zip(ids[i, :ki].tolist(), values[i, :ki].tolist()) if int(t) not in d)
        out.append(d)
    return out


def _sample_rows(logits: Tensor, rows: list[SamplingRow], greedy: list[bool]) -> Tensor:
    dev = logits.device
    temp = torch.tensor([r.params.temperature or 1.0 for r in rows], device=dev)
    vocab = logits.shape[-1]
    top_k = torch.tensor([min(r.params.top_k, vocab) for r in rows], device=dev)
    top_p = torch.tensor([r.params.top_p for r in rows], device=dev)
    scaled = logits / temp[:, None]
    if bool((top_k > 0).any()) or bool((top_p < 1).any()):
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    if any(r.params.min_p > 0 for r in rows):
        probs = _filter_min_p(probs, torch.tensor([r.params.min_p for r in rows], device=dev))
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
    """Why ``seq`` stops after its last token, or None (vLLM's order: stop tokens, then length limits). Before
    ``min_tokens`` output tokens only the length limits stop it."""
    last = seq.last_token_id
    if seq.get_output_len() >= params.min_tokens:
        if not params.ignore_eos and last in eos_token_ids:
            return "stop"
        if last in params.stop_token_ids:
            seq.stop_reason = last
            return "stop"
    if seq.get_output_len() >= params.max_tokens or seq.get_len() >= max_model_len:
        return "length"
    return None


class Sampler:
    """A step's new tokens (§4.4 for n > 1 and beams): beam groups pick theirs together (``beam_search.step_groups``,
    which also decides their forks), every other sequence is sampled per request (``sample``, seeded by the
    request's own generator). It returns them as a ``scheduler.ModelOutput`` with the engine's stop rule
    (``check_stop``, and ``stop`` strings on the text of its own incremental detokenizer): the scheduler applies them
    (``Scheduler.update_from_output``). It keeps each unfinished request's generator, and the EOS ids. A sequence
    whose request asks for ``logprobs`` gets its token's top log-probabilities in ``Sequence.output_logprobs``."""

    def __init__(self, eos_token_ids: frozenset[int], max_model_len: int, tokenizer=None) -> None:
        self.eos_token_ids, self.max_model_len = frozenset(eos_token_ids), max_model_len
        self.tokenizer = tokenizer
        self.generators: dict[str, torch.Generator | None] = {}
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._stop_seqs: dict[str, set[int]] = {}  # request id -> its sequences with detokenizer state

    def check(self, params: SamplingParams) -> None:
        """Raise ``ValueError`` for settings this sampler cannot honour (stop strings need a tokenizer)."""
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")

    def add(self, request_id: str, generator: torch.Generator | None) -> None:
        self.generators[request_id] = generator

    def forget(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        for seq_id in self._stop_seqs.pop(request_id, ()):
            if self.detokenizer is not None:
                self.detokenizer.forget(seq_id)

    def stop(self, seq: Sequence, group) -> FinishReason | None:
        params = group.sampling_params
        reason = check_stop(seq, params, self.eos_token_ids, self.max_model_len)
        if params.stop and self.detokenizer is not None and seq.get_output_len() >= params.min_tokens:
            self._stop_seqs.setdefault(group.request_id, set()).add(seq.seq_id)
            if self._stop_string(seq, params):
                reason = "stop"
        return reason

    def _stop_string(self, seq: Sequence, params: SamplingParams) -> bool:
        """Whether the text of ``seq`` now holds one of ``params.stop``; if so, the text is cut at the first one
        (vLLM's rule: after it with ``include_stop_str_in_output``, else before it)."""
        assert self.detokenizer is not None
        ids = seq.output_token_ids
        if not any(s in self.detokenizer.text(seq.seq_id, ids) for s in params.stop):
            return False
        text = self.detokenizer.text(seq.seq_id, ids, final=True)  # the full decode the outputs show
        hits = [(text.find(s), s) for s in params.stop if s in text]
        if not hits:  # the incremental text and the full decode disagree: the full decode decides
            return False
        pos, hit = min(hits)
        seq.stop_text_len = pos + len(hit) if params.include_stop_str_in_output else pos
        seq.stop_reason = hit
        return True

    def __call__(self, out, result) -> ModelOutput:
        """The tokens of ``result`` (``executor.StepResult``: one logits row per running sequence of ``out``)."""
        rows, logits = result.inp.rows, result.logits
        beams = beam_search.BeamStep()
        keep = [i for i, (_, g) in enumerate(rows) if g.beam_state is None]
        if len(keep) < len(rows):  # beam groups pick their tokens together (§4.4)
            beams = beam_search.step_groups(logits, rows)
            rows, logits = [rows[i] for i in keep], logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
        # log-probabilities rank the samples of n > 1 / best_of requests, or were asked for; greedy n = 1 skips them
        asked = [i for i, (_, g) in enumerate(rows) if g.sampling_params.logprobs is not None]
        want_logprobs = bool(asked) or any(len(g.seqs) > 1 for g in out.scheduled_groups)
        tokens, logprobs = sample(logits, [SamplingRow(g.sampling_params, self.generators[g.request_id], s)
                                           for s, g in rows], want_logprobs, self.eos_token_ids) \
            if rows else ([], None)
        if asked:
            top = top_logprobs(logits[torch.tensor(asked, dtype=torch.long, device=logits.device)],
                               [tokens[i] for i in asked], [rows[i][1].sampling_params.logprobs for i in asked])
            for i, d in zip(asked, top):
                rows[i][0].output_logprobs.append(d)
        return ModelOutput(tokens=[(s, g, tok, lp) for (s, g), tok, lp in
                                   zip(rows, tokens, logprobs or [0.0] * len(tokens))],
                           rewrites=beams.rewrites, forks=beams.forks, finished=beams.finished, stop=self.stop,
                           now=time.perf_counter())
