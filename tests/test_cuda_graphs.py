"""CUDA graphs for decode steps (issue 54, ``pagedattn.cuda_graphs``), checked on a CPU without a GPU: vLLM's buckets
and the padding as functions; the padded static-buffer path a graph replays, run eagerly (``capture=False``), gives the
eager engine's greedy tokens on a tiny Llama and a tiny OPT while batches shrink and grow across buckets, sequences
finish and preemption recomputes or swaps; around every such step the cache is poisoned (NaN in every slot but the
real sequences' contexts) to show that no row reads anything else and that padded rows write nothing; the Triton
kernels in the interpreter take the split-KV plan of ``max_model_len`` and still agree; the capture path's control
flow (warm-up and capture over padding, one pool, lazy or at start-up, replay) runs with a fake graph object whose
replay reruns what it recorded; and graphs are never taken on a CPU. What only a GPU can check (a real capture, no
host syncs inside it, the speed) is ``make gpu``'s ``cuda_graphs`` step."""
from __future__ import annotations

import pytest
import torch

from pagedattn import kernels
from pagedattn.cuda_graphs import (PAD_SLOT_ID, DecodeBuffers, DecodeGraphs, NotKnownAtCapture, batch_sizes_to_capture,
                                   graph_batch_size, use_cuda_graphs)
from pagedattn.model.attention import AttentionMetadata
from pagedattn.sequence import SamplingParams

from factories import llm_engine
import tiny_models


# ------------------------------------------------------------------------------------------- buckets and padding
def test_buckets_are_vllms():
    assert batch_sizes_to_capture(256) == [1, 2, 4] + [8 * i for i in range(1, 33)]
    assert [batch_sizes_to_capture(m) for m in (1, 2, 3, 4, 5, 10)] == [
        [1], [1, 2], [1, 2, 4], [1, 2, 4], [1, 2, 4, 8], [1, 2, 4, 8, 16]]
    for max_num_seqs in range(1, 70):
        buckets = batch_sizes_to_capture(max_num_seqs)
        for n in range(1, max_num_seqs + 1):  # every batch the scheduler can form: the smallest bucket >= n
            assert graph_batch_size(n) == min(b for b in buckets if b >= n)
    with pytest.raises(ValueError):
        graph_batch_size(0)


def _meta(slots, tables, lens) -> AttentionMetadata:
    return AttentionMetadata(False, torch.tensor(slots), torch.tensor(tables, dtype=torch.int32),
                             torch.tensor(lens, dtype=torch.int32), [], list(lens))


def test_load_pads_rows_to_the_bucket():
    buf = DecodeBuffers.allocate(8, 5, torch.device("cpu"))
    buf.load(torch.tensor([7, 8, 9, 10, 11]), torch.tensor([3, 4, 5, 6, 7]),
             _meta([40, 41, 42, 43, 44], [[1, 2, 3]] * 5, [4, 5, 6, 7, 8]), 8)
    buf.load(torch.tensor([5, 6, 7]), torch.tensor([30, 17, 2]), _meta([12, 33, 2], [[3, 4], [8, 9], [0, 0]],
                                                                     [31, 18, 3]), 4)
    assert buf.input_ids[:4].tolist() == [5, 6, 7, 0] and buf.positions[:4].tolist() == [30, 17, 2, 0]
    assert buf.slot_mapping[:4].tolist() == [12, 33, 2, PAD_SLOT_ID] and buf.context_lens[:4].tolist() == [31, 18, 3, 0]
    # the real rows' tables at the fixed width, zero past the step's width (no stale block of the earlier step)
    assert buf.block_tables[:3].tolist() == [[3, 4, 0, 0, 0], [8, 9, 0, 0, 0], [0, 0, 0, 0, 0]]
    assert buf.input_ids[4:].tolist() == [11, 0, 0, 0]  # past the bucket: not the step's business
    buf.pad(8)
    assert (buf.slot_mapping == PAD_SLOT_ID).all() and (buf.context_lens == 0).all()


def test_a_graphs_metadata_has_no_per_step_python_ints():
    meta = DecodeBuffers.allocate(4, 2, torch.device("cpu")).metadata(4)
    assert not meta.is_prefill and meta.block_tables.shape == (4, 2)
    for read in (lambda: meta.context_lens_list[0], lambda: len(meta.query_start_loc), lambda: meta.num_seqs,
                 lambda: max(meta.context_lens_list), lambda: list(meta.query_start_loc)):
        with pytest.raises(RuntimeError, match="Python-int metadata"):
            read()
    assert isinstance(meta.context_lens_list, NotKnownAtCapture)


