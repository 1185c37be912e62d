"""Sampling (``sampling.py``) against hand-computed expectations on a known distribution: top-k filters first, then
top-p on the renormalised survivors (vLLM's order), and seeded draws follow the filtered distribution."""
import math

import pytest
import torch

from pagedattn.sampling import SamplingRow, _filter_top_k_top_p, check_stop, make_generator, sample
from pagedattn.sequence import SamplingParams, Sequence

# p = 0.4 / 0.3 / 0.2 / 0.1 on tokens 2 / 0 / 3 / 1: the vocabulary order is not the probability order
PROBS = torch.tensor([0.3, 0.1, 0.4, 0.2])


def kept(top_k: int, top_p: float) -> set[int]:
    out = _filter_top_k_top_p(PROBS.log()[None, :], torch.tensor([top_k]), torch.tensor([top_p]))
    return {i for i, x in enumerate(out[0].tolist()) if math.isfinite(x)}


@pytest.mark.parametrize("top_k,top_p,expected", [
    # top-k = 2 keeps {2: 0.4, 0: 0.3}, renormalised 0.571 / 0.429. Mass before token 0 is 0.571 > 0.5: dropped.
    # (top-p over the unfiltered distribution would see 0.4 <= 0.5 before token 0 and keep it.)
    (2, 0.5, {2}),
    # top-k = 3 keeps 0.4 / 0.3 / 0.2, renormalised 0.444 / 0.333 / 0.222: mass before token 3 is 0.778 > 0.75.
    # (unfiltered: 0.7 <= 0.75 before token 3, kept.)
    (3, 0.75, {2, 0}),
    (3, 1.0, {2, 0, 3}),  # top-p disabled: top-k alone
    (-1, 0.65, {2, 0}),  # top-k disabled: mass before token 3 is 0.7 > 0.65
    (-1, 0.35, {2}),  # the most likely token is always kept, even when it alone exceeds top_p
])
def test_top_k_then_top_p_keeps_the_hand_computed_set(top_k, top_p, expected):
    assert kept(top_k, top_p) == expected


def test_nucleus_boundary_on_a_uniform_distribution():
    """Four equal logits: probabilities of exactly 0.25, so the mass before the sorted tokens is exactly 0, 0.25,
    0.5, 0.75. The nucleus is the fewest tokens whose mass reaches top_p: 2 for 0.5, 3 for 0.75, 1 for 0.25; and
    top_p = 1 leaves top-k alone (no rounding can drop a tail token)."""
    uniform = torch.zeros(1, 4)
    for top_k, top_p, count in ((-1, 0.5, 2), (-1, 0.75, 3), (-1, 0.25, 1), (3, 1.0, 3), (-1, 0.9999, 4)):
        out = _filter_top_k_top_p(uniform, torch.tensor([top_k]), torch.tensor([top_p]))
        assert int(torch.isfinite(out).sum()) == count, (top_k, top_p)


def test_top_p_1_keeps_a_tail_token_whose_preceding_mass_rounds_to_1():
    """Probabilities 0.5 / 0.5 / 7e-12: in float32 the mass before the third token is exactly 1.0; top-p = 1 is off
    and must keep it all the same."""
    out = _filter_top_k_top_p(torch.tensor([[0.0, 0.0, -25.0]]), torch.tensor([-1]), torch.tensor([1.0]))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("temperature,top_k,top_p,expected", [
    (1.0, 3, 1.0, {2: 4 / 9, 0: 3 / 9, 3: 2 / 9}),  # top-k alone: 0.4 / 0.3 / 0.2 renormalised
    (0.5, 3, 1.0, {2: 16 / 29, 0: 9 / 29, 3: 4 / 29}),  # temperature 1/2 squares them first: 0.16 / 0.09 / 0.04
    (1.0, 3, 0.75, {2: 4 / 7, 0: 3 / 7}),  # then top-p 0.75: 0.444 + 0.333 >= 0.75, token 3 dropped
])
def test_seeded_draws_follow_the_filtered_distribution(temperature, top_k, top_p, expected):
    """20000 seeded draws (one row each, through ``sample``'s exponential race) hit each kept token with its
    hand-computed probability, within 5 standard errors, and no other token. (Three tokens, because with two the
    race's ``argmax(p / q)`` and the wrong ``argmax(p * q)`` happen to give the same law.)"""
    n = 20000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    g = torch.Generator().manual_seed(0)
    tokens, logprobs = sample(PROBS.log()[None, :].expand(n, -1), [SamplingRow(params, g)] * n)
    assert set(tokens) == set(expected)
    for tok, p in expected.items():
        assert abs(tokens.count(tok) / n - p) < 5 * math.sqrt(p * (1 - p) / n), tok
    # the log-probabilities are those of the raw distribution, not of the tempered or filtered one
    assert logprobs[tokens.index(0)] == pytest.approx(math.log(0.3), abs=1e-6)


