"""The differential matrix: paging changes nothing but memory (paper §4). Every combination of

- model: a Llama with GQA, and an OPT with post-LayerNorm and ``word_embed_proj_dim != hidden_size`` (as OPT-350m),
  random weights (initializer range 0.2), float32 on the CPU;
- block size: 1, 8, 16, 128 (§4.2, Fig. 18b);
- preemption (§4.5): none (a roomy pool), recompute, swap; the pressure pools are sized so that preemption must
  happen, and the test asserts that it did;
- prefix sharing: off, automatic prefix caching, a user-marked shared prefix (``prefix_len``, §4.4 / Fig. 16);
- request: greedy ``n=1``, greedy ``n=3`` (three forks of one prompt, copy-on-write, §4.4), beam search of width 2

gives token-for-token the outputs of Hugging Face ``generate`` (greedy, or ``num_beams=2`` with both beams
returned), with the engine's invariants checked after every step (``LLMEngine.check_invariants``) and every block
back in its pool at the end. No combination is refused: the refusals (docs/ENGINE.md, "Supported combinations") are about
inputs, not about these flags, and are tested at the bottom.

Four prompts share a 130-token prefix (more than one block of 128) and end between 246 and 252 tokens, so that the
12 new tokens of every request cross a block boundary at every block size (the growth is what preempts).
"""
from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from pagedattn import kernels
from pagedattn.beam_search import worst_case_blocks
from pagedattn.config import blocks_needed
from pagedattn.engine import LLMEngine
from pagedattn.llm import LLM
from pagedattn.model import load_model
from pagedattn.sequence import SamplingParams
from factories import llm_engine
from tiny_models import tiny_llama, tiny_opt

MAX_NEW = 12
PREFIX = 130
g = torch.Generator().manual_seed(7)
_prefix = torch.randint(3, 256, (PREFIX,), generator=g).tolist()
PROMPTS = [_prefix + torch.randint(3, 256, (n - PREFIX,), generator=g).tolist() for n in (250, 248, 252, 246)]

REQUESTS = {
    "greedy": SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
    "greedy_n3": SamplingParams(n=3, temperature=0, max_tokens=MAX_NEW, ignore_eos=True),
    "beam2": SamplingParams(use_beam_search=True, beam_width=2, n=2, temperature=0, max_tokens=MAX_NEW,
                            ignore_eos=True),
}
BLOCK_SIZES = [1, 8, 16, 128]
PREEMPTION = ["none", "recompute", "swap"]
PREFIX_MODES = ["off", "auto", "user"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny_hf(name: str):
    if name == "llama":  # GQA: 4 query heads share 2 KV heads
        return tiny_llama(max_position_embeddings=320)
    return tiny_opt(max_position_embeddings=320, do_layer_norm_before=False, word_embed_proj_dim=32)


_CACHE: dict[str, tuple] = {}


def reference(name: str):
    """(our model, {request kind: per-prompt list of HF outputs}) computed once per session and shared by cells."""
    if name not in _CACHE:
        hf = tiny_hf(name)
        greedy, beams = [], []
        for p in PROMPTS:
            ids = torch.tensor([p])
            out = hf.generate(ids, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False,
                              eos_token_id=None, pad_token_id=0)
            greedy.append([out[0, len(p):].tolist()])
            out = hf.generate(ids, max_new_tokens=MAX_NEW, num_beams=2, num_return_sequences=2, do_sample=False,
                              length_penalty=1.0, early_stopping=False, eos_token_id=None, pad_token_id=0)
            beams.append([row[len(p):] for row in out.tolist()])
        refs = {"greedy": greedy, "greedy_n3": [r * 3 for r in greedy], "beam2": beams}
        _CACHE[name] = load_model(hf), refs
    return _CACHE[name]


def make_engine(model, block_size: int, prefix: str, params: SamplingParams, prompts, **pool) -> LLMEngine:
    engine = llm_engine(model, block_size=block_size, enable_prefix_caching=prefix == "auto", **pool)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params, prefix_len=PREFIX if prefix == "user" else 0)
    return engine


def pool_sizes(model, block_size: int, preemption: str, prefix: str, params: SamplingParams) -> dict:
    """A roomy pool (every request at its worst case at once), or a tight one: one block less than the first two
    requests use together at their peak (measured in a roomy run of just those two), so that they are admitted
    together and then cannot both grow; never below what one request may need alone (the engine's bound)."""
    worst = [worst_case_blocks(len(p), MAX_NEW, params.num_seqs, block_size) for p in PROMPTS]
    roomy = sum(worst) + 4
    if preemption == "none":
        return dict(num_gpu_blocks=roomy)
    pair = make_engine(model, block_size, prefix, params, PROMPTS[:2], num_gpu_blocks=roomy)
    while pair.has_unfinished_requests():
        pair.step()
    tight = max(m.blocks_used for m in pair.step_metrics) - 1
    assert tight - int(0.01 * tight) >= max(worst)  # one request always fits, above the admission watermark
    return dict(num_gpu_blocks=tight, num_cpu_blocks=4 * tight, preemption_mode=preemption)


def run_cell(model, block_size: int, preemption: str, prefix: str, params: SamplingParams) -> LLMEngine:
    engine = make_engine(model, block_size, prefix, params, PROMPTS,
                         **pool_sizes(model, block_size, preemption, prefix, params))
    engine.check_invariants()
    outputs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.error is None, o.error
            if o.finished:
                outputs[o.request_id] = [c.token_ids for c in o.outputs]
        engine.check_invariants()
    engine.outputs = [outputs[str(i)] for i in range(len(PROMPTS))]
    return engine