def test_graphs_only_on_cuda_with_compiled_triton():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    triton = kernels.KernelBackend("triton", *[None] * 4)
    interpreted = kernels.KernelBackend("triton", *[None] * 4, interpreted=True)
    assert use_cuda_graphs(cuda, triton, enforce_eager=False)
    assert not use_cuda_graphs(cuda, triton, enforce_eager=True)
    assert not use_cuda_graphs(cpu, triton, enforce_eager=False)
    assert not use_cuda_graphs(cuda, interpreted, enforce_eager=False)
    assert not use_cuda_graphs(cuda, kernels.get_backend("torch"), enforce_eager=False)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_no_graphs_on_a_cpu(enforce_eager):
    e = llm_engine(tiny_models.tiny_opt(), max_model_len=64, enforce_eager=enforce_eager)
    assert e.args.enforce_eager is enforce_eager and e.runner.graphs is None


def test_the_server_passes_enforce_eager():
    """``python -m pagedattn.serve --enforce-eager`` reaches the engine's ``EngineArgs``."""
    from pagedattn import serve

    for argv, want in ((["--tiny-opt"], False), (["--tiny-opt", "--enforce-eager"], True)):
        a = serve.parse_args(argv)
        assert a.enforce_eager is want
        e = serve.load_engine(tiny_models.tiny_opt(), num_slots=256, enforce_eager=a.enforce_eager)
        assert e.args.enforce_eager is want and e.runner.graphs is None


# ------------------------------------------------------------------------------- the padded path, run eagerly
class PoisonCheck(DecodeGraphs):
    """``capture=False`` graphs that check every padded step: before it, every cache slot but the real rows'
    contexts holds NaN; after it, every row's hidden state (padded rows' too) is finite, so none read a poisoned
    slot, and no slot but the real rows' new ones was written, so padded rows wrote nowhere. The cache is then put
    back as the step left it."""

    def __init__(self, runner, max_num_seqs: int, max_model_len: int, capture: bool = False) -> None:
        super().__init__(runner.model, max_num_seqs, -(-max_model_len // runner.block_size), runner.device,
                         capture=capture)
        self.runner = runner
        self.steps: list[tuple[int, int]] = []  # (real rows, bucket)

    def _run(self, bucket: int) -> torch.Tensor:
        b, bs = self.buffers, self.runner.block_size
        ctx = b.context_lens[:bucket].long()
        n = int((ctx > 0).sum())
        assert (ctx[:n] > 0).all() and (b.slot_mapping[n:bucket] == PAD_SLOT_ID).all()
        pos = torch.arange(b.max_blocks * bs)
        slots = b.block_tables[:n].long()[:, pos // bs] * bs + pos % bs
        keep = slots[pos[None, :] < ctx[:n, None]]  # the real rows' contexts (the new token's slot included)
        written = b.slot_mapping[:n]
        caches = self.runner.k_caches + self.runner.v_caches
        saved = [c.clone() for c in caches]
        for c in caches:
            flat = c.view(-1, *c.shape[2:])
            kept = flat[keep].clone()
            flat.fill_(float("nan"))
            flat[keep] = kept
        out = super()._run(bucket)
        assert torch.isfinite(out).all()
        for c, s in zip(caches, saved):
            flat = c.view(-1, *c.shape[2:])
            untouched = torch.ones(flat.shape[0], dtype=torch.bool)
            untouched[keep] = False
            untouched[written] = False
            assert flat[untouched].isnan().all()
            s.view(-1, *c.shape[2:])[written] = flat[written]
            c.copy_(s)
        self.steps.append((n, bucket))
        return out


class FakeGraph:
    """A stand-in for ``torch.cuda.CUDAGraph`` on a CPU: ``replay`` reruns what was recorded into its output."""

    def __init__(self, fn, out: torch.Tensor) -> None:
        self.fn, self.out, self.replays = fn, out, 0

    def replay(self) -> None:
        self.out.copy_(self.fn())
        self.replays += 1

    def pool(self):
        return "pool"


class FakeCapture(PoisonCheck):
    """``PoisonCheck`` with capture on and ``FakeGraph`` for the CUDA graph: the capture path's control flow (warm-up
    and capture over padding, the shared pool, lazy capture before the step's inputs are loaded, replay of the
    bucket's graph, its output's first rows) runs on the CPU, every run poison-checked, the capture's too."""

    def __init__(self, runner, max_num_seqs: int, max_model_len: int) -> None:
        super().__init__(runner, max_num_seqs, max_model_len, capture=True)
        self.pools: list = []

    def _record(self, fn):
        self.pools.append(self.pool)
        out = fn()
        return FakeGraph(fn, out), out


PROMPT_LENS = (5, 33, 12, 1, 27, 40, 9, 18, 3, 22, 14, 30)


def _prompts(n: int = len(PROMPT_LENS)) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 256, (k,), generator=g).tolist() for k in PROMPT_LENS[:n]]


