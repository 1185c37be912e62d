"""The engine end to end on random-weight transformers models (float32, CPU): greedy outputs token-identical to
``generate(do_sample=False)`` for a batch of mixed-length prompts, also with a block pool so small that preemption
happens (recompute and swap, §4.5); Orca's contiguous manager on the same engine; parallel sampling with
copy-on-write (§4.4); seeded sampling; stop conditions; per-request errors; abort. After every test every block is
back in its pool and the block manager's invariants hold.
"""
from __future__ import annotations

import pytest
import torch

from pagedattn.engine import EngineArgs, LLMEngine
from pagedattn.llm import LLM
from pagedattn.sequence import SamplingParams

from factories import contiguous_manager, llm_engine
import tiny_models

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def tiny_llama():  # GQA: 4 query heads share 2 KV heads
    return tiny_models.tiny_llama(max_position_embeddings=128)


def tiny_opt():
    return tiny_models.tiny_opt(max_position_embeddings=128)


def make_prompts(n: int = 16, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 40, (n,), generator=g).tolist()
    return [torch.randint(3, 256, (k,), generator=g).tolist() for k in lens]


PROMPTS = make_prompts()


def hf_greedy(hf, prompt: list[int], max_new: int = MAX_NEW) -> list[int]:
    """Unbatched HF greedy decoding of exactly ``max_new`` tokens (EOS disabled)."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


_REFS: dict[str, tuple] = {}


def reference(name: str):
    """A tiny model and its HF greedy outputs for PROMPTS, computed once per test session."""
    if name not in _REFS:
        hf = tiny_llama() if name == "llama" else tiny_opt()
        _REFS[name] = hf, [hf_greedy(hf, p) for p in PROMPTS]
    return _REFS[name]


@pytest.fixture(scope="module", params=["llama", "opt"])
def model_and_ref(request):
    return reference(request.param)


@pytest.fixture(scope="module")
def llama_and_ref():
    return reference("llama")


def assert_all_blocks_free(engine: LLMEngine) -> None:
    kv = engine.kv
    kv.check_invariants()
    c = kv.pool_counts()  # a contiguous manager's arena: its slots, and no CPU pool
    assert c.gpu_free == c.gpu_blocks and c.cpu_free == c.cpu_blocks and not kv.seq_ids()
    assert not engine.requests and not engine.has_unfinished_requests()


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


# ------------------------------------------------------------------------------------------ greedy vs HF
@pytest.mark.parametrize("setup", [
    dict(),  # default pool: no preemption, block size 16
    dict(block_size=4, num_gpu_blocks=14, preemption_mode="recompute"),
    dict(block_size=4, num_gpu_blocks=14, preemption_mode="swap", num_cpu_blocks=64),
], ids=["roomy", "recompute", "swap"])
def test_greedy_matches_hf(model_and_ref, setup):
    hf, ref = model_and_ref
    llm = LLM(hf, **setup)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert tokens(outs) == ref
    assert all(o.finished and o.outputs[0].finish_reason == "length" and o.error is None for o in outs)
    e = llm.engine
    mode = setup.get("preemption_mode")
    if mode:  # the pool (56 slots) holds one request but not the batch: preemption must have happened
        assert e.scheduler.num_preemptions[mode] > 0
        assert max(m.batch_size for m in e.step_metrics) > 1  # and requests were batched
    else:
        assert sum(e.scheduler.num_preemptions.values()) == 0
        assert e.step_metrics[0].kind == "prefill" and e.step_metrics[0].batch_size == len(PROMPTS)
    if mode == "swap":
        assert any(m.num_blocks_swapped for m in e.step_metrics)
    assert_all_blocks_free(e)


@pytest.mark.parametrize("setup", [dict(), dict(block_size=4, num_gpu_blocks=14, preemption_mode="recompute")],
                         ids=["roomy", "recompute"])
def test_batched_prefill_matches_hf(model_and_ref, setup, monkeypatch):
    """The GPU's prefill (one SDPA call per step for all sequences, ``attention.BATCHED_PREFILL``) forced on the
    CPU gives HF's greedy tokens, also when preemption recomputes prompts."""
    from pagedattn.model import attention

    monkeypatch.setattr(attention, "BATCHED_PREFILL", True)
    hf, ref = model_and_ref
    llm = LLM(hf, **setup)
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == ref
    assert_all_blocks_free(llm.engine)


