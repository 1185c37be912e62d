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

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from pagedattn.beam_search import BeamSearchState, worst_case_blocks
from pagedattn.engine import LLM
from pagedattn.memory import BlockManager
from pagedattn.memory.contiguous import ContiguousKVManager
from pagedattn.sequence import SamplingParams

MAX_NEW = 10
PAD = 0
# (length_penalty, early_stopping, eos on)
CASES = [(1.0, False, True), (0.6, True, True), (1.5, "never", True), (-0.5, "never", True), (1.0, False, False)]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The tiny models run several times faster on one thread on a shared 2-core VM."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(name: str):
    torch.manual_seed(0)
    if name == "llama":  # GQA: 4 query heads share 2 KV heads; token 223 is a frequent beam token
        m = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                         initializer_range=0.2, eos_token_id=223, bos_token_id=1, pad_token_id=PAD))
    else:
        m = OPTForCausalLM(OPTConfig(vocab_size=256, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=128, init_std=0.2,
                                     word_embed_proj_dim=64, eos_token_id=252, bos_token_id=1, pad_token_id=PAD))
    return m.eval()


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
    if isinstance(kv, BlockManager):
        assert kv.num_free_gpu_blocks == kv.num_gpu_blocks and kv.cpu.num_free == kv.cpu.num_blocks
        assert all(c == 0 for c in kv.gpu.ref_counts) and not kv.tables
    else:
        assert kv.arena.num_free == kv.arena.total and not kv.tables
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
        if kv.tables:
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
    assert llm.engine.scheduler.num_preemptions["swap"] > 0 and llm.engine.kv.prefix_hits > 0
    assert_pool_full(llm)


def test_beam_search_on_orca_contiguous_manager():
    """Orca has no block tables: a fork copies the parent's whole K/V into the child's reservation (as HF's
    ``_reorder_cache``); the beams are the same."""
    hf = model("llama")
    sp = beam_params(2, 1.0, False, True, 2)
    ref = [[c.token_ids for c in o.outputs] for o in LLM(hf, block_size=4).generate(PROMPTS, sp, use_tqdm=False)]
    llm = LLM(hf, kv_manager=ContiguousKVManager(1024, "oracle", max_model_len=128), max_num_seqs=16)
    assert [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, sp, use_tqdm=False)] == ref
    assert_pool_full(llm)


def test_state_first_step_expands_only_the_first_beam():
    st = BeamSearchState(3, 5, frozenset({0}), 1.0, False, beams=[])
    st.beams = [type("S", (), {"output_token_ids": []})() for _ in range(3)]
    lp = torch.log_softmax(torch.randn(1, 50).repeat(3, 1), dim=-1)
    nxt = st.select(lp)
    assert [p for p, _, _ in nxt] == [0, 0, 0] and len({t for _, t, _ in nxt}) == 3
