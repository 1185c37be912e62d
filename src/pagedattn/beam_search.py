"""Beam search over a paged KV cache (paper §4.4, Fig. 9; evaluated in §6.3, Figs. 14-15).

A beam-search request is one ``SequenceGroup`` of ``k = beam_width`` running sequences (the beams). Each step the
engine computes one token's logits for every beam; ``BeamSearchState.step`` then picks the next ``k`` beams among all
``k x vocab`` continuations, exactly as Hugging Face ``generate(num_beams=k, do_sample=False)`` (transformers 5.x,
``GenerationMixin._beam_search``) does, with the same float32 operations:

- scores are cumulative log-softmax log-probabilities; the first step starts from ``[0, -1e9, ...]`` so that only the
  first (of ``k`` identical) beams expands;
- the top ``K = max(2, 1 + #eos) * k`` candidates over beams x vocab are kept; a candidate whose token is an EOS (or
  that reaches ``max_tokens``) *hits the stopping criteria*;
- the best ``k`` candidates that do not hit it are the next running beams (sorted, best first);
- of the first ``k`` candidates, those that hit it are offered to the finished-hypotheses list (kept: the best ``k``),
  scored ``sum_logprobs / gen_len ** length_penalty`` where ``gen_len`` counts the *generated* tokens, the EOS token
  included (HF 5.x: ``cur_len + 1 - decoder_prompt_len``), not the whole sequence;
- ``early_stopping``: ``True`` stops as soon as ``k`` hypotheses are finished; ``False`` stops when the best running
  beam, normalised by the current generated length, cannot beat the worst finished hypothesis; ``"never"`` does the
  same with the maximum generated length when ``length_penalty > 0``. The heuristic, once satisfied, stays satisfied,
  and from then on nothing more enters the finished list. The group also stops when every candidate hits the
  stopping criteria (``max_tokens``).

Memory (§4.4): the ``k`` beams are ``k`` block tables. A surviving beam with one child keeps its sequence and its
blocks; every further child of the same parent reuses the sequence slot of a beam that died this step: the dead
beam's blocks are freed and the parent's block table is forked into it (``BlockManager.fork_into``: reference counts
go up, nothing is copied). The children's next appends then copy the shared, partly filled last block on write; the
scheduler collects those copies in its ``append_slots`` of the next step, and the runner performs all of a step's
copies as one batched ``copy_blocks``. Blocks whose last beam died return to the pool at once. So beams share their
common history, and the sharing shrinks and grows as candidates branch and die, as in Fig. 9.

On a KV manager without block tables (Orca's ``ContiguousKVManager``, one contiguous reservation per beam), a fork
must copy the parent's whole K/V into the child's reservation, as HF's ``_reorder_cache`` does; the scheduler hands
those slot copies (block size 1) to the runner with the next step's ``blocks_to_copy``, so only the runner touches
the caches.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor

from pagedattn.config import blocks_needed
from pagedattn.sequence import CompletionOutput, FinishReason, SamplingParams, Sequence, SequenceGroup

NEG = -1.0e9  # HF's "very large negative" score


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens, raw cumulative log-probability and length-normalised score."""

    token_ids: list[int]
    logprob: float
    score: float
    finish_reason: FinishReason


