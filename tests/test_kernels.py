"""Paged KV-cache kernels (§4.1, §5.1): the Triton kernels and the torch reference against a float64 oracle.

Without CUDA the Triton kernels run in Triton's interpreter, which ``triton.jit`` selects when a kernel is defined,
so ``kernels.use_triton_interpreter`` decides here (as in tests/conftest.py) before anything imports the kernel
module. Shapes stay small (the interpreter
costs ~0.2 ms per Triton op). Every case draws fresh random inputs (seeded per case, override the base seed with
``PAGEDATTN_TEST_SEED``), ragged context lengths, a shuffled block table whose physical blocks are out of order and
partly shared between sequences (as after fork, §4.4), and NaN-poisoned outputs.
"""
from __future__ import annotations

import os
import time
import zlib

import torch

from pagedattn import kernels

kernels.use_triton_interpreter()

import pytest  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pagedattn.repro.experiments.attention_kernel import make_paged_inputs  # noqa: E402
from pagedattn.kernels import (copy_blocks_ref, paged_attention_ref, reshape_and_cache_ref,  # noqa: E402
                               swap_blocks_ref)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
BASE_SEED = int(os.environ.get("PAGEDATTN_TEST_SEED", "1234"))


@pytest.fixture(scope="module")
def triton_ops(triton):
    return kernels.get_backend("triton")


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(BASE_SEED + zlib.crc32(repr(key).encode()))


def make_paged(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, gen, share=True, spare_blocks=3):
    """Random paged inputs. Returns (query, key_cache, value_cache, block_tables, context_lens) in ``dtype``.

    Physical blocks are a random permutation of the pool; when ``share``, every odd sequence also reads sequence 0's
    first physical block (as forked sequences share their prompt's blocks, §4.4), so block ids repeat across rows of
    the table. Unused table entries are -1.
    """
    return make_paged_inputs(lens, num_heads, num_kv_heads, head_dim, block_size, dtype, DEVICE, share=share,
                             spare_blocks=spare_blocks, generator=gen, pad_columns=1)


def test_inputs_are_shuffled_and_shared():
    for block_size, lens in SHAPES:
        *_, table, _ = make_paged(lens, 4, 2, 8, block_size, torch.float32, _gen("shape", block_size))
        used = table[table >= 0].cpu()
        assert used.numel() > used.unique().numel()  # a physical block appears in two sequences
        assert not torch.equal(used.unique(), used[: used.unique().numel()])  # ids not in allocation order