def test_gpu_layer_path_in_the_interpreter_matches_hf(llama_and_ref, triton, monkeypatch):
    """What a GPU runs, on the CPU: the batched prefill, the Triton attention, the fused Triton RMSNorm (with the
    residual add), and RoPE fused with the KV-cache write (``fused_layer.rope_and_cache``, the only cache write of a
    Llama layer there), all in Triton's interpreter, give HF's greedy tokens in fp32 (a short run: the interpreter
    is slow)."""
    from pagedattn.kernels import cpu, fused_layer
    from pagedattn.kernels import paged_attention as pa
    from pagedattn.model import attention, fused_ops

    monkeypatch.setattr(attention, "BATCHED_PREFILL", True)
    monkeypatch.setattr(fused_ops, "on_gpu", lambda x: True)
    monkeypatch.setattr(cpu, "takes", lambda *xs, **kw: False)
    calls = []
    for mod, name in ((fused_ops, "rms_norm_launch"), (fused_ops, "rope_launch"), (fused_layer, "rope_and_cache"),
                      (pa, "reshape_and_cache")):
        fn = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _fn=fn, _n=name, **k: calls.append(_n) or _fn(*a, **k))
    hf, ref = llama_and_ref
    llm = LLM(hf, block_size=4, attention_backend="triton")
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert tokens(llm.generate(PROMPTS[:3], sp, use_tqdm=False)) == [r[:3] for r in ref[:3]]
    assert {"rms_norm_launch", "rope_and_cache"} <= set(calls)
    assert not {"rope_launch", "reshape_and_cache"} & set(calls)  # RoPE and the cache write: one launch, once
    assert_all_blocks_free(llm.engine)


def test_orca_contiguous_manager_on_the_same_engine(llama_and_ref):
    hf, ref = llama_and_ref
    kv = contiguous_manager(512, "oracle", max_model_len=128)
    llm = LLM(hf, kv_manager=kv, max_num_seqs=8)
    assert llm.engine.runner.block_size == 1 and llm.engine.runner.num_blocks == 512
    assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == ref
    assert_all_blocks_free(llm.engine)


def test_step_by_step_engine_and_metrics(llama_and_ref):
    hf, ref = llama_and_ref
    engine = llm_engine(hf, max_num_seqs=4, max_num_batched_tokens=64)
    for i, p in enumerate(PROMPTS[:6]):
        engine.add_request(f"r{i}", p, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert len(o.outputs[0].token_ids) <= MAX_NEW
            if o.finished:
                done[o.request_id] = o
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(6)] == ref[:6]
    m = engine.step_metrics
    assert max(x.batch_size for x in m) <= 4
    assert all(x.num_batched_tokens <= 64 or x.batch_size == 1 for x in m if x.kind == "prefill")
    assert all(0 < x.forward_time <= x.step_time for x in m)
    assert all(x.slots_filled > 0 and x.blocks_used > 0 for x in m)
    for o in done.values():
        t = o.metrics
        assert t.arrival_time <= t.first_token_time <= t.finish_time
        assert o.normalized_latency == pytest.approx(t.latency / MAX_NEW)
    assert len(engine.step_metrics_frame()) == len(m)
    assert_all_blocks_free(engine)


