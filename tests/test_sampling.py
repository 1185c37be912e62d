"""Sampling (``sampling.py``) against hand-computed expectations on a known distribution: top-k filters first, then
top-p on the renormalised survivors (vLLM's order), and seeded draws follow the filtered distribution."""
import math

import pytest
import torch

from pagedattn.sampling import SamplingRow, _filter_top_k_top_p, sample
from pagedattn.sequence import SamplingParams

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
