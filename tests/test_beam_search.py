"""Beam search on the paged engine (paper §4.4, Fig. 9) against Hugging Face ``generate(num_beams=k,
do_sample=False)`` on tiny random-weight models (Llama with GQA, OPT; float32, initializer range 0.2).

Per prompt, unbatched on the HF side and batched on ours: the ``k`` returned beams (``num_return_sequences=k``) are
token-identical and in the same order, and ``n=1`` returns HF's best beam, for k = 2 and 4, with length penalties
below, at and above 1 and ``early_stopping`` True / False / "never". The EOS id is set to a token these models
produce often, so that hypotheses finish on EOS; one case disables EOS (``ignore_eos`` / ``eos_token_id=None``).
Beam groups also survive all-or-nothing swapping (§4.5) unchanged (also when they share cached prefix blocks), run
on Orca's contiguous manager (where a fork copies the parent's K/V), and leave every block back in the pool.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from pagedattn.beam_search import (NEG, BeamSearchState, BeamStep, _reassign, init_group, outputs, step_groups,
                                   worst_case_blocks)
from pagedattn.llm import LLM
from pagedattn.sequence import CompletionOutput, SamplingParams, Sequence, SequenceGroup
from factories import contiguous_manager
from tiny_models import tiny_llama, tiny_opt

MAX_NEW = 10
PAD = 0
# (length_penalty, early_stopping, eos on)
CASES = [(1.0, False, True), (0.6, True, True), (1.5, "never", True), (-0.5, "never", True), (1.0, False, False)]


@pytest.fixture(autouse=True, scope="module")
def _single_thread(one_thread):
    """Every test here runs on one thread (conftest's ``one_thread``)."""
    yield


def tiny(name: str):
    if name == "llama":  # GQA: 4 query heads share 2 KV heads; token 223 is a frequent beam token
        return tiny_llama(max_position_embeddings=128, eos_token_id=223, bos_token_id=1, pad_token_id=PAD)
    return tiny_opt(max_position_embeddings=128, eos_token_id=252, bos_token_id=1, pad_token_id=PAD)


def prompts(n: int = 8, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 30, (n,), generator=g).tolist()
    return [torch.randint(3, 256, (k,), generator=g).tolist() for k in lens]


PROMPTS = prompts()
_MODELS: dict = {}


def model(name: str):
    if name not in _MODELS:
        _MODELS[name] = tiny(name)
    return _MODELS[name]


def hf_beams(hf, prompt, k, lp, es, eos, num_return):
    """HF's returned beams for one prompt (unbatched), as lists of generated tokens without the padding."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, num_beams=k, do_sample=False,
                      num_return_sequences=num_return, length_penalty=lp, early_stopping=es,
                      eos_token_id=hf.config.eos_token_id if eos else None, pad_token_id=PAD,
                      return_dict_in_generate=True, output_scores=True)
    lens = (out.beam_indices >= 0).sum(dim=1).tolist()  # generated tokens per returned beam
    return [row[len(prompt):len(prompt) + n] for row, n in zip(out.sequences.tolist(), lens)], \
        out.sequences_scores.tolist()


def beam_params(k, lp, es, eos, n):
    return SamplingParams(use_beam_search=True, beam_width=k, n=n, temperature=0, max_tokens=MAX_NEW,
                          length_penalty=lp, early_stopping=es, ignore_eos=not eos)


def assert_pool_full(llm: LLM) -> None:
    kv = llm.engine.kv
    kv.check_invariants()
    c, view = kv.pool_counts(), kv.block_view()  # a contiguous manager's arena: its slots; no blocks to view
    assert c.gpu_free == c.gpu_blocks and c.cpu_free == c.cpu_blocks and not kv.seq_ids()
    assert view is None or not any(view.ref_counts)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("name", ["llama", "opt"])
@pytest.mark.parametrize("k", [2, 4])
def test_beams_match_hf(name, k):
    hf = model(name)
    llm = LLM(hf, block_size=4)
    eos_id = hf.config.eos_token_id
    finished_on_eos = 0
    for lp, es, eos in CASES:
        ours = llm.generate(PROMPTS, beam_params(k, lp, es, eos, k), use_tqdm=False)  # batched on our side
        best = llm.generate(PROMPTS, beam_params(k, lp, es, eos, 1), use_tqdm=False)
        for p, o, b in zip(PROMPTS, ours, best):
            ref, ref_scores = hf_beams(hf, p, k, lp, es, eos, k)
            got = [c.token_ids for c in o.outputs]
            assert got == ref, (name, k, lp, es, eos, p)
            assert [c.token_ids for c in b.outputs] == ref[:1]
            # HF's sequence scores: sum of log-probs / generated length ** length_penalty
            assert [c.cumulative_logprob / len(c.token_ids) ** lp for c in o.outputs] == \
                pytest.approx(ref_scores, rel=1e-4, abs=1e-4)
            assert all((c.finish_reason == "stop") == (eos and c.token_ids[-1] == eos_id) for c in o.outputs)
            finished_on_eos += sum(eos and c.token_ids[-1] == eos_id for c in o.outputs)
    assert finished_on_eos > 0  # EOS hypotheses really occurred
    assert_pool_full(llm)


def test_hf_num_return_sequences_1_is_the_best_beam():
    hf = model("llama")
    llm = LLM(hf, block_size=4)
    for p in PROMPTS[:4]:
        ref, _ = hf_beams(hf, p, 4, 1.0, False, True, 1)
        assert llm.generate([p], beam_params(4, 1.0, False, True, 1), use_tqdm=False)[0].outputs[0].token_ids == ref[0]


def test_beam_blocks_are_shared_forked_and_freed():
    """Beams share their history: physical blocks stay below the logical ones, forks happen, copy-on-write copies
    are batched into the next step, and finished groups return every block."""
    hf = model("llama")
    llm = LLM(hf, block_size=4)
    e = llm.engine
    e.add_request("r", PROMPTS[1], beam_params(4, 1.0, False, False, 4))
    saved = []
    while e.has_unfinished_requests():
        e.step()
        kv = e.kv
        kv.check_invariants()
        if kv.seq_ids():
            saved.append(1 - kv.num_used_gpu_blocks / kv.num_logical_blocks())
    assert max(saved) > 0.3 and min(saved) >= 0
    assert any(m.num_blocks_copied for m in e.step_metrics)
    assert max(m.num_blocks_copied for m in e.step_metrics) <= 4  # at most one copy per beam per step
    assert_pool_full(llm)


def test_beam_groups_survive_swapping_unchanged():
    """A pool too small for the batch: beam groups are preempted all or nothing (swapped, §4.5), and come back with
    the same beams."""
    hf = model("opt")
    sp = beam_params(4, 1.0, False, True, 4)
    ref = [[c.token_ids for c in o.outputs] for o in LLM(hf, block_size=4).generate(PROMPTS, sp, use_tqdm=False)]
    need = max(worst_case_blocks(len(p), MAX_NEW, 4, 4) for p in PROMPTS)
    llm = LLM(hf, block_size=4, num_gpu_blocks=need + 2, preemption_mode="swap", num_cpu_blocks=512)
    got = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
    assert got == ref
    assert llm.engine.scheduler.num_preemptions["swap"] > 0
    assert_pool_full(llm)


def test_beams_match_hf_under_swap_and_prefix_caching():
    """Issue 12 (1): beam groups whose prompts share cached prefix blocks, swapped out and in (several in one step),
    still return HF's beams: a block shared between groups is swapped once and stays shared (§4.5)."""
    hf = model("llama")
    prompts_ = [list(range(10, 42)) + [100 + i] * 3 for i in range(4)]  # 4 shared blocks of 8
    want = [hf_beams(hf, p, 2, 1.0, False, False, 2)[0] for p in prompts_]
    llm = LLM(hf, block_size=8, num_gpu_blocks=10, preemption_mode="swap", num_cpu_blocks=128,
              enable_prefix_caching=True)
    got = llm.generate(prompts_, beam_params(2, 1.0, False, False, 2), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == want
    assert llm.engine.scheduler.num_preemptions["swap"] > 0 and llm.engine.kv.pool_counts().prefix_hits > 0
    assert_pool_full(llm)


def test_beam_search_on_orca_contiguous_manager():
    """Orca has no block tables: a fork copies the parent's whole K/V into the child's reservation (as HF's
    ``_reorder_cache``); the beams are the same."""
    hf = model("llama")
    sp = beam_params(2, 1.0, False, True, 2)
    ref = [[c.token_ids for c in o.outputs] for o in LLM(hf, block_size=4).generate(PROMPTS, sp, use_tqdm=False)]
    llm = LLM(hf, kv_manager=contiguous_manager(1024, "oracle", max_model_len=128), max_num_seqs=16)
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == ref
    assert_pool_full(llm)


def test_state_first_step_expands_only_the_first_beam():
    st = BeamSearchState(3, 5, frozenset({0}), 1.0, False, beams=[])
    st.beams = [type("S", (), {"output_token_ids": []})() for _ in range(3)]
    lp = torch.log_softmax(torch.randn(1, 50).repeat(3, 1), dim=-1)
    nxt = st.select(lp)
    assert [p for p, _, _ in nxt] == [0, 0, 0] and len({t for _, t, _ in nxt}) == 3


# ------------------------------------------------------------------------------------------------------------------
# BeamSearchState.select on hand-made log-probability tables (k = 2 beams, vocab of 4, EOS = token 3). Every
# log-prob is a sum of powers of two, so float32 adds them exactly; the expectations below are worked out by hand
# from the rules in the module docstring (HF 5.x): the top K = 2k = 4 candidates over beams x vocab, the best k that
# do not stop run on, the stopped ones among the first k are offered to the finished list scored
# sum / gen_len ** length_penalty, and the search stops when the best running beam (normalised) cannot beat the
# worst finished hypothesis, when k hypotheses are finished with early_stopping=True, or when every candidate stops.
EOS = 3


def hand_state(k: int, max_new: int, length_penalty: float, early_stopping, eos=(EOS,)) -> BeamSearchState:
    st = BeamSearchState(k, max_new, frozenset(eos), length_penalty, early_stopping, beams=[])
    st.beams = [SimpleNamespace(output_token_ids=[]) for _ in range(k)]
    return st


def advance(st: BeamSearchState, rows: list[list[float]]):
    """One ``select`` on a log-prob table (row j for beam j); then beam j becomes its parent's tokens plus its
    token, as ``_reassign`` does."""
    nxt = st.select(torch.tensor(rows, dtype=torch.float32))
    if nxt is not None:
        st.beams = [SimpleNamespace(output_token_ids=st.beams[p].output_token_ids + [t]) for p, t, _ in nxt]
    return nxt


def finished(st: BeamSearchState) -> list[tuple | None]:
    return [None if h is None else (h.token_ids, h.logprob, h.score, h.finish_reason)
            for h in st.finished]


@pytest.mark.parametrize("es", [False, True, "never"])
def test_select_hand_computed_four_steps(es):
    """length_penalty 2, max_tokens 5. Step 1 (only beam 0 expands): EOS -5/16 is the best candidate and finishes;
    tokens 0 (-1) and 1 (-2) run on, both children of beam 0. Step 2: the only EOS candidate ranks 4th (-6), outside
    the first k, so it is not offered. Step 3: EOS of beam 1 (-2.25 - 0.25 = -2.5) finishes with score -2.5 / 3**2,
    better than -5/16, so it goes first; both running beams are children of beam 0 (a fork); the list is full, so
    early_stopping=True stops here. Otherwise the best running beam -2 / 3**2 = -0.222 still beats the worst
    hypothesis -0.3125 (with 3 * 2 instead of 3**2 it would not: -0.333). Step 4: EOS at -3 scores -3 / 16 = -0.1875
    and pushes -5/16 out (a full list still takes better hypotheses); the best running beam -6 now scores -6 / 16 =
    -0.375 < -0.278 and the search stops, except with "never", which divides by max_tokens**2 = 25: -0.24 > -0.278."""
    st = hand_state(2, 5, 2.0, es)
    step1 = [[-1.0, -2.0, -4.0, -0.3125]] * 2
    assert advance(st, step1) == [(0, 0, -1.0), (0, 1, -2.0)]
    h1 = ([EOS], -0.3125, -0.3125, "stop")
    assert finished(st) == [h1, None] and st.finished_flags == [True, False]
    assert st.finished_scores.tolist() == [-0.3125, NEG] and st.running_scores.tolist() == [-1.0, -2.0]
    assert st.num_generated == 1 and not st.done

    # beams: [0] at -1, [1] at -2
    assert advance(st, [[-0.5, -6.0, -7.0, -5.0], [-0.25, -1.0, -7.5, -4.5]]) == [(0, 0, -1.5), (1, 0, -2.25)]
    assert finished(st) == [h1, None] and st.finished_flags == [True, False] and not st.done

    # beams: [0, 0] at -1.5, [1, 0] at -2.25
    nxt = advance(st, [[-1.5, -0.5, -9.0, -8.0], [-8.0, -8.5, -9.0, -0.25]])
    h3 = ([1, 0, EOS], -2.5, pytest.approx(-2.5 / 9), "stop")  # float32
    assert finished(st) == [h3, h1] and st.finished_flags == [True, True]
    assert st.finished_scores.tolist() == pytest.approx([-2.5 / 9, -0.3125])
    if es is True:
        assert nxt is None and st.done
        return
    assert nxt == [(0, 1, -2.0), (0, 0, -3.0)] and not st.done

    # beams: [0, 0, 1] at -2, [0, 0, 0] at -3
    nxt = advance(st, [[-9.0, -9.5, -10.0, -1.0], [-3.0, -4.0, -9.0, -10.0]])
    assert finished(st) == [([0, 0, 1, EOS], -3.0, -0.1875, "stop"), h3]
    if es == "never":
        assert nxt == [(1, 0, -6.0), (1, 1, -7.0)] and not st.done
    else:
        assert nxt is None and st.done
    assert st.num_generated == 4


@pytest.mark.parametrize("es", [False, True, "never"])
def test_select_early_stopping_modes_at_length_penalty_1(es):
    """max_tokens 4. Step 1: EOS -0.5 finishes. Step 2: EOS -1.25 (rank 1) finishes with -1.25 / 2 = -0.625 and
    fills the list; beam 1's EOS (-2.5) ranks 3rd, outside the first k, and is not offered. The best running beam
    -2.25 scores -2.25 / 2 = -1.125 <= -0.625: False stops, True stops (full list); "never" divides by
    max_tokens: -2.25 / 4 = -0.5625 > -0.625 and runs on."""
    st = hand_state(2, 4, 1.0, es)
    assert advance(st, [[-1.0, -2.0, -4.0, -0.5]] * 2) == [(0, 0, -1.0), (0, 1, -2.0)]
    assert finished(st) == [([EOS], -0.5, -0.5, "stop"), None]
    nxt = advance(st, [[-3.0, -5.0, -6.0, -0.25], [-0.25, -6.5, -7.5, -0.5]])
    assert finished(st) == [([EOS], -0.5, -0.5, "stop"), ([0, EOS], -1.25, -0.625, "stop")]
    assert st.finished_flags == [True, True]
    assert nxt == ([(1, 0, -2.25), (0, 0, -4.0)] if es == "never" else None)
    assert st.done == (es != "never")


def test_select_a_running_beam_that_only_ties_the_worst_hypothesis_stops():
    """length_penalty 1, early_stopping False. Step 1: EOS -0.75 finishes. Step 2: EOS -1.25 finishes with -0.625;
    the best running beam -1.5 scores -1.5 / 2 = -0.75, equal to the worst hypothesis: it cannot beat it, stop."""
    st = hand_state(2, 6, 1.0, False)
    advance(st, [[-1.0, -2.0, -4.0, -0.75]] * 2)
    assert advance(st, [[-0.5, -5.0, -6.0, -0.25], [-5.5, -6.5, -7.5, -4.5]]) is None and st.done
    assert finished(st) == [([0, EOS], -1.25, -0.625, "stop"), ([EOS], -0.75, -0.75, "stop")]


def test_select_at_max_tokens_every_candidate_stops_with_length():
    """No EOS, max_tokens 2, length_penalty 1. Step 1: tokens 1 (-0.5) and 0 (-1) run on. Step 2 reaches max_tokens:
    every candidate stops, the first k become hypotheses ([0, 0] at -1.25 -> -0.625, [1, 1] at -1.5 -> -0.75) with
    reason "length", and the search is over."""
    st = hand_state(2, 2, 1.0, False, eos=())
    assert advance(st, [[-1.0, -0.5, -2.0]] * 2) == [(0, 1, -0.5), (0, 0, -1.0)]
    assert finished(st) == [None, None] and not st.done
    assert advance(st, [[-2.0, -1.0, -3.0], [-0.25, -4.0, -5.0]]) is None and st.done
    assert finished(st) == [([0, 0], -1.25, -0.625, "length"), ([1, 1], -1.5, -0.75, "length")]
    assert st.num_generated == 2


def apply(step):
    """Apply a ``BeamStep``'s histories and finished beams as ``Scheduler.update_from_output`` does (the forks
    concern the KV manager, which these tests leave out); its forks by sequence id."""
    for s, ids, logprob in step.rewrites:
        s.output_token_ids, s.cumulative_logprob = ids, logprob
    for s, reason in step.finished:
        s.finish(reason)
    return [(p.seq_id, c.seq_id) for p, c in step.forks]


class Words:
    """A tokenizer that spells token t as "wt" and drops the EOS only when asked to skip special tokens."""

    @staticmethod
    def decode(ids, skip_special_tokens=False):
        return " ".join(f"w{t}" for t in ids if not (skip_special_tokens and t == EOS))


def probs_row(p):
    return torch.tensor(p, dtype=torch.float32).log()


@pytest.mark.parametrize("max_tokens, step3, reason", [
    (3, [[0.5, 0.3, 0.15, 0.05], [0.9, 0.05, 0.03, 0.02]], "length"),
    (5, [[0.05, 0.03, 0.02, 0.9], [0.05, 0.03, 0.02, 0.9]], "stop")], ids=["at-max-tokens", "early"])
def test_step_groups_forks_reassigns_and_outputs_by_hand(max_tokens, step3, reason):
    """Two beams (seq ids 7 and 8) over a 4-token vocabulary, EOS = 3, on the engine's glue: ``step_groups`` (rows
    in any order), ``_reassign`` (the forks into a dead beam's sequence) and ``outputs``. Probabilities, worked out by
    hand. Step 1 (both rows [.5, .3, .15, .05]): tokens 0 (.5) and 1 (.3) of beam 7 survive; the second child takes
    over sequence 8 by a fork. Step 2 (rows given as 8 then 7): 7 = [0] x [.2, .12, .08, .6], 8 = [1] x
    [.9, .05, .03, .02]: EOS of 7 (.3) finishes with ln(.3) / 2; the runners are [1, 0] (.27, in sequence 8) and
    [0, 0] (.1, in 7): no fork. Step 3 at max_tokens 3: every candidate stops; [1, 0, 0] (.135, ln / 3 = -0.667)
    joins [0, 3] (-0.602) and [0, 0, 0] (.09, -0.803) misses: the beams finish "length". At max_tokens 5 with EOS
    at .9 in both rows: [1, 0, 3] (.243, -0.472) and [0, 3] stay, the best runner .0135 (-1.435) cannot beat
    -0.602: the search is over early and the beams finish "stop"."""
    sp = SamplingParams(use_beam_search=True, beam_width=2, n=2, temperature=0, max_tokens=max_tokens)
    seqs = [Sequence(7, [11, 12]), Sequence(8, [11, 12])]
    g = SequenceGroup("r", seqs, sp)
    st = init_group(g, frozenset({EOS}), max_model_len=64)
    step = step_groups(torch.stack([probs_row([0.5, 0.3, 0.15, 0.05])] * 2), [(seqs[0], g), (seqs[1], g)])
    assert [s.output_token_ids for s in seqs] == [[], []]  # nothing changes until the scheduler applies it
    assert apply(step) == [(7, 8)] and st.num_forks == 1 and st.beams == seqs
    assert outputs(g, Words()) == [CompletionOutput(0, "w0", [0], pytest.approx(math.log(0.5)), None),
                                   CompletionOutput(1, "w1", [1], pytest.approx(math.log(0.3)), None)]

    step = step_groups(torch.stack([probs_row([0.9, 0.05, 0.03, 0.02]), probs_row([0.2, 0.12, 0.08, 0.6])]),
                       [(seqs[1], g), (seqs[0], g)])
    assert apply(step) == [] and st.num_forks == 1 and st.beams == [seqs[1], seqs[0]]
    assert [(s.output_token_ids, s.cumulative_logprob) for s in st.beams] == \
        [([1, 0], pytest.approx(math.log(0.27))), ([0, 0], pytest.approx(math.log(0.1)))]
    assert not st.done and all(s.status == "waiting" and s.finish_reason is None for s in seqs)

    step = step_groups(torch.stack([probs_row(r) for r in step3]), [(seqs[1], g), (seqs[0], g)])
    assert not step.rewrites and [(s.seq_id, r) for s, r in step.finished] == [(8, reason), (7, reason)]
    assert apply(step) == []
    assert st.done and all(s.finish_reason == reason and s.is_finished() for s in seqs)
    last = ([1, 0, 0], 0.135, "length") if reason == "length" else ([1, 0, EOS], 0.243, "stop")
    want = [([0, EOS], 0.3, "stop"), last] if reason == "length" else [last, ([0, EOS], 0.3, "stop")]
    assert outputs(g, Words()) == [CompletionOutput(i, " ".join(f"w{t}" for t in ids if t != EOS), ids,
                                                    pytest.approx(math.log(p)), r)
                                   for i, (ids, p, r) in enumerate(want)]
    g.sampling_params = SamplingParams(use_beam_search=True, beam_width=2, n=1, temperature=0)
    assert [o.token_ids for o in outputs(g)] == [want[0][0]] and outputs(g)[0].text is None


def test_init_group_takes_the_request_parameters():
    """EOS ids: the model's plus the request's stop tokens, or only the stop tokens with ignore_eos; the search
    length is max_tokens cut to what fits after the prompt in max_model_len (a 12-token prompt in 16: 4; max_tokens 1:
    1)."""
    def state(**kw):
        sp = SamplingParams(use_beam_search=True, beam_width=3, temperature=0, **kw)
        return init_group(SequenceGroup("r", [Sequence(i, list(range(12))) for i in range(3)], sp),
                          frozenset({EOS, 2}), max_model_len=16)

    st = state(max_tokens=10, stop_token_ids=[9], length_penalty=0.5, early_stopping=True)
    assert (st.beam_width, st.max_new_tokens, st.eos_token_ids) == (3, 4, {2, 3, 9})
    assert (st.length_penalty, st.early_stopping, len(st.beams)) == (0.5, True, 3)
    st = state(max_tokens=3, ignore_eos=True, stop_token_ids=[9], early_stopping="never")
    assert (st.max_new_tokens, st.eos_token_ids, st.early_stopping) == (3, {9}, "never")
    assert state(max_tokens=1).max_new_tokens == 1


def test_reassign_forks_each_extra_child_into_the_first_dead_beam():
    """Four beams (ids 0-3); the next beams are three children of beam 2 and one of beam 0. Beam 2's first child
    keeps sequence 2 and beam 0's keeps 0; the other two children of 2 take over the dead beams 1 then 3, in order,
    by two forks. Each new beam holds its parent's tokens plus its own and its cumulative log-prob."""
    seqs = [Sequence(i, [5]) for i in range(4)]
    for s in seqs:
        s.output_token_ids = [s.seq_id]
    st = BeamSearchState(4, 8, frozenset(), 1.0, False, beams=list(seqs))
    step = BeamStep()
    _reassign(st, [(2, 7, -1.0), (2, 8, -2.0), (2, 9, -3.0), (0, 6, -4.0)], step)
    assert apply(step) == [(2, 1), (2, 3)] and st.num_forks == 2
    assert st.beams == [seqs[2], seqs[1], seqs[3], seqs[0]]
    assert [(s.output_token_ids, s.cumulative_logprob) for s in st.beams] == \
        [([2, 7], -1.0), ([2, 8], -2.0), ([2, 9], -3.0), ([0, 6], -4.0)]