def test_step_finished_only_builds_only_finished_outputs(llama_and_ref):
    hf, ref = llama_and_ref
    engine = llm_engine(hf, max_num_seqs=4)
    for i, p in enumerate(PROMPTS[:3]):
        engine.add_request(f"r{i}", p, GREEDY)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step(finished_only=True):
            assert o.finished and o.request_id not in done
            done[o.request_id] = o.outputs[0].token_ids
    assert [done[f"r{i}"] for i in range(3)] == ref[:3]


def test_load_by_path_gives_same_tokens(tmp_path, llama_and_ref):
    hf, ref = llama_and_ref
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32")
    assert tokens(llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)) == ref[:4]
    # our loaded model object, through EngineArgs
    engine = LLMEngine.from_engine_args(llm.engine.model, EngineArgs(block_size=8, num_gpu_blocks=64))
    assert engine.model is llm.engine.model and engine.kv.num_gpu_blocks == 64
    engine.add_request("a", PROMPTS[5], GREEDY)
    while engine.has_unfinished_requests():
        out = engine.step()
    assert out[0].outputs[0].token_ids == ref[5]
    assert_all_blocks_free(engine)
    assert_all_blocks_free(llm.engine)


# --------------------------------------------------------------------------------------- stop conditions
def test_stop_token_eos_and_max_model_len(llama_and_ref):
    hf, ref = llama_and_ref
    llm = LLM(hf, max_model_len=20)
    p, r = PROMPTS[2], ref[2]  # 4 prompt tokens
    stop = r[3]
    outs = llm.generate([p, p, list(range(3, 21))],
                        [SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[stop]),
                         SamplingParams(temperature=0, max_tokens=2), GREEDY], use_tqdm=False)
    assert outs[0].outputs[0].token_ids == r[: r.index(stop) + 1]
    assert outs[0].outputs[0].finish_reason == "stop"
    assert outs[1].outputs[0].token_ids == r[:2] and outs[1].outputs[0].finish_reason == "length"
    # max_model_len = 20: an 18-token prompt gets 2 new tokens
    assert len(outs[2].outputs[0].token_ids) == 2
    assert outs[2].outputs[0].finish_reason == "length"
    # EOS stops a request unless ignore_eos
    engine = llm_engine(hf)
    engine.eos_token_ids = frozenset({r[4]})
    engine.add_request("eos", p, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    engine.add_request("ignore", p, GREEDY)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["eos"].outputs[0].token_ids == r[: r.index(r[4]) + 1]
    assert outs["eos"].outputs[0].finish_reason == "stop"
    assert outs["ignore"].outputs[0].token_ids == r
    assert_all_blocks_free(engine)


# ------------------------------------------------------------------------------------------- bad input
def test_bad_requests_are_isolated(llama_and_ref):
    hf, ref = llama_and_ref
    llm = LLM(hf, block_size=4, num_gpu_blocks=20, max_model_len=100)
    bad = {  # prompt, sampling params, words the error must name
        "empty": ([], GREEDY, "empty prompt"),
        "too_long": (list(range(3, 104)), GREEDY, "max_model_len=100"),
        "pool": (list(range(3, 93)), GREEDY, "num_gpu_blocks=20"),
        "stop_id": ([5, 6], SamplingParams(temperature=0, stop_token_ids=[256]), "vocab_size=256"),
        "token_id": ([5, 999], GREEDY, "vocab_size=256"),
        "max_tokens": ([5, 6], dict(max_tokens=0), "max_tokens"),
    }
    prompts, params = list(PROMPTS[:4]), [GREEDY] * 4
    for p, sp, _ in bad.values():
        prompts.append(p)
        params.append(sp)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert tokens(outs[:4]) == ref[:4] and all(o.error is None for o in outs[:4])
    for o, (name, (_, _, words)) in zip(outs[4:], bad.items()):
        assert o.finished and o.outputs[0].finish_reason == "error", name
        assert words in o.error, (name, o.error)
    engine = llm.engine
    for name, (p, sp, words) in bad.items():
        with pytest.raises(ValueError, match=words):
            engine.add_request(name, p, sp if isinstance(sp, SamplingParams) else SamplingParams(**sp))
    with pytest.raises(ValueError, match="beam search .* num_gpu_blocks=20"):  # 8 beams x 17 blocks never fit
        engine.add_request("beam", [5], SamplingParams(use_beam_search=True, beam_width=8, temperature=0,
                                                       max_tokens=64))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request("text", "hello", GREEDY)
    engine.add_request("dup", [5], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", [6], GREEDY)
    engine.abort("dup")
    assert_all_blocks_free(engine)


def test_request_that_outgrows_the_pool_fails_alone(llama_and_ref):
    hf, ref = llama_and_ref
    for mode in ("recompute", "swap"):  # 8 blocks of 4 = 32 slots; the 30-token prompt + 12 new tokens overflow
        llm = LLM(hf, block_size=4, num_gpu_blocks=8, preemption_mode=mode)
        outs = llm.generate([list(range(3, 33)), PROMPTS[2]], GREEDY, use_tqdm=False)
        assert outs[0].outputs[0].finish_reason == "error" and "num_gpu_blocks=8" in outs[0].error
        assert outs[1].outputs[0].token_ids == ref[2]
        assert_all_blocks_free(llm.engine)


def test_abort_frees_blocks_and_spares_the_others(llama_and_ref):
    hf, ref = llama_and_ref
    engine = llm_engine(hf, block_size=4, num_gpu_blocks=14, preemption_mode="swap", num_cpu_blocks=64)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, GREEDY)
    for _ in range(6):
        engine.step()
    assert engine.scheduler.running and engine.scheduler.waiting
    engine.abort_request([str(i) for i in range(0, 16, 2)])
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert sorted(finished, key=int) == [str(i) for i in range(1, 16, 2)]  # the others all finish, unharmed
    for i in range(1, 16, 2):
        assert finished[str(i)].outputs[0].token_ids == ref[i]
    assert_all_blocks_free(engine)


# -------------------------------------------------------------------------------------------- sampling
def test_seeded_sampling_is_reproducible_and_top_k1_is_greedy(llama_and_ref):
    hf, ref = llama_and_ref
    llm = LLM(hf)
    seeded = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=i, max_tokens=MAX_NEW, ignore_eos=True)
              for i in range(4)]
    a = tokens(llm.generate(PROMPTS[:4], seeded, use_tqdm=False))
    b = tokens(llm.generate(PROMPTS[:4][::-1], seeded[::-1], use_tqdm=False))[::-1]  # other batch order
    assert a == b
    assert a != ref[:4]  # temperature 1 over a random model is far from greedy
    c = tokens(llm.generate(PROMPTS[:4], [SamplingParams(temperature=1.0, seed=99, max_tokens=MAX_NEW,
                                                         ignore_eos=True)] * 4, use_tqdm=False))
    assert c != a
    top1 = SamplingParams(temperature=0.8, top_k=1, max_tokens=MAX_NEW, ignore_eos=True)
    tiny_p = SamplingParams(temperature=0.8, top_p=1e-6, max_tokens=MAX_NEW, ignore_eos=True)
    assert tokens(llm.generate(PROMPTS[:4], top1, use_tqdm=False)) == ref[:4]
    assert tokens(llm.generate(PROMPTS[:4], tiny_p, use_tqdm=False)) == ref[:4]
    assert_all_blocks_free(llm.engine)