def test_top_k_1_or_a_small_top_p_alone_always_draws_the_most_likely_token():
    """At temperature 1, top-k = 1 keeps only token 2 (p = 0.4); so does top-p = 0.35 with top-k off (0.4 alone
    reaches it). 200 seeded draws each: without the filter another token would come up with probability
    1 - 0.4**200."""
    g = torch.Generator().manual_seed(0)
    for top_k, top_p in ((1, 1.0), (-1, 0.35)):
        params = SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p)
        tokens, _ = sample(PROBS.log()[None, :].expand(200, -1), [SamplingRow(params, g)] * 200)
        assert set(tokens) == {2}, (top_k, top_p)


def test_greedy_rows_next_to_sampled_rows_take_their_own_argmax():
    """Rows 0 and 1 greedy (argmax 2 and 1), row 2 sampled with top-k = 1 (argmax 3): each row's own argmax."""
    logits = torch.tensor([[0.3, 0.1, 0.4, 0.2], [0.1, 0.7, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4]]).log()
    rows = [SamplingRow(SamplingParams(temperature=0)), SamplingRow(SamplingParams(temperature=0)),
            SamplingRow(SamplingParams(temperature=1.0, top_k=1), torch.Generator().manual_seed(0))]
    tokens, logprobs = sample(logits, rows)
    assert tokens == [2, 1, 3]
    assert logprobs == pytest.approx([math.log(0.4), math.log(0.7), math.log(0.4)], abs=1e-6)



def test_greedy_on_bf16_logits_equals_greedy_on_their_fp32_copy():
    """bf16 logits (a bf16 model's) sample greedily as their fp32 copy does: the same tokens (ties, frequent in
    bf16, to the first maximum) and log-probabilities, also for a row that ``min_tokens`` keeps from its EOS."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 300, generator=gen) * 4).to(torch.bfloat16)
    logits[1, 10] = logits[1, 20] = logits[1].max() + 1  # a tie
    eos = int(logits[2].float().argmax())
    seq = Sequence(0, [1, 2, 3])
    for rows in ([SamplingRow(SamplingParams(temperature=0)) for _ in range(6)],
                 [SamplingRow(SamplingParams(temperature=0, min_tokens=2), seq=seq) for _ in range(6)]):
        got, want = sample(logits, rows, eos_token_ids=frozenset({eos})), sample(
            logits.float(), rows, eos_token_ids=frozenset({eos}))
        assert got == want and got[0][1] == 10
    assert got[0][2] != eos  # min_tokens applied on the second pass
def test_make_generator_is_a_seeded_cpu_generator():
    assert make_generator(None) is None
    g = make_generator(7)
    assert g.device.type == "cpu"
    assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=torch.Generator().manual_seed(7)))


def test_check_stop_reasons_and_limits():
    """EOS stops unless ignore_eos; a stop token always stops; then the length limits, inclusive: max_tokens
    generated tokens, or max_model_len tokens in all."""
    def seq(*out):
        s = Sequence(0, [1, 2])
        for t in out:
            s.append_token(t)
        return s

    eos = frozenset({9})
    p = SamplingParams(max_tokens=3, stop_token_ids=[5])
    assert check_stop(seq(4, 9), p, eos, 100) == "stop"
    assert check_stop(seq(4, 9), SamplingParams(max_tokens=3, ignore_eos=True), eos, 100) is None
    assert check_stop(seq(4, 5), SamplingParams(max_tokens=3, ignore_eos=True, stop_token_ids=[5]), eos, 100) == "stop"
    assert check_stop(seq(4, 6), p, eos, 100) is None
    assert check_stop(seq(4, 6, 7), p, eos, 100) == "length"  # 3 generated = max_tokens
    assert check_stop(seq(4, 6), p, eos, 4) == "length"  # 4 tokens = max_model_len
    assert check_stop(seq(4, 6), p, eos, 5) is None