def _generate(hf, graphs_for: int | None, prompts, max_tokens, graphs_class=PoisonCheck, **engine):
    """Greedy tokens of an engine; with ``graphs_for``, through ``PoisonCheck`` graphs for that many sequences. The
    first half of the prompts arrives first, the rest once at most two of those still run, so a decode batch shrinks
    and grows again. Returns the tokens, the graphs (or None) and each decode step's batch size."""
    e = llm_engine(hf, **engine)
    runner = e.runner
    graphs = None
    if graphs_for is not None:
        graphs = runner.graphs = graphs_class(runner, graphs_for, e.max_model_len)
    decode_batches: list[int] = []
    forward = runner.forward
    runner.forward = lambda inp: (decode_batches.append(len(inp.rows)) if not inp.meta.is_prefill else None,
                                  forward(inp))[1]
    waiting = [(f"r{i}", p, SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
               for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    half = len(waiting) // 2
    for r in waiting[:half]:
        e.add_request(*r)
    waiting = waiting[half:]
    done = {}
    while e.has_unfinished_requests() or waiting:
        if waiting and e.get_num_unfinished_requests() <= 2:
            for r in waiting:
                e.add_request(*r)
            waiting = []
        for o in e.step(finished_only=True):
            done[o.request_id] = o.outputs[0].token_ids
    c = e.kv.pool_counts()
    assert c.gpu_free == c.gpu_blocks
    mode = engine.get("preemption_mode")
    assert (e.scheduler.num_preemptions[mode] > 0) if mode else not sum(e.scheduler.num_preemptions.values())
    return [done[f"r{i}"] for i in range(len(prompts))], graphs, decode_batches


SETUPS = {
    # batches grow to 6 (bucket 8) and shrink as sequences finish at different lengths: buckets 8, 4, 2, 1
    "roomy": (6, dict(max_num_seqs=6)),
    # a pool so small that sequences are preempted and recomputed, or swapped out and back
    "recompute": (6, dict(max_num_seqs=6, block_size=4, num_gpu_blocks=24, preemption_mode="recompute")),
    "swap": (6, dict(max_num_seqs=6, block_size=4, num_gpu_blocks=24, num_cpu_blocks=64, preemption_mode="swap")),
    # graphs up to 4 sequences under a scheduler of 8: larger decode batches run eagerly
    "oversize": (4, dict(max_num_seqs=8)),
}


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("name", ["llama", "opt"])
def test_padded_static_buffer_path_gives_the_eager_tokens(name, setup):
    hf = (tiny_models.tiny_llama if name == "llama" else tiny_models.tiny_opt)(max_position_embeddings=128)
    graphs_for, engine = SETUPS[setup]
    prompts = _prompts()
    max_tokens = [2 + (7 * i) % 13 for i in range(len(prompts))]  # finishing one by one
    eager, _, _ = _generate(hf, None, prompts, max_tokens, **engine)
    ours, graphs, decode_batches = _generate(hf, graphs_for, prompts, max_tokens, **engine)
    assert ours == eager
    assert graphs is not None
    # every decode step that fits went through the buffers, padded to its bucket; no prefill and no larger batch did
    assert sorted(n for n, _ in graphs.steps) == sorted(n for n in decode_batches if n <= graphs.max_batch_size)
    assert all(bucket == graph_batch_size(n) for n, bucket in graphs.steps)
    assert any(bucket > n for n, bucket in graphs.steps)  # padding happened
    assert len({bucket for _, bucket in graphs.steps}) >= (2 if setup == "oversize" else 3)  # across buckets
    if setup == "oversize":
        assert max(decode_batches) > graphs.max_batch_size
    else:  # a batch shrinks and grows again (a finished or preempted sequence's place taken)
        assert any(a < b for a, b in zip(decode_batches, decode_batches[1:]))


def test_gpu_decode_path_with_the_plan_of_max_model_len(triton, monkeypatch):
    """What a graph captures on a GPU, in the interpreter: the Triton attention and KV-cache write and the fused
    Triton RMSNorm and RoPE (``model.fused_ops``, forced as in ``test_engine``). A bucket's attention is planned for
    ``max_model_len`` (256 tokens of block 4: split-KV, two 128-token partitions, mostly empty), the eager engine's
    for its batch's widest table (no split); the tokens agree and the poison check holds."""
    from pagedattn.kernels import cpu
    from pagedattn.kernels import paged_attention as pa
    from pagedattn.model import fused_ops

    monkeypatch.setattr(fused_ops, "on_gpu", lambda x: True)
    monkeypatch.setattr(cpu, "takes", lambda *xs, **kw: False)
    hf = tiny_models.tiny_llama()  # max_position_embeddings 256
    assert pa.split_partition(4, 2, 256, torch.device("cpu")) == 128  # the bucket's plan: split
    prompts, max_tokens = _prompts(3), [2, 4, 3]
    engine = dict(block_size=4, attention_backend="triton", max_model_len=256)
    plan, launches = pa.plan_paged_attention, []

    def counted(*args, **kwargs):
        out = plan(*args, **kwargs)
        launches.append(len(out))
        return out
    monkeypatch.setattr(pa, "plan_paged_attention", counted)
    eager, _, _ = _generate(hf, None, prompts, max_tokens, **engine)
    assert set(launches) == {1}  # no split
    launches.clear()
    ours, graphs, _ = _generate(hf, 4, prompts, max_tokens, **engine)
    assert ours == eager and set(launches) == {2}  # split, then reduce
    assert graphs is not None and {b for _, b in graphs.steps} == {4, 2, 1}


@pytest.mark.parametrize("at_start", [True, False], ids=["captured_at_start", "captured_lazily"])
def test_capture_and_replay_path_with_a_fake_graph(monkeypatch, at_start):
    """The capture path itself on a CPU (``FakeCapture``): each bucket is warmed up and captured once, over padding
    only (the poison check sees no real row then), into one pool shared from the second capture on, at start-up
    (largest first) or on first use; every fitting decode step replays its bucket's graph, and the tokens are the
    eager engine's."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    hf = tiny_models.tiny_llama(max_position_embeddings=128)
    prompts = _prompts()
    max_tokens = [2 + (7 * i) % 13 for i in range(len(prompts))]
    engine = dict(max_num_seqs=6, block_size=4, num_gpu_blocks=24, preemption_mode="recompute")
    eager, _, _ = _generate(hf, None, prompts, max_tokens, **engine)
    if at_start:
        made: list[FakeCapture] = []

        class AtStart(FakeCapture):
            def __init__(self, *args) -> None:
                super().__init__(*args)
                self.capture_all()
                made.append(self)
        ours, graphs, decode_batches = _generate(hf, 6, prompts, max_tokens, graphs_class=AtStart, **engine)
        assert made and list(made[0].graphs) == [8, 4, 2, 1]  # every bucket, largest first, before any step
    else:
        ours, graphs, decode_batches = _generate(hf, 6, prompts, max_tokens, graphs_class=FakeCapture, **engine)
    assert ours == eager
    assert isinstance(graphs, FakeCapture)
    used = {graph_batch_size(n) for n in decode_batches}
    assert set(graphs.graphs) == (set(graphs.batch_sizes) if at_start else used)
    assert graphs.pools == [None] + ["pool"] * (len(graphs.graphs) - 1)  # one pool, shared
    captures = [s for s in graphs.steps if s[0] == 0]  # runs over padding only: warm-ups and captures
    assert len(captures) == len(graphs.graphs) * 3 and all(b in graphs.graphs for _, b in captures)
    replays = [s for s in graphs.steps if s[0] > 0]
    assert sorted(n for n, _ in replays) == sorted(decode_batches)
    assert sum(g.replays for g in graphs.graphs.values()) == len(decode_batches)


def test_the_engine_captures_at_start_where_graphs_are_taken(monkeypatch):
    """``LLMEngine``'s wiring, with graphs made takeable on the CPU (``use_cuda_graphs`` forced, ``FakeGraph``):
    ``enforce_eager=False`` captures every bucket of ``max_num_seqs`` at start-up over block tables of
    ``max_model_len``, and its tokens equal ``enforce_eager=True``'s, which builds no graphs."""
    from pagedattn import engine as engine_module

    class Fake(DecodeGraphs):
        def _record(self, fn):
            out = fn()
            return FakeGraph(fn, out), out

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(engine_module, "use_cuda_graphs", lambda device, backend, enforce_eager: not enforce_eager)
    monkeypatch.setattr(engine_module, "DecodeGraphs", Fake)
    hf = tiny_models.tiny_opt(max_position_embeddings=128)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    out = {}
    for eager in (True, False):
        e = llm_engine(hf, max_num_seqs=5, block_size=8, max_model_len=100, enforce_eager=eager)
        g = e.runner.graphs
        if eager:
            assert g is None
        else:
            assert isinstance(g, Fake) and list(g.graphs) == [8, 4, 2, 1] and g.buffers.max_blocks == 13
        for i, p in enumerate(_prompts(5)):
            e.add_request(f"r{i}", p, sp)
        done = {}
        while e.has_unfinished_requests():
            for o in e.step(finished_only=True):
                done[o.request_id] = o.outputs[0].token_ids
        out[eager] = done
        if not eager:
            assert sum(x.replays for x in g.graphs.values()) == 5  # the decode steps of the batch of 5 (bucket 8)
    assert out[False] == out[True]