def test_parallel_sampling_shares_prompt_blocks(llama_and_ref):
    """n samples share the prompt's blocks (fork); their first diverging appends copy the shared last block."""
    hf, ref = llama_and_ref
    llm = LLM(hf, block_size=4)
    prompt = PROMPTS[3]
    assert len(prompt) % 4  # the last prompt block is partly filled, so the samples' appends copy it on write
    out = llm.generate([prompt, prompt], [SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=MAX_NEW,
                                                         ignore_eos=True),
                                          SamplingParams(n=2, temperature=0, max_tokens=MAX_NEW, ignore_eos=True)],
                       use_tqdm=False)
    assert len(out[0].outputs) == 3 and len({tuple(o.token_ids) for o in out[0].outputs}) > 1
    assert [o.token_ids for o in out[1].outputs] == [ref[3], ref[3]]
    assert any(m.num_blocks_copied for m in llm.engine.step_metrics)
    assert_all_blocks_free(llm.engine)


def test_text_prompts_with_a_tokenizer(llama_and_ref):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(c): c for c in range(32, 127)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="?")
    hf, _ = llama_and_ref
    llm = LLM(hf, tokenizer=tokenizer)
    out = llm.generate(["Hello, paged world"], GREEDY, use_tqdm=False)[0]
    assert out.prompt == "Hello, paged world" and out.prompt_token_ids == [ord(c) for c in out.prompt]
    assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids)
    assert out.outputs[0].text == tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    # streamed through LLMEngine.step: every step's text is the decode of the tokens so far (incremental)
    engine = llm.engine
    engine.add_request("s", "Hello", GREEDY)
    engine.add_request("t", "paged", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    seen = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen += 1
            assert o.outputs[0].text == tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True)
    assert seen >= GREEDY.max_tokens and not engine.processor.detokenizer.states
    assert_all_blocks_free(llm.engine)


