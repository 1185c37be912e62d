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


def test_seeded_draws_follow_the_filtered_distribution():
    """top_k=3, top_p=0.75 at temperature 1 leaves tokens 2 and 0 with probabilities 4/7 and 3/7; 4000 seeded draws
    (one row each, the exponential race of ``sample``) give that frequency within 5 standard errors and nothing
    else. Temperature 0.5 squares the odds: 16/25 and 9/25 before filtering the same set."""
    n = 4000
    for temperature, p_top in ((1.0, 4 / 7), (0.5, 16 / 25)):
        params = SamplingParams(temperature=temperature, top_k=3, top_p=0.75)
        g = torch.Generator().manual_seed(0)
        rows = [SamplingRow(params, g)] * n
        tokens, logprobs = sample(PROBS.log()[None, :].expand(n, -1), rows)
        assert set(tokens) == {2, 0}
        freq = tokens.count(2) / n
        assert abs(freq - p_top) < 5 * math.sqrt(p_top * (1 - p_top) / n)
        # the log-probabilities are those of the raw distribution, not of the filtered one
        assert logprobs[tokens.index(0)] == pytest.approx(math.log(0.3), abs=1e-6)