def poison_unused_slots(kc, vc, table, lens, block_size) -> None:
    """Set every cache slot that no sequence's context uses to NaN (the tail of each last block, unreferenced
    blocks), in place: a kernel that reads one returns NaN."""
    used = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for s, n in enumerate(lens):
        for t in range(n):
            used[int(table[s, t // block_size]), t % block_size] = True
    used = used.to(kc.device)
    kc[~used], vc[~used] = float("nan"), float("nan")


def naive_attention_f64(q, kc, vc, table, ctx, scale):
    """The oracle: walk each sequence's block table token by token, in float64."""
    q, kc, vc = q.double().cpu(), kc.double().cpu(), vc.double().cpu()
    table, ctx = table.cpu(), ctx.cpu()
    num_seqs, num_heads, d = q.shape
    bs, kvh = kc.shape[1], kc.shape[2]
    group = num_heads // kvh
    out = torch.zeros(num_seqs, num_heads, d, dtype=torch.float64)
    for s in range(num_seqs):
        n = int(ctx[s])
        if n == 0:
            continue
        blocks = [int(table[s, t // bs]) for t in range(n)]
        k = torch.stack([kc[blocks[t], t % bs] for t in range(n)])  # [n, kvh, d]
        v = torch.stack([vc[blocks[t], t % bs] for t in range(n)])
        for h in range(num_heads):
            w = torch.softmax((k[:, h // group] @ q[s, h]) * scale, dim=0)
            out[s, h] = w @ v[:, h // group]
    return out


def rel_err(out, ref) -> float:
    return ((out.double().cpu() - ref).abs().max() / ref.abs().max()).item()


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (block_size, ragged context lengths): block 1 and large blocks with small contexts included
SHAPES = [(1, [1, 23, 40]), (8, [9, 3, 50]), (16, [33, 17, 5, 64]), (64, [70, 65, 2]), (128, [3, 130, 40])]


# ------------------------------------------------------------------------------------------ torch reference


@pytest.mark.parametrize("block_size,lens", SHAPES)
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_reference_matches_float64_oracle(block_size, lens, num_kv_heads):
    gen = _gen("ref", block_size, num_kv_heads)
    q, kc, vc, table, ctx = make_paged(lens, 4, num_kv_heads, 16, block_size, torch.float64, gen)
    oracle = naive_attention_f64(q, kc, vc, table, ctx, 16 ** -0.5)
    assert rel_err(paged_attention_ref(q, kc, vc, table, ctx, 16 ** -0.5), oracle) < 1e-12
    for dtype in DTYPES:  # the reference in low precision, from the same (rounded) inputs
        args = [x.to(dtype) for x in (q, kc, vc)]
        oracle = naive_attention_f64(*args, table, ctx, 16 ** -0.5)
        out = paged_attention_ref(*args, table, ctx, 16 ** -0.5)
        assert out.dtype == dtype
        assert rel_err(out, oracle) < TOL[dtype], dtype


def test_reference_empty_context_gives_zeros():
    gen = _gen("empty-ref")
    q, kc, vc, table, ctx = make_paged([0, 5, 0], 2, 2, 8, 4, torch.float32, gen)
    out = paged_attention_ref(q, kc, vc, table, ctx, 0.3)
    assert torch.isfinite(out).all() and (out[0] == 0).all() and (out[2] == 0).all()
    assert rel_err(out, naive_attention_f64(q, kc, vc, table, ctx, 0.3)) < 1e-5


@pytest.mark.parametrize("bucket_cost", [0, 10**9], ids=["bucket-per-length", "one-bucket"])
def test_reference_buckets_are_exact_and_nan_safe(monkeypatch, bucket_cost):
    """The decode plan groups sequences into buckets (one per block count, or all in one padded to the longest):
    either way, in float64 and with every unused slot poisoned with NaN, the output equals the oracle."""
    from pagedattn.kernels import reference

    monkeypatch.setattr(reference, "BUCKET_COST_BLOCKS", bucket_cost)
    gen = _gen("buckets", bucket_cost)
    lens, bs = [37, 0, 5, 64, 16, 17, 3, 48], 8
    q, kc, vc, table, ctx = make_paged(lens, 4, 2, 16, bs, torch.float64, gen)
    poison_unused_slots(kc, vc, table, lens, bs)
    plan = reference.plan_decode(table, ctx, bs)
    assert len(plan.buckets) == (6 if bucket_cost == 0 else 1)  # block counts 5, 1, 8, 2, 3, 1, 6 -> 6 distinct
    oracle = naive_attention_f64(q, kc, vc, table, ctx, 0.25)
    out = paged_attention_ref(q, kc, vc, table, ctx, 0.25, plan=plan)
    assert torch.isfinite(out).all() and (out[1] == 0).all()
    assert rel_err(out, oracle) < 1e-12


# ------------------------------------------------------------------------------------------ CPU kernel (C++)


def require_cpu_kernel() -> None:
    """Skip where the C++ kernel did not build (no compiler) on a developer's machine; fail under CI=true, where a
    missing compiler must not pass as a green run of every CPU-kernel case."""
    from pagedattn.kernels import cpu

    if not cpu.available():
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail("the CPU kernel did not build under CI (no C++ compiler?)")
        pytest.skip("the CPU kernel did not build here (no C++ compiler?)")


@pytest.fixture(scope="module")
def cpu_kernel():
    from pagedattn.kernels import cpu

    require_cpu_kernel()
    return cpu.paged_attention_cpu


@pytest.mark.parametrize("block_size,lens", SHAPES)
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_cpu_kernel_matches_float64_oracle(cpu_kernel, block_size, lens, num_kv_heads):
    """fp64 to 1e-12, fp32 to 1e-5 (its own arithmetic), bf16 (C++ too) to the bf16 tolerance; fp16 goes to the
    reference."""
    gen = _gen("cpu", block_size, num_kv_heads)
    q, kc, vc, table, ctx = make_paged(lens, 4, num_kv_heads, 16, block_size, torch.float64, gen)
    assert rel_err(cpu_kernel(q, kc, vc, table, ctx, 0.25), naive_attention_f64(q, kc, vc, table, ctx, 0.25)) < 1e-12
    for dtype in DTYPES:
        args = [x.to(dtype) for x in (q, kc, vc)]
        out = cpu_kernel(*args, table, ctx, 0.25)
        assert out.dtype == dtype and rel_err(out, naive_attention_f64(*args, table, ctx, 0.25)) < TOL[dtype]


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_cpu_kernel_compiled_head_dims_nan_safe(cpu_kernel, head_dim):
    """The kernel has compiled-in paths for head_dim 32, 64 and 128 (the tests above run the run-time one, 16): each
    matches float64 to 1e-12 (fp64) and 1e-5 (fp32), with every unused slot poisoned with NaN and one empty
    context, and softmax scores far apart (scale 2: exp underflows to 0 for most terms in fp32)."""
    gen = _gen("cpu-head-dims", head_dim)
    lens, bs = [37, 0, 5, 64, 16, 129], 16
    q, kc, vc, table, ctx = make_paged(lens, 8, 2, head_dim, bs, torch.float64, gen)
    poison_unused_slots(kc, vc, table, lens, bs)
    for scale in (head_dim ** -0.5, 2.0):
        oracle = naive_attention_f64(q, kc, vc, table, ctx, scale)
        assert rel_err(cpu_kernel(q, kc, vc, table, ctx, scale), oracle) < 1e-12
        out = cpu_kernel(q.float(), kc.float(), vc.float(), table, ctx, scale)
        assert torch.isfinite(out).all() and (out[1] == 0).all()
        assert rel_err(out, naive_attention_f64(q.float(), kc.float(), vc.float(), table, ctx, scale)) < TOL[torch.float32]


def refuse_fallbacks(monkeypatch) -> None:
    """Make :mod:`pagedattn.kernels.cpu`'s torch fallbacks raise: a test that passes ran the C++ kernels."""
    from pagedattn.kernels import cpu

    def refuse(*args, **kwargs):
        raise AssertionError("the CPU kernel fell back to the torch reference")

    monkeypatch.setattr(cpu, "paged_attention_ref", refuse)
    monkeypatch.setattr(cpu, "reshape_and_cache_ref", refuse)


# bf16 in the C++ kernel: (block_size, ragged context lengths, one empty), each with every unused slot poisoned
BF16_SHAPES = [(1, [1, 23, 40]), (16, [37, 0, 5, 64, 16, 129]), (64, [70, 65, 2]), (128, [3, 130, 40])]
# The kernel computes in fp32 and rounds its output to bf16 once: half a bf16 ulp (2^-9 relative) of each output,
# fp32 arithmetic far below that; a factor 2 for margin.
BF16_KERNEL_TOL = 2 ** -8


def check_bf16_kernel(kernel, head_dim: int, num_kv_heads: int, key: str) -> None:
    """The bf16 kernel on fresh bf16 inputs (8 query heads) against the float64 oracle on the same inputs, NaN in every
    slot no context uses, for each of BF16_SHAPES and two softmax scales (2.0: most terms underflow)."""
    for block_size, lens in BF16_SHAPES:
        gen = _gen(key, head_dim, num_kv_heads, block_size)
        q, kc, vc, table, ctx = make_paged(lens, 8, num_kv_heads, head_dim, block_size, torch.bfloat16, gen)
        poison_unused_slots(kc, vc, table, lens, block_size)
        for scale in (head_dim ** -0.5, 2.0):
            out = kernel(q, kc, vc, table, ctx, scale)
            assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
            assert (out[[i for i, n in enumerate(lens) if n == 0]] == 0).all()
            err = rel_err(out, naive_attention_f64(q, kc, vc, table, ctx, scale))
            assert err < BF16_KERNEL_TOL, (block_size, scale, err)


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])  # 16: the run-time head_dim path; 32-128 compiled in
@pytest.mark.parametrize("num_kv_heads", [8, 2, 1], ids=["MHA", "GQA4", "MQA"])
def test_cpu_kernel_bf16_matches_float64_nan_safe(cpu_kernel, monkeypatch, head_dim, num_kv_heads):
    """bf16 K/V cache, query and output, in C++ (not the reference): within half a bf16 ulp, twice, of float64."""
    refuse_fallbacks(monkeypatch)
    check_bf16_kernel(cpu_kernel, head_dim, num_kv_heads, "cpu-bf16")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_kernel_threads_give_the_same_bits(cpu_kernel, monkeypatch, dtype):
    """``set_threads(n)`` splits the batch into shares of about equal context run at once: the output is the one
    thread's, bit for bit (empty contexts included), for any number of threads up to more than the batch; a bad
    block id in any share is still refused."""
    from pagedattn.kernels import cpu

    refuse_fallbacks(monkeypatch)
    lens = [37, 0, 5, 64, 16, 129, 1, 90, 3]
    gen = torch.Generator().manual_seed(7)
    q, kc, vc, table, ctx = make_paged(lens, 8, 2, 32, 16, dtype, gen)
    poison_unused_slots(kc, vc, table, lens, 16)
    try:
        cpu.set_threads(1)
        one = cpu_kernel(q, kc, vc, table, ctx, 0.3)
        for n in (2, 3, 4, 12):
            cpu.set_threads(n)
            assert torch.equal(cpu_kernel(q, kc, vc, table, ctx, 0.3).view(torch.int16), one.view(torch.int16)) \
                if dtype == torch.bfloat16 else torch.equal(cpu_kernel(q, kc, vc, table, ctx, 0.3), one), n
        bad = table.clone()
        bad[-2, 0] = kc.shape[0]  # the second-to-last sequence's first block: past the cache
        with pytest.raises(ValueError, match="block"):
            cpu_kernel(q, kc, vc, bad, ctx, 0.3)
    finally:
        cpu.set_threads(1)
    with pytest.raises(ValueError, match="at least one thread"):
        cpu.set_threads(0)
    assert cpu._shares(torch.tensor([10, 10, 10, 10], dtype=torch.int32), 2) == [(0, 2), (2, 4)]
    assert cpu._shares(torch.tensor([0, 0], dtype=torch.int32), 2) == [(0, 2)]


def test_cpu_kernel_bf16_portable_build(cpu_kernel, monkeypatch, tmp_path):
    """The library built without ``-march=native`` (the build for a CPU or compiler without it: no AVX512_BF16 dot
    products) passes the same bf16 checks."""
    import ctypes

    from pagedattn.kernels import cpu

    cpu._build(cpu._compiler(), [], str(tmp_path / "portable.so"))
    dll = ctypes.CDLL(str(tmp_path / "portable.so"))
    assert cpu.bind(dll) is None
    monkeypatch.setattr(cpu, "load_library", lambda: dll)
    refuse_fallbacks(monkeypatch)
    for head_dim in (16, 32, 64):
        check_bf16_kernel(cpu.paged_attention_cpu, head_dim, 2, "cpu-bf16-portable")


def test_cpu_cache_write_bf16_rounds_as_torch(cpu_kernel, monkeypatch):
    """fp32 K/V rows written into a bf16 cache are rounded bit for bit as ``.to(torch.bfloat16)`` (to nearest, ties
    to even): random magnitudes across the fp32 range, exact ties, denormals, signed zeros, infinities, values that
    round up to infinity, NaN; rows taken from a view of a fused q|k|v. bf16 rows into a bf16 cache are copied."""
    from pagedattn.kernels.cpu import reshape_and_cache_cpu

    refuse_fallbacks(monkeypatch)
    gen = _gen("rc-bf16")
    kvh, d, bs, nb = 2, 32, 8, 40
    n, row = nb * bs, kvh * d
    wide = torch.randn(n * row, generator=gen) * torch.exp2(torch.randint(-149, 128, (n * row,), generator=gen)
                                                            .float()).clamp(max=2.0 ** 127)
    ties = (torch.randint(0, 2 ** 16, (n * row,), generator=gen, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-45, -3e-39, 3.3895e38, 3.4e38,
                            -3.4e38, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8])
    values = torch.where(torch.rand(n * row, generator=gen) < 0.5, wide, ties)
    values[:len(special)] = special
    qkv = torch.randn(n, 3 * row, generator=gen)
    qkv[:, row:2 * row] = values.view(n, row)
    key = qkv[:, row:2 * row].view(n, kvh, d)
    value = -key.contiguous()
    kc = torch.full((nb, bs, kvh, d), float("nan"), dtype=torch.bfloat16)
    vc = kc.clone()
    slots = torch.randperm(n, generator=gen)
    reshape_and_cache_cpu(key, value, kc, vc, slots)
    for src, cache in ((key, kc), (value, vc)):
        want = src.to(torch.bfloat16).view(torch.int16)
        assert torch.equal(cache.view(-1, kvh, d)[slots].view(torch.int16), want)
    kc2, vc2 = torch.full_like(kc, float("nan")), torch.full_like(vc, float("nan"))
    reshape_and_cache_cpu(key.to(torch.bfloat16), value.to(torch.bfloat16), kc2, vc2, slots)
    assert torch.equal(kc2.view(torch.int16), kc.view(torch.int16))
    assert torch.equal(vc2.view(torch.int16), vc.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_argmax_is_torch_max_indices(cpu_kernel, dtype):
    """Greedy decoding's C++ argmax equals ``max(dim=-1).indices``, in fp32 and on bf16 logits as they are (where
    rounding makes ties common): the first maximum on ties (also across its 64-float chunks), a NaN counting as the
    maximum (the first NaN), a row of -inf giving 0, odd widths; an empty vocabulary is a ValueError."""
    from pagedattn.kernels.cpu import argmax_cpu

    gen = _gen("argmax")
    for cols in (1, 63, 64, 65, 1000, 8192):
        x = torch.randn(9, cols, generator=gen)
        if cols > 1:
            x[1, cols // 2] = x[1, cols - 1] = x[1].max() + 1  # a tie: the first wins
            x[2, cols - 1] = x[2].max() + 1  # the maximum last
            x[3, 0] = float("inf")
            x[4, cols // 3] = float("nan")
            x[4, cols - 1] = float("nan")
            x[5, cols - 1] = float("nan")
            x[5, 0] = x[5].max() + 1
        x[6] = float("-inf")
        x[7] = 0.0
        x[7, -1] = -0.0
        x = x.to(dtype)
        assert torch.equal(argmax_cpu(x), x.max(dim=-1).indices), cols
    with pytest.raises(ValueError, match="empty"):
        argmax_cpu(torch.empty(2, 0))


def test_cpu_kernel_strided_query_and_bad_tables(cpu_kernel):
    """A query (and a new K/V row) that is a view of a fused qkv works; a block id outside the cache, a context longer
    than its table row or a slot past the cache is a ValueError, raised before anything is read or written."""
    gen = _gen("cpu-bad")
    q, kc, vc, table, ctx = make_paged([0, 21, 7], 4, 2, 16, 8, torch.float32, gen)
    qkv = torch.randn(3, 12, 16, generator=gen)
    assert rel_err(cpu_kernel(qkv[:, 4:8], kc, vc, table, ctx, 0.25),
                   naive_attention_f64(qkv[:, 4:8], kc, vc, table, ctx, 0.25)) < 1e-5
    from pagedattn.kernels.cpu import reshape_and_cache_cpu

    k_new = qkv[:, 8:10]  # a strided view, written row by row
    reshape_and_cache_cpu(k_new, k_new, kc, vc, torch.tensor([3, -1, 17]))
    assert torch.equal(kc.view(-1, 2, 16)[3], k_new[0]) and torch.equal(vc.view(-1, 2, 16)[17], k_new[2])
    with pytest.raises(ValueError, match="slot is past the cache"):
        reshape_and_cache_cpu(k_new, k_new, kc, vc, torch.tensor([0, 1, kc.shape[0] * kc.shape[1]]))
    bad = table.clone()
    bad[1, 1] = kc.shape[0]
    with pytest.raises(ValueError, match="not a block of the cache"):
        cpu_kernel(q, kc, vc, bad, ctx, 0.25)
    with pytest.raises(ValueError, match="longer than its block table"):
        cpu_kernel(q, kc, vc, table, torch.tensor([0, 8 * table.shape[1] + 1, 7]), 0.25)


def test_cpu_backend_falls_back_without_a_compiler(monkeypatch):
    """No compiler: a warning, ``available()`` False, "auto" is the torch reference and "cpu" says why it is off."""
    from pagedattn.kernels import cpu

    monkeypatch.setattr(cpu, "_compiler", lambda: None)
    cpu.load_library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
            assert not cpu.available()
        if not torch.cuda.is_available():
            assert kernels.get_backend("auto").name == "torch"
        with pytest.raises(RuntimeError, match="'cpu' backend's kernel is not available"):
            kernels.get_backend("cpu")
        gen = _gen("cpu-fallback")
        q, kc, vc, table, ctx = make_paged([5, 9], 4, 2, 8, 4, torch.float64, gen)
        assert rel_err(cpu.paged_attention_cpu(q, kc, vc, table, ctx, 0.3),
                       naive_attention_f64(q, kc, vc, table, ctx, 0.3)) < 1e-12
    finally:
        cpu.load_library.cache_clear()


def test_cpu_library_abi_is_checked_at_load(cpu_kernel):
    """The loaded library reports the ABI version the ctypes signatures were written for; a library that reports
    another version, or lacks a function, is refused with the reason."""
    from types import SimpleNamespace

    from pagedattn.kernels import cpu

    assert cpu.load_library().pagedattn_abi_version() == cpu.ABI_VERSION

    def lib(version, names=tuple(cpu._SIGNATURES)):
        funcs = {n: (lambda: 0) for n in names}
        return SimpleNamespace(pagedattn_abi_version=lambda: version, **funcs)

    assert cpu.bind(lib(cpu.ABI_VERSION)) is None
    assert cpu.bind(lib(cpu.ABI_VERSION + 1)) == f"ABI version {cpu.ABI_VERSION + 1}, expected {cpu.ABI_VERSION}"
    assert cpu.bind(lib(cpu.ABI_VERSION, names=("rope_f32",))).startswith("it exports no ")
    assert cpu.bind(SimpleNamespace()) == "it exports no pagedattn_abi_version()"


def test_cpu_library_cache_folder_and_pruning(monkeypatch, tmp_path):
    """The build cache follows $PAGEDATTN_CACHE_DIR, else $XDG_CACHE_HOME; a new build removes older builds that no
    one used for an hour, and keeps recent ones (another checkout may be using them)."""
    from pagedattn.kernels import cpu

    monkeypatch.delenv("PAGEDATTN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cpu.cache_dir() == tmp_path / "xdg" / "pagedattn"
    monkeypatch.setenv("PAGEDATTN_CACHE_DIR", str(tmp_path / "mine"))
    assert cpu.cache_dir() == tmp_path / "mine"
    new, recent, old, other = (tmp_path / n for n in ("cpu_attention_new.so", "cpu_attention_recent.so",
                                                      "cpu_attention_old.so", "unrelated.so"))
    for f in (new, recent, old, other):
        f.write_bytes(b"")
    day_ago = time.time() - 86400
    for f in (new, old, other):
        os.utime(f, (day_ago, day_ago))
    assert cpu.prune(tmp_path, keep=new) == [old]
    assert new.exists() and recent.exists() and other.exists() and not old.exists()


# ------------------------------------------------------------------------------------------ Triton attention


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1], ids=lambda k: f"gqa{4 // k}")
@pytest.mark.parametrize("block_size,lens", SHAPES, ids=[f"bs{b}" for b, _ in SHAPES])
def test_triton_paged_attention(triton_ops, dtype, num_kv_heads, block_size, lens):
    gen = _gen("triton", dtype, num_kv_heads, block_size)
    head_dim = 24 if block_size == 8 else 32  # one non-power-of-two head size (masked lanes)
    q, kc, vc, table, ctx = make_paged(lens, 4, num_kv_heads, head_dim, block_size, dtype, gen)
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    triton_ops.paged_attention(q, kc, vc, table, ctx, scale, split_kv=False, out=out)
    assert torch.isfinite(out).all()
    assert rel_err(out, naive_attention_f64(q, kc, vc, table, ctx, scale)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_kv_heads,block_size", [(4, 16), (2, 4), (1, 32)])
def test_triton_split_kv(triton_ops, dtype, num_kv_heads, block_size):
    """Flash-decoding path: partitions of 32 tokens, contexts spanning 1 to 5 partitions, plus the reduce."""
    gen = _gen("split", dtype, num_kv_heads, block_size)
    lens = [150, 31, 96, 65]
    q, kc, vc, table, ctx = make_paged(lens, 4, num_kv_heads, 32, block_size, dtype, gen)
    out = torch.full_like(q, float("nan"))
    triton_ops.paged_attention(q, kc, vc, table, ctx, 0.2, split_kv=True, partition_size=32, out=out)
    assert torch.isfinite(out).all()
    assert rel_err(out, naive_attention_f64(q, kc, vc, table, ctx, 0.2)) < TOL[dtype]


def test_triton_split_kv_more_partitions_than_one_reduce_chunk(triton_ops):
    """The reduce kernel reads the partitions 16 at a time: 300 tokens in 16-token partitions are 19 of them."""
    import pagedattn.kernels.paged_attention as mod

    assert mod._REDUCE_CHUNK < -(-300 // 16)
    gen = _gen("many-partitions")
    q, kc, vc, table, ctx = make_paged([300, 7, 260], 4, 2, 16, 16, torch.float32, gen)
    out = torch.full_like(q, float("nan"))
    triton_ops.paged_attention(q, kc, vc, table, ctx, 0.3, split_kv=True, partition_size=16, out=out)
    assert rel_err(out, naive_attention_f64(q, kc, vc, table, ctx, 0.3)) < TOL[torch.float32]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the compiled configuration is tested directly")
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_gpu_configuration_in_interpreter(triton_ops, dtype, monkeypatch):
    """The settings a GPU uses (its tiles, 4 heads per MHA program, the planned partitions, tl.dot on fp16 operands,
    IEEE fp32 dot), run in the interpreter: contexts of several partitions, GQA 4 (dot path) and 1 (MHA path)."""
    import pagedattn.kernels.paged_attention as mod

    monkeypatch.setattr(mod, "INTERPRET", False)
    for num_kv_heads in (1, 4):
        gen = _gen("gpu-config", dtype, num_kv_heads)
        q, kc, vc, table, ctx = make_paged([600, 70], 4, num_kv_heads, 32, 16, dtype, gen)
        oracle = naive_attention_f64(q, kc, vc, table, ctx, 0.2)
        for split in (False, True):
            out = torch.full_like(q, float("nan"))
            mod.paged_attention(q, kc, vc, table, ctx, 0.2, split_kv=split, out=out)
            assert rel_err(out, oracle) < TOL[dtype], (num_kv_heads, split)


def _decode_grid_cases() -> list[tuple]:
    """An all-pairs cover of the decode kernel's grid (issue 54): block size; kv heads (MHA with 3, 4 or 5 heads: the
    last program of 2 or 4 heads partly masked; GQA 4 over 2 kv heads; GQA 2 over 3); the interpreter's settings or a
    GPU's (``INTERPRET`` off: 4 heads per MHA program, 16-token MHA tiles, 32/64-token GQA tiles); single pass, the
    planned split or a forced one of 32-token partitions; dtype."""
    from pagedattn.repro.experiments.attention_kernel import all_pairs

    return all_pairs([[1, 16, 64], [(3, 3), (4, 4), (5, 5), (8, 2), (6, 3)], ["interpreter", "gpu"],
                      ["single", "planned", "forced32"], DTYPES])


@pytest.mark.parametrize("case", _decode_grid_cases(), ids=lambda c: "-".join(map(str, c)).replace("torch.", ""))
def test_triton_decode_grid_all_pairs(triton_ops, monkeypatch, case):
    import pagedattn.kernels.paged_attention as mod

    block_size, (num_heads, num_kv_heads), config, split, dtype = case
    if config == "gpu":
        if torch.cuda.is_available():
            pytest.skip("on a GPU the compiled configuration runs in the other tests")
        monkeypatch.setattr(mod, "INTERPRET", False)
        if dtype == torch.bfloat16 and num_heads > num_kv_heads:
            # the interpreter's tl.dot on bf16 operands is unreliable (module docstring): a GPU's bf16 GQA path
            # (bf16 dot operands) cannot run here; its fp16 twin runs instead, bf16 keeps its MHA GPU cases
            dtype = torch.float16
    gen = _gen("grid", *map(str, case))
    lens = [300, 7, 129] if split != "single" else [70, 1, 33]
    q, kc, vc, table, ctx = make_paged(lens, num_heads, num_kv_heads, 32, block_size, dtype, gen)
    kw = {"single": {"split_kv": False}, "planned": {}, "forced32": {"split_kv": True, "partition_size": 32}}[split]
    launches = mod.plan_paged_attention(q, kc, vc, table.to(torch.int32), ctx, 0.25, torch.empty_like(q), **kw)
    assert len(launches) == (2 if split != "single" else 1)  # the CPU's 8-SM wave always splits 3 sequences
    out = torch.full_like(q, float("nan"))
    mod.paged_attention(q, kc, vc, table, ctx, 0.25, out=out, **kw)
    assert torch.isfinite(out).all()
    assert rel_err(out, naive_attention_f64(q, kc, vc, table, ctx, 0.25)) < TOL[dtype]


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_unused_cache_slots_may_hold_nan(backend):
    """Slots past each context (tail of the last block, unreferenced blocks) are poisoned with NaN: never used."""
    if backend == "cpu":
        require_cpu_kernel()
    ops = kernels.get_backend(backend)
    gen = _gen("nan-slots", backend)
    lens, bs = [13, 30, 5], 8
    q, kc, vc, table, ctx = make_paged(lens, 4, 2, 16, bs, torch.float32, gen, share=False)
    oracle = naive_attention_f64(q, kc, vc, table, ctx, 0.25)
    poison_unused_slots(kc, vc, table, lens, bs)
    kw = {"split_kv": True, "partition_size": 16} if backend == "triton" else {}
    out = ops.paged_attention(q, kc, vc, table, ctx, 0.25, **kw)
    assert torch.isfinite(out).all()
    assert rel_err(out, oracle) < 1e-5


paged_case = st.fixed_dictionaries({
    "lens": st.lists(st.integers(0, 70), min_size=1, max_size=4).filter(lambda xs: max(xs) > 0),
    "block_size": st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128, 256]),
    "num_kv_heads": st.sampled_from([1, 2, 4]),
    "head_dim": st.sampled_from([8, 16, 24]),
    "seed": st.integers(0, 2**16),
})


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=paged_case)
def test_reference_property(case):
    """Any ragged batch (empty contexts included), block size and GQA ratio: the reference equals the oracle."""
    gen = torch.Generator().manual_seed(case["seed"])
    q, kc, vc, table, ctx = make_paged(case["lens"], 4, case["num_kv_heads"], case["head_dim"], case["block_size"],
                                       torch.float64, gen)
    out = paged_attention_ref(q, kc, vc, table, ctx, 0.3)
    assert rel_err(out, naive_attention_f64(q, kc, vc, table, ctx, 0.3)) < 1e-12


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=paged_case)
def test_cpu_kernel_property_nan_safe(cpu_kernel, case):
    """Any ragged batch, block size and GQA ratio, every slot outside a context poisoned with NaN: the kernel never
    reads one, and equals the float64 oracle."""
    gen = torch.Generator().manual_seed(case["seed"])
    q, kc, vc, table, ctx = make_paged(case["lens"], 4, case["num_kv_heads"], case["head_dim"], case["block_size"],
                                       torch.float64, gen)
    oracle = naive_attention_f64(q, kc, vc, table, ctx, 0.3)
    poison_unused_slots(kc, vc, table, case["lens"], case["block_size"])
    out = cpu_kernel(q, kc, vc, table, ctx, 0.3)
    assert torch.isfinite(out).all() and rel_err(out, oracle) < 1e-12


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=paged_case, split=st.booleans())
def test_triton_property(triton_ops, case, split):
    gen = torch.Generator().manual_seed(case["seed"])
    q, kc, vc, table, ctx = make_paged(case["lens"], 4, case["num_kv_heads"], case["head_dim"], case["block_size"],
                                       torch.float32, gen)
    out = torch.full_like(q, float("nan"))
    triton_ops.paged_attention(q, kc, vc, table, ctx, 0.3, split_kv=split, partition_size=32, out=out)
    assert rel_err(out, naive_attention_f64(q, kc, vc, table, ctx, 0.3)) < 1e-5


def test_split_kv_heuristic():
    """FlashInfer-style planning (the CPU stands for 8 SMs, 4 programs each: a wave of 32 programs): split only a
    grid smaller than the wave, into the smallest power-of-two partition from 128 tokens that keeps it in one wave."""
    from pagedattn.kernels.paged_attention import split_partition, use_split_kv

    cpu = torch.device("cpu")
    assert use_split_kv(1, 8, 8192, cpu)          # one long sequence: split
    assert not use_split_kv(1, 8, 128, cpu)       # fits the smallest partition: no split
    assert not use_split_kv(256, 8, 8192, cpu)    # the grid already fills the device
    assert not use_split_kv(8, 40, 1024, cpu, heads_per_program=4)  # 80 programs: a wave already
    assert split_partition(1, 8, 8192, cpu) == 2048   # 8 programs x 4 partitions = the wave
    assert split_partition(2, 4, 1000, cpu) == 256    # 8 x 4 partitions of 256 (128 would make 64)
    assert split_partition(1, 1, 300, cpu) == 128     # the smallest partition
    assert split_partition(4, 8, 4096, cpu) is None   # 32 programs: no room to split


def test_triton_empty_context_and_strided_query(triton_ops):
    """A zero-length context yields zeros; a query that is a strided view (a slice of a fused qkv) works."""
    gen = _gen("strided")
    q, kc, vc, table, ctx = make_paged([0, 21, 7], 4, 2, 16, 8, torch.float32, gen)
    qkv = torch.randn(3, 3 * 4, 16, generator=gen).to(DEVICE)
    q = qkv[:, 4:8]  # non-contiguous view
    assert not q.is_contiguous()
    oracle = naive_attention_f64(q, kc, vc, table, ctx, 0.25)
    for split in (False, True):
        out = torch.full((3, 4, 16), float("nan"), device=DEVICE)
        triton_ops.paged_attention(q, kc, vc, table, ctx, 0.25, split_kv=split, partition_size=16, out=out)
        assert (out[0] == 0).all()
        assert rel_err(out, oracle) < 1e-5


# ------------------------------------------------------------------------------------------ cache writes and copies


def _slots_case(gen, num_blocks=7, block_size=4, num_tokens=11):
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].clone()
    slots[[1, 6]] = -1  # padding tokens
    return slots


@pytest.mark.parametrize("backend,dtype", [(b, d) for b in ("torch", "cpu", "triton") for d in DTYPES + [torch.float64]
                                           if not (b == "triton" and d == torch.float64)],  # Triton: fp32/16/bf16
                         ids=str)
def test_reshape_and_cache(backend, dtype):
    if backend == "cpu":
        require_cpu_kernel()
    ops = kernels.get_backend(backend)
    gen = _gen("rc", dtype)
    nb, bs, kvh, d = 7, 4, 3, 24
    slots = _slots_case(gen, nb, bs)
    key = torch.randn(len(slots), kvh, d, generator=gen).to(dtype)
    value = torch.randn(len(slots), kvh, d, generator=gen).to(dtype)
    kc = torch.full((nb, bs, kvh, d), float("nan"), dtype=dtype)
    vc = torch.full_like(kc, float("nan"))
    ops.reshape_and_cache(key.to(DEVICE), value.to(DEVICE), kc_d := kc.to(DEVICE), vc_d := vc.to(DEVICE),
                          slots.to(DEVICE))
    kc, vc = kc_d.cpu(), vc_d.cpu()
    written = torch.zeros(nb * bs, dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        written[s] = True
        assert torch.equal(kc[s // bs, s % bs], key[t]) and torch.equal(vc[s // bs, s % bs], value[t])
    assert kc.flatten(0, 1)[~written].isnan().all()  # nothing else touched, padding skipped
    assert vc.flatten(0, 1)[~written].isnan().all()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_copy_blocks(backend, dtype):
    ops = kernels.get_backend(backend)
    gen = _gen("cb", dtype)
    layers = 3
    kcs = [torch.randn(8, 4, 2, 8, generator=gen).to(dtype).to(DEVICE) for _ in range(layers)]
    vcs = [torch.randn(8, 4, 2, 8, generator=gen).to(dtype).to(DEVICE) for _ in range(layers)]
    before_k, before_v = [x.clone() for x in kcs], [x.clone() for x in vcs]
    mapping = torch.tensor([[5, 0], [2, 7], [5, 3]], dtype=torch.long)  # one source forked twice
    ops.copy_blocks(kcs, vcs, mapping.to(DEVICE))
    for after, before in zip(kcs + vcs, before_k + before_v):
        expect = before.clone()
        for src, dst in mapping.tolist():
            expect[dst] = before[src]
        assert torch.equal(after, expect)


def test_copy_blocks_accepts_pairs_and_dict():
    kc = [torch.arange(4 * 2 * 1 * 2, dtype=torch.float32).view(4, 2, 1, 2)]
    vc = [kc[0].clone() * 10]
    copy_blocks_ref(kc, vc, {0: [2, 3]})
    assert torch.equal(kc[0][2], kc[0][0]) and torch.equal(vc[0][3], vc[0][0])
    copy_blocks_ref(kc, vc, [(1, 0)])
    assert torch.equal(kc[0][0], kc[0][1])


def test_swap_blocks_roundtrip():
    gen = _gen("swap")
    device_cache = torch.randn(6, 4, 2, 8, generator=gen).to(DEVICE)
    cpu_cache = torch.zeros(3, 4, 2, 8)
    swap_blocks_ref(device_cache, cpu_cache, torch.tensor([[4, 0], [1, 2]]))  # swap out
    assert torch.equal(cpu_cache[0], device_cache[4].cpu()) and torch.equal(cpu_cache[2], device_cache[1].cpu())
    restored = torch.zeros_like(device_cache)
    kernels.get_backend("triton" if DEVICE == "cuda" else "torch").swap_blocks(cpu_cache, restored, [(0, 5)])
    assert torch.equal(restored[5], device_cache[4])


def test_reference_write_then_attend_matches_contiguous_sdpa():
    """End to end on the reference: write a prompt through slots, then decode attention equals SDPA."""
    gen = _gen("e2e")
    bs, kvh, heads, d, n = 4, 2, 4, 16, 13
    kc = torch.zeros(6, bs, kvh, d)
    vc = torch.zeros_like(kc)
    blocks = [5, 1, 3, 0]
    slots = torch.tensor([blocks[t // bs] * bs + t % bs for t in range(n)])
    k, v = torch.randn(n, kvh, d, generator=gen), torch.randn(n, kvh, d, generator=gen)
    reshape_and_cache_ref(k, v, kc, vc, slots)
    q = torch.randn(1, heads, d, generator=gen)
    out = paged_attention_ref(q, kc, vc, torch.tensor([blocks], dtype=torch.int32), torch.tensor([n]), d ** -0.5)
    rep = heads // kvh
    k_full = k.repeat_interleave(rep, 1).transpose(0, 1)[None]  # [1, heads, n, d]
    v_full = v.repeat_interleave(rep, 1).transpose(0, 1)[None]
    sdpa = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k_full, v_full)
    assert torch.allclose(out, sdpa[:, :, 0], atol=1e-5)


def test_backend_selector():
    assert kernels.get_backend("torch").paged_attention is paged_attention_ref
    auto = kernels.get_backend("auto")
    from pagedattn.kernels import cpu

    assert auto.name == ("triton" if torch.cuda.is_available() else "cpu" if cpu.available() else "torch")
    with pytest.raises(ValueError):
        kernels.get_backend("cuda-graphs")


def test_reference_works_outside_inference_mode_after_inside():
    """The engine decodes under ``inference_mode``; the reference's reused CPU buffers must not leak into calls
    made outside it (a buffer made there is an inference tensor and cannot be written later)."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 8, generator=g)
    kc, vc = torch.randn(10, 4, 4, 8, generator=g), torch.randn(10, 4, 4, 8, generator=g)
    bt, cl = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([5, 7], dtype=torch.int32)
    with torch.inference_mode():
        inside = paged_attention_ref(q, kc, vc, bt, cl, 0.3)
    outside = paged_attention_ref(q, kc, vc, bt, cl, 0.3)
    assert torch.equal(inside, outside)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=2, max_size=5))
def test_all_pairs_covers_every_pair_of_values(levels):
    """The interpreted correctness sweep's cases (``attention_kernel.all_pairs``): every value of each factor with
    every value of each other factor in some case, every case a combination of the factors' values, no case twice,
    and never more cases than the whole product; the notebook's grid (8 x 4 x 2 x 3) in 32 cases."""
    import itertools
    import math

    from pagedattn.repro.experiments.attention_kernel import all_pairs

    factors = [[f"f{k}v{v}" for v in range(n)] for k, n in enumerate(levels)]
    rows = all_pairs(factors)
    assert len(rows) == len(set(rows)) <= math.prod(levels)
    assert all(len(r) == len(factors) and all(x in f for x, f in zip(r, factors)) for r in rows)
    for i, j in itertools.combinations(range(len(factors)), 2):
        assert {(r[i], r[j]) for r in rows} == set(itertools.product(factors[i], factors[j]))
    assert len(all_pairs([list(range(8)), list(range(4)), list(range(2)), list(range(3))])) == 32