def test_triton_backend_matches(llama_and_ref, triton):
    """The Triton kernels plug in behind the same interface (on a CPU in Triton's interpreter, which
    tests/conftest.py switches on before collection; the interpreter is slow, so a short run)."""
    hf, ref = llama_and_ref
    llm = LLM(hf, block_size=4, attention_backend="triton")
    assert llm.engine.backend.name == "triton"
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert tokens(llm.generate(PROMPTS[:3], sp, use_tqdm=False)) == [r[:4] for r in ref[:3]]
    assert_all_blocks_free(llm.engine)


def test_committed_opt_stdlib_checkpoint_with_its_tokenizer():
    """The small OPT trained here (models/opt-stdlib, fp16 safetensors + tokenizer) loads by path, runs in fp32 on the
    CPU, takes text prompts, and matches HF greedy decoding (EOS on)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(__file__).resolve().parents[1] / "models" / "opt-stdlib"
    if not (path / "model.safetensors").exists():
        pytest.skip("models/opt-stdlib is not present")
    llm = LLM(str(path))
    assert llm.engine.dtype == torch.float32 and llm.engine.tokenizer is not None
    prompts = ["def __init__(self", "import os\n"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for o in outs:
        ids = torch.tensor([o.prompt_token_ids])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                          pad_token_id=hf.config.pad_token_id)[0, ids.shape[1]:].tolist()
        assert o.outputs[0].token_ids == ref
        assert o.outputs[0].text == llm.engine.tokenizer.decode(ref, skip_special_tokens=True)
    assert_all_blocks_free(llm.engine)


def test_bf16_llm_runs_the_cpu_kernels_and_mostly_follows_hf_bf16(monkeypatch):
    """``LLM(model.to(torch.bfloat16))`` decodes with the C++ kernels in bf16 (the CPU module's torch fallbacks are
    made to raise), and its greedy tokens equal HF bf16 ``generate()``'s on most requests. Not all: two bf16
    implementations round differently (the torch reference backend agreed on exactly as many requests when this test
    was written: 10/16 on these prompts, 10-13/16 on three other prompt sets). head_dim 32: the compiled-in path."""
    from pagedattn.kernels import cpu

    if not cpu.available():
        pytest.skip("the CPU kernel did not build here (no C++ compiler?)")

    def refuse(*args, **kwargs):
        raise AssertionError("the CPU kernel fell back to the torch reference")

    hf = tiny_models.tiny_llama(hidden_size=128, intermediate_size=256, max_position_embeddings=128).to(torch.bfloat16)
    ref = [hf_greedy(hf, p) for p in PROMPTS]
    monkeypatch.setattr(cpu, "paged_attention_ref", refuse)
    monkeypatch.setattr(cpu, "reshape_and_cache_ref", refuse)
    llm = LLM(hf)
    assert llm.engine.backend.name == "cpu" and llm.engine.dtype == torch.bfloat16
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(o.finished and len(o.outputs[0].token_ids) == MAX_NEW for o in outs)
    assert sum(a == b for a, b in zip(tokens(outs), ref)) > len(PROMPTS) / 2
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("flags,warns", [("fpu sse avx2 fma", True), ("fpu avx2 avx512f avx512_bf16", False),
                                         ("fpu avx2 avx512f amx_bf16 amx_tile", False)])
def test_bf16_on_a_cpu_without_bf16_hardware_warns(monkeypatch, flags, warns):
    """A bf16 model on a CPU with neither AMX nor AVX-512 BF16 gets a warning that names float32 as the faster dtype
    (there torch's bf16 matmuls are emulated); an fp32 model, or a CPU with either, gets none."""
    import warnings

    from pagedattn import cpuinfo

    monkeypatch.setattr(cpuinfo, "cpu_flags", lambda: flags)

    def model():
        return tiny_models.tiny_llama(hidden_size=64, intermediate_size=128, max_position_embeddings=64)

    for hf, expected in ((model(), False), (model().to(torch.bfloat16), warns)):  # .to() converts in place
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            LLM(hf)
        hits = [w for w in caught if "AVX-512 BF16" in str(w.message) and "float32" in str(w.message)]
        assert bool(hits) == expected, (flags, hf.dtype, [str(w.message) for w in caught])


def test_threads_option_sets_torch_threads_and_keeps_the_tokens(llama_and_ref):
    """``threads=2`` gives the matmuls two torch threads and the C++ attention two (both process-wide) and the same
    greedy tokens; None, the default, leaves both settings alone; fewer than one is refused."""
    from pagedattn.kernels import cpu

    hf, ref = llama_and_ref
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        LLM(hf)
        assert torch.get_num_threads() == 1 and cpu._threads == 1
        llm = LLM(hf, threads=2)
        assert torch.get_num_threads() == 2 and cpu._threads == 2 and llm.engine.args.threads == 2
        assert tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == ref
        with pytest.raises(ValueError, match="at least one thread"):
            LLM(hf, threads=0)
    finally:
        torch.set_num_threads(before)
        cpu.set_threads(1)


@pytest.mark.parametrize("kv_manager", ["paged", "orca_oracle"])
def test_the_scheduler_owns_the_kv_manager(kv_manager):
    """One owner of the KV cache (issue 63, as vLLM V1's scheduler owns its KVCacheManager): the engine core, its
    executor and the model runner hold no KV manager; each step's plan carries the block tables and slots the
    runner reads, and they are the manager's."""
    from pagedattn.memory.block_manager import BlockManager
    from pagedattn.memory.contiguous import ContiguousKVManager

    e = llm_engine(kv_manager=kv_manager, num_slots=512)
    held = [o for holder in (e.core, e.core.executor, e.runner) for o in vars(holder).values()]
    assert not [o for o in held if isinstance(o, (BlockManager, ContiguousKVManager))]
    assert e.scheduler.kv is e.kv
    e.add_request("r", [5, 6, 7, 8, 9], SamplingParams(temperature=0, max_tokens=8))  # (running after 3 steps)
    for _ in range(3):
        plan, _ = e.core.step()
        seqs = [s for g in plan.scheduled_groups for s in g.get_seqs()]
        n = [s.get_len() - 1 for s in seqs]  # (the step appended one token)
        assert plan.block_tables == {s.seq_id: e.kv.block_table(s.seq_id, k) for s, k in zip(seqs, n)}
        assert all(len(plan.slot_mappings[s.seq_id]) == (5 if plan.is_prefill else 1) for s in seqs)