@dataclass
class BeamSearchState:
    """Per-request beam-search bookkeeping (HF's tensors for one batch item). ``beams[j]`` is the sequence holding
    running beam ``j``; beams are kept in HF's order (best running score first)."""

    beam_width: int
    max_new_tokens: int
    eos_token_ids: frozenset[int]
    length_penalty: float
    early_stopping: bool | str
    beams: list[Sequence]
    running_scores: Tensor = None  # type: ignore[assignment]  # float32 [k], set by __post_init__
    finished_scores: Tensor = None  # type: ignore[assignment]  # float32 [k], sorted descending; NEG for empty slots
    finished_flags: list[bool] = field(default_factory=list)
    finished: list[Hypothesis | None] = field(default_factory=list)
    heuristic_unsatisfied: bool = True
    num_generated: int = 0
    done: bool = False
    num_forks: int = 0  # beams that took over a dead beam's slot by forking a parent (stats)

    def __post_init__(self) -> None:
        k = self.beam_width
        self.running_scores = torch.zeros(k, dtype=torch.float32)
        self.running_scores[1:] = NEG
        self.finished_scores = torch.full((k,), NEG, dtype=torch.float32)
        self.finished_flags = [False] * k
        self.finished = [None] * k

    @property
    def beams_to_keep(self) -> int:
        return max(2, 1 + len(self.eos_token_ids)) * self.beam_width

    # ------------------------------------------------------------------------------------------------ step
    def select(self, log_probs: Tensor) -> list[tuple[int, int, float]] | None:
        """One beam-search step on the running beams' float32 log-softmax rows ``[k, vocab]`` (row ``j`` for
        ``beams[j]``). Updates scores and finished hypotheses; returns the next running beams as ``(parent index,
        token, cumulative logprob)`` in order, or None when the search is over."""
        k, vocab = log_probs.shape
        assert k == self.beam_width
        scores = (log_probs.float().cpu() + self.running_scores[:, None]).reshape(-1)
        top_lp, top_idx = torch.topk(scores, k=self.beams_to_keep)
        parents = top_idx // vocab
        tokens = top_idx % vocab
        gen_len = self.num_generated + 1  # generated tokens including this one (HF: cur_len + 1 - prompt_len)
        at_max = gen_len >= self.max_new_tokens
        hits = torch.tensor([at_max or int(t) in self.eos_token_ids for t in tokens.tolist()], dtype=torch.bool)

        # e. the next running beams: the best k candidates that do not stop
        running_lp = top_lp + hits.to(torch.float32) * NEG
        nxt = torch.topk(running_lp, k=k)[1]
        new_running = running_lp[nxt]

        # f. offer the stopped candidates among the first k to the finished hypotheses
        top_mask = torch.zeros(self.beams_to_keep, dtype=torch.bool)
        top_mask[:k] = True
        just_finished = hits & top_mask
        fin_lp = top_lp / (gen_len ** self.length_penalty)
        full = all(self.finished_flags) and self.early_stopping is True
        fin_lp = fin_lp + torch.tensor(float(full)) * NEG
        fin_lp = fin_lp + torch.tensor(float(not self.heuristic_unsatisfied)) * NEG
        fin_lp = fin_lp + (~just_finished).to(torch.float32) * NEG
        merged = torch.cat((self.finished_scores, fin_lp))
        keep = torch.topk(merged, k=k)[1].tolist()
        parents_l, tokens_l, top_lp_l = parents.tolist(), tokens.tolist(), top_lp.tolist()
        old_hyps, old_flags = self.finished, self.finished_flags
        new_hyps, new_flags = [], []
        for i in keep:
            if i < k:
                new_hyps.append(old_hyps[i])
                new_flags.append(old_flags[i])
            else:
                c = i - k
                if just_finished[c]:
                    toks = self.beams[parents_l[c]].output_token_ids + [tokens_l[c]]
                    reason: FinishReason = "stop" if tokens_l[c] in self.eos_token_ids else "length"
                    new_hyps.append(Hypothesis(toks, top_lp_l[c], float(merged[i]), reason))
                else:
                    new_hyps.append(None)
                new_flags.append(bool(just_finished[c]))
        self.finished_scores = merged[keep]
        self.finished, self.finished_flags = new_hyps, new_flags
        self.running_scores = new_running

        # g. stopping condition of the whole search
        self.num_generated = gen_len
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            hyp_len = self.max_new_tokens
        else:
            hyp_len = self.num_generated
        best_running = new_running[:1] / (hyp_len ** self.length_penalty)
        worst = torch.where(torch.tensor(self.finished_flags), self.finished_scores.min(),
                            torch.tensor(NEG, dtype=torch.float32))
        self.heuristic_unsatisfied = self.heuristic_unsatisfied and bool((best_running > worst).any())
        exists_open_beam = not (all(self.finished_flags) and self.early_stopping is True)
        valid_continuations = not bool(hits.all())
        if not (self.heuristic_unsatisfied and exists_open_beam and valid_continuations):
            self.done = True
            return None
        return [(parents_l[c], tokens_l[c], float(new_running[j])) for j, c in enumerate(nxt.tolist())]

    def results(self, n: int) -> list[Hypothesis]:
        """The ``n`` best finished hypotheses, best first (HF's ``num_return_sequences``)."""
        return [h for h in self.finished[:n] if h is not None]


# --------------------------------------------------------------------------------------------- engine glue
def max_new_tokens(params: SamplingParams, prompt_len: int, max_model_len: int) -> int:
    return max(1, min(params.max_tokens, max_model_len - prompt_len))


def worst_case_blocks(prompt_len: int, max_new: int, beam_width: int, block_size: int) -> int:
    """Blocks a beam group may need at its longest: the full prompt blocks, shared by every beam forever (they are
    never written again), plus, per beam, every block past them."""
    shared = prompt_len // block_size
    return shared + beam_width * (blocks_needed(prompt_len + max_new, block_size) - shared)


def check_fits(kv, prompt_len: int, params: SamplingParams, max_model_len: int) -> None:
    """Raise ValueError when a beam group could never fit in the device pool, even alone."""
    k, new = cast(int, params.beam_width), max_new_tokens(params, prompt_len, max_model_len)
    kv.check_group_blocks(worst_case_blocks(prompt_len, new, k, kv.block_size),
                          f"beam search with beam_width={k} over a {prompt_len}-token prompt and max_tokens={new}")


