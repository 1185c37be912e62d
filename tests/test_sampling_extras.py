"""vLLM's sampling extras in the engine's sampler (``sampling.py``), reached through ``LLM.generate``: against Hugging
Face ``generate`` where it has the same knob (``repetition_penalty``, ``min_new_tokens``, ``min_p``, ``top_k=0``),
and against hand-computed values where it has none (presence / frequency penalties, top log-probabilities, stop
strings)."""
import math

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper
from tiny_models import tiny_llama, tiny_opt

from pagedattn.llm import LLM
from pagedattn.repro.experiments.zoo import train_tokenizer
from pagedattn.sampling import SamplingRow, _filter_min_p, apply_penalties, top_logprobs
from pagedattn.sequence import SamplingParams, Sequence

PROMPTS = [[5, 9, 17, 33, 2, 70], [100, 101, 7], list(range(40, 60))]


def hf_greedy(hf, prompt: list[int], max_new: int, **kw) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["opt", "llama"])
def hf(request, one_thread):
    return tiny_opt() if request.param == "opt" else tiny_llama()


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_hugging_face(hf, penalty):
    want = [hf_greedy(hf, p, 12, repetition_penalty=penalty, min_new_tokens=12, eos_token_id=None) for p in PROMPTS]
    got = LLM(hf).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                   repetition_penalty=penalty), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    plain = LLM(hf).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in plain] != want  # the penalty changed something: the test can fail


def test_min_tokens_matches_hugging_face_min_new_tokens(hf):
    """The EOS is the token greedy decoding picks second, so without ``min_tokens`` the output stops at 2 tokens."""
    prompt = PROMPTS[0]
    eos = hf_greedy(hf, prompt, 2, eos_token_id=None, min_new_tokens=2)[1]
    want = hf_greedy(hf, prompt, 10, eos_token_id=eos, min_new_tokens=6)
    llm = LLM(hf)
    llm.engine.eos_token_ids = frozenset({eos})
    (short,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    assert len(short.outputs[0].token_ids) == 2 and short.outputs[0].finish_reason == "stop"
    (got,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, min_tokens=6), use_tqdm=False)
    assert got.outputs[0].token_ids == want[:len(got.outputs[0].token_ids)]
    assert len(got.outputs[0].token_ids) >= 6 and eos not in got.outputs[0].token_ids[:6]
    # a stop token id is held back the same way
    (held,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, min_tokens=4, ignore_eos=True,
                                                    stop_token_ids=[eos]), use_tqdm=False)
    assert eos not in held.outputs[0].token_ids[:4]


def test_min_p_keeps_what_hugging_faces_warper_keeps():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    for min_p in (0.05, 0.2, 0.6):
        hf = MinPLogitsWarper(min_p)(torch.zeros(6, 1, dtype=torch.long), logits.clone())
        ours = _filter_min_p(logits.softmax(-1), torch.full((6,), min_p))
        assert torch.equal(torch.isfinite(hf), ours > 0)


def test_min_p_and_top_k_0_draws(one_thread):
    """min_p=1 keeps only the most likely token: a sampled request then equals greedy. top_k=0 means off, as -1."""
    hf = tiny_opt()
    llm = LLM(hf)
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    sampled = llm.generate(PROMPTS, SamplingParams(temperature=1.0, min_p=1.0, seed=3, max_tokens=8,
                                                   ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sampled] == [o.outputs[0].token_ids for o in greedy]
    assert SamplingParams(top_k=0).top_k == -1
    a = llm.generate(PROMPTS, SamplingParams(top_k=0, seed=5, max_tokens=8, ignore_eos=True), use_tqdm=False)
    b = llm.generate(PROMPTS, SamplingParams(top_k=-1, seed=5, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_presence_and_frequency_penalties_by_hand():
    seq = Sequence(0, [1, 2])
    for t in (3, 3, 4):
        seq.append_token(t)
    logits = torch.zeros(1, 6)
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    logits[0] = torch.tensor([1.0, 1.0, -1.0, 2.0, 0.5, 1.0])
    out = apply_penalties(logits, [SamplingRow(p, None, seq)])[0].tolist()
    # repetition over prompt + output {1, 2, 3, 4}: 1.0 / 2, -1.0 * 2, 2.0 / 2, 0.5 / 2; then token 3 (twice in the
    # output): - 0.25 * 2 - 0.5; token 4 (once): - 0.25 - 0.5; tokens 0 and 5 untouched
    assert out == pytest.approx([1.0, 0.5, -2.0, 1.0 - 1.0, 0.25 - 0.75, 1.0])
    assert apply_penalties(logits, [SamplingRow(SamplingParams(), None, seq)]) is logits


def test_logprobs_are_the_top_k_of_the_raw_distribution(one_thread):
    hf = tiny_opt()
    (out,) = LLM(hf).generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=4),
                              use_tqdm=False)
    c = out.outputs[0]
    assert len(c.logprobs) == 3
    ids = list(PROMPTS[1])
    for tok, d in zip(c.token_ids, c.logprobs):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
        top = ref.topk(4)
        assert set(d) == set(top.indices.tolist()) | {tok} and tok == int(top.indices[0])  # greedy: the top one
        for t, v in d.items():
            assert v == pytest.approx(float(ref[t]), abs=1e-4)
        ids.append(tok)
    assert c.cumulative_logprob == pytest.approx(sum(d[t] for t, d in zip(c.token_ids, c.logprobs)), abs=1e-4)
    # the chosen token is always there, even when it is outside the top-k
    d = top_logprobs(torch.tensor([[0.0, 1.0, 2.0]]), [0], [1])[0]
    assert set(d) == {0, 2} and d[0] == pytest.approx(math.log(1 / (1 + math.e + math.e ** 2)))


def test_stop_strings_cut_the_text(one_thread):
    tok = train_tokenizer(["the cat sat on the mat. the dog ate the cat food.\n"] * 30, vocab_size=300)
    hf = tiny_opt(vocab_size=len(tok))
    llm = LLM(hf, tokenizer=tok)
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    (full,) = llm.generate(["the cat"], base, use_tqdm=False)
    text = full.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]  # three characters that the output holds
    for include in (False, True):
        p = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop, "never there"],
                           include_stop_str_in_output=include)
        (out,) = llm.generate(["the cat"], p, use_tqdm=False)
        c = out.outputs[0]
        cut = text.find(stop) + (len(stop) if include else 0)
        assert c.text == text[:cut] and c.finish_reason == "stop" and c.stop_reason == stop
        assert c.token_ids == full.outputs[0].token_ids[:len(c.token_ids)] and len(c.token_ids) < 24
    (refused,) = LLM(hf).generate([[1, 2]], SamplingParams(stop=["x"]), use_tqdm=False)
    assert "stop strings need a tokenizer" in refused.error


@pytest.mark.parametrize("kw, match", [
    ({"min_p": 1.5}, "min_p"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ({"logprobs": 21}, "logprobs"), ({"stop": [""]}, "stop"),
    ({"stop": [3]}, "stop"), ({"seed": 2 ** 64}, "seed"), ({"include_stop_str_in_output": 1}, "include_stop"),
    ({"use_beam_search": True, "n": 2, "temperature": 0, "logprobs": 1}, "beam search"),
])
def test_bad_extras_name_the_parameter(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)