def assert_all_blocks_back(engine: LLMEngine) -> None:
    kv = engine.kv
    engine.check_invariants()
    c = kv.pool_counts()
    assert not kv.seq_ids() and c.cpu_free == c.cpu_blocks
    assert c.gpu_free == c.gpu_blocks - len(kv.block_view().pinned)  # a user-marked prefix stays pinned
    assert not engine.requests and not engine.has_unfinished_requests()


@pytest.mark.parametrize("request_kind", list(REQUESTS))
@pytest.mark.parametrize("prefix", PREFIX_MODES)
@pytest.mark.parametrize("preemption", PREEMPTION)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("name", ["llama", "opt"])
def test_cell_matches_hf(name, block_size, preemption, prefix, request_kind):
    model, refs = reference(name)
    params = REQUESTS[request_kind]
    engine = run_cell(model, block_size, preemption, prefix, params)
    assert engine.outputs == refs[request_kind]
    done = engine.scheduler.num_preemptions
    if preemption == "none":
        assert sum(done.values()) == 0
    else:  # the cell must not pass vacuously: preemption happened (groups of several sequences always swap)
        assert done["swap" if preemption == "swap" or params.num_seqs > 1 else "recompute"] > 0, done
    kv = engine.kv
    if prefix == "auto":
        assert kv.pool_counts().prefix_hits > 0  # the shared prefix was found in the cache
    if prefix == "user":
        assert len(kv.block_view().pinned) == PREFIX // block_size
    assert_all_blocks_back(engine)


# ----------------------------------------------------------------------- refused up front (docs/ENGINE.md)
def test_bad_inputs_are_refused_and_isolated():
    """Issue 12 items 3, 5, 6: NaN / infinite sampling floats, more sequences than ``max_num_seqs``, and prompts
    that are not a string or integer token ids are ValueErrors naming the limit; in ``LLM.generate`` each one fails
    alone, the other requests keep their outputs, and nothing is left in the engine."""
    model, refs = reference("llama")
    llm = LLM(model, block_size=16, max_num_seqs=4)
    greedy = REQUESTS["greedy"]
    nan = float("nan")
    for kw, words in [(dict(temperature=nan), "temperature"), (dict(top_p=float("inf")), "top_p"),
                      (dict(length_penalty=-float("inf")), "length_penalty"), (dict(temperature="0"), "temperature"),
                      (dict(top_p=nan), "top_p"), (dict(n=2.0), "n must be an integer")]:
        with pytest.raises(ValueError, match=words):
            SamplingParams(**kw)
    bad = [  # (prompt, params, words the error names)
        (PROMPTS[1], SamplingParams(n=5, temperature=0, max_tokens=2), "max_num_seqs=4"),
        (PROMPTS[1], SamplingParams(best_of=5, temperature=0, max_tokens=2), "max_num_seqs=4"),
        (PROMPTS[1], SamplingParams(use_beam_search=True, beam_width=5, temperature=0, max_tokens=2),
         "max_num_seqs=4"),
        (None, greedy, "string or a sequence of integer token ids"),
        ([[5, 6]], greedy, "string or a sequence of integer token ids"),
        ([1.5, 7.9], greedy, "1.5 \\(float\\) is not an integer"),
        ([5, True], greedy, "is not an integer"),
        (123, greedy, "got int"),
        ({"a": 1}, greedy, "got dict"),
        (PROMPTS[1], {"temperature": nan}, "temperature must be a finite number"),
        (PROMPTS[1], {"temprature": 0}, "unexpected keyword"),
    ]
    prompts = [PROMPTS[0]] + [p for p, _, _ in bad] + [np.array(PROMPTS[2]), torch.tensor(PROMPTS[3])]
    params = [greedy] + [sp for _, sp, _ in bad] + [greedy, greedy]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in (outs[0], outs[-2], outs[-1])] == [refs["greedy"][i][0] for i in (0, 2, 3)]
    assert outs[-1].prompt_token_ids == PROMPTS[3]
    for o, (_, _, words) in zip(outs[1:-2], bad):
        assert o.finished and o.outputs[0].finish_reason == "error" and o.outputs[0].token_ids == []
        assert o.error is not None and re.search(words, o.error), (words, o.error)
    engine = llm.engine
    for p, sp, words in bad:
        if isinstance(sp, SamplingParams):  # the same errors from add_request
            with pytest.raises(ValueError, match=words):
                engine.add_request("x", p, sp)
    for top in (123, None, 1.5):  # not a prompt, nor a list of prompts
        with pytest.raises(ValueError, match="prompts must be a string"):
            llm.generate(top, greedy, use_tqdm=False)
    engine.check_invariants()
    assert not engine.requests and engine.kv.num_free_gpu_blocks == engine.kv.num_gpu_blocks


def test_triton_block_size_must_be_a_power_of_two():
    model, _ = reference("llama")
    if "triton" not in kernels.available_backends():
        pytest.skip("triton is not installed")
    with pytest.raises(ValueError, match="block_size=12"):
        llm_engine(model, block_size=12, num_gpu_blocks=8, attention_backend="triton")
    llm_engine(model, block_size=12, num_gpu_blocks=8, attention_backend="torch")


def test_blocks_needed_matches_the_prompt_design():
    """Every request's 12 new tokens cross a block boundary at every block size (so growth can preempt)."""
    for bs in BLOCK_SIZES:
        for p in PROMPTS:
            assert blocks_needed(len(p) + MAX_NEW - 1, bs) > blocks_needed(len(p), bs)