def init_group(group: SequenceGroup, eos_token_ids: frozenset[int], max_model_len: int) -> BeamSearchState:
    p = group.sampling_params
    eos = frozenset() if p.ignore_eos else frozenset(eos_token_ids)
    eos = eos | frozenset(p.stop_token_ids)
    state = BeamSearchState(cast(int, p.beam_width),
                            max_new_tokens(p, group.seqs[0].get_prompt_len(), max_model_len), eos,
                            p.length_penalty, p.early_stopping, list(group.seqs))
    group.beam_state = state
    return state


def is_beam_group(g: SequenceGroup) -> bool:
    return g.beam_state is not None


def _state(g: SequenceGroup) -> BeamSearchState:
    """A beam group's state (``init_group`` set it)."""
    return cast(BeamSearchState, g.beam_state)


@dataclass
class BeamStep:
    """What one step of beam search decided for the scheduler to apply (``Scheduler.update_from_output``), so that
    the search itself changes no sequence: ``forks`` (a surviving parent's K/V shared into a dead beam's sequence,
    in order), ``rewrites`` (each beam's new history: its parent's output plus its token, and its cumulative
    log-probability) and ``finished`` (the beams of a search that is over, with the reason)."""

    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    rewrites: list[tuple[Sequence, list[int], float]] = field(default_factory=list)
    finished: list[tuple[Sequence, FinishReason]] = field(default_factory=list)


def step_groups(logits: Tensor, rows: list[tuple[Sequence, SequenceGroup]]) -> BeamStep:
    """Advance every beam group among this step's ``rows`` (one logits row each) by one token: select the next
    beams (HF semantics) and map them onto the group's sequences (``_reassign``), or end the search. Returns the
    forks, histories and finished beams for the scheduler to apply, which also frees the finished beams' blocks."""
    step = BeamStep()
    by_group: dict[int, tuple[SequenceGroup, dict[int, int]]] = {}
    for i, (s, g) in enumerate(rows):
        if is_beam_group(g):
            by_group.setdefault(id(g), (g, {}))[1][s.seq_id] = i
    for g, row_of in by_group.values():
        st = _state(g)
        idx = torch.tensor([row_of[b.seq_id] for b in st.beams], device=logits.device)
        nxt = st.select(torch.log_softmax(logits[idx].float(), dim=-1))
        if nxt is None:
            reason: FinishReason = "length" if st.num_generated >= st.max_new_tokens else "stop"
            step.finished += [(b, reason) for b in st.beams]
            continue
        _reassign(st, nxt, step)
    return step


def _reassign(st: BeamSearchState, nxt: list[tuple[int, int, float]], step: BeamStep) -> None:
    """Map the next beams onto the ``k`` sequences: a parent's first child keeps the parent's sequence, further
    children take over dead beams' sequences, in order, each by a fork of its parent (``Scheduler.fork``: free +
    fork, or a copy on a contiguous manager). Every beam has the same length, so a child's computed tokens are its
    parent's. Adds the forks and the new histories to ``step``; ``st.beams`` becomes the new beams."""
    old = st.beams
    taken: set[int] = set()
    slot_of: list[int | None] = [None] * len(nxt)
    for j, (p, _, _) in enumerate(nxt):
        if p not in taken:
            taken.add(p)
            slot_of[j] = p
    free_slots = [i for i in range(len(old)) if i not in taken]
    for j, (p, _, _) in enumerate(nxt):
        if slot_of[j] is None:
            d = free_slots.pop(0)
            slot_of[j] = d
            step.forks.append((old[p], old[d]))
            st.num_forks += 1
    slots = cast(list[int], slot_of)  # every beam has its slot by now
    for j, (p, tok, score) in enumerate(nxt):
        step.rewrites.append((old[slots[j]], old[p].output_token_ids + [tok], score))
    st.beams = [old[slots[j]] for j in range(len(nxt))]


def outputs(g: SequenceGroup, tokenizer=None) -> list[CompletionOutput]:
    """A beam group's completions: while running, its beams; when done, the ``n`` best finished hypotheses, best
    first (HF's ``num_return_sequences``). ``cumulative_logprob`` is the raw sum of log-probabilities."""
    st = _state(g)
    n = g.sampling_params.n

    def text(ids):
        return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else None

    if st.done:
        return [CompletionOutput(i, text(h.token_ids), list(h.token_ids), h.logprob, h.finish_reason)
                for i, h in enumerate(st.results(n))]
    return [CompletionOutput(i, text(b.output_token_ids), b.output_token_ids, b.cumulative_logprob, None)
            for i, b in enumerate(st.beams[:n])]
