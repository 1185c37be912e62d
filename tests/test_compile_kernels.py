"""Ahead-of-time compile checks of the Triton kernels for sm_80 and sm_90, without a GPU (§4.1, §5.1).

The quick grid of :mod:`pagedattn.kernels.compile_check` runs in a subprocess (the kernels must be defined compiled,
while this test session defines them interpreted): every kernel compiles to a cubin for both targets, within the
target's shared-memory and register-file limits, and the engine's fp16/bf16 configurations spill no registers.
``make kernels-compile`` runs the full grid.
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")

from pagedattn.kernels import compile_check  # noqa: E402
from pagedattn.kernels.aot import parse_ptxas_log  # noqa: E402

PTXAS_LOG = """ptxas info    : Compiling entry function '_paged_attn_kernel' for 'sm_80'
ptxas info    : Function properties for _paged_attn_kernel
    776 bytes stack frame, 800 bytes spill stores, 788 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 776 bytes cumulative stack size, 512 bytes cmem[0]
"""


def test_parse_ptxas_log():
    assert parse_ptxas_log(PTXAS_LOG) == {"registers": 255, "spill_stores": 800, "spill_loads": 788,
                                          "stack_frame": 776}
    assert parse_ptxas_log("ptxas info    : Used 40 registers")["spill_stores"] == 0
    with pytest.raises(ValueError):
        parse_ptxas_log("no entry function")


def test_quick_grid_covers_the_engine_configurations():
    cases = compile_check.grid(full=False)
    assert {c.family for c in cases} == set(compile_check.FAMILIES)
    att = [c for c in cases if c.family == "attention" and c.engine]
    assert {c.dtype for c in att} == {"float16", "bfloat16"} and {c.group for c in att} == {1, 4}
    assert {c.split for c in att} == {False, True} and {c.block_size for c in att} == {8, 16, 32}
    assert set(compile_check.grid(full=False)) <= set(compile_check.grid(full=True))


def test_launch_plans_on_meta_tensors():
    """The checks compile what the wrappers plan: the split path plans the split pass and the reduce."""
    case = compile_check.Case("attention", "float16", 128, 16, group=4, split=True)
    launches = compile_check.case_launches(case)
    assert [name for name, _ in launches] == ["paged_attn", "paged_attn_reduce"]
    att = launches[0][1]
    assert att.constexprs["SPLIT"] and att.constexprs["GROUP"] == 4 and att.constexprs["BLOCK_SIZE"] == 16
    assert att.grid == (compile_check.NUM_SEQS, compile_check.NUM_KV_HEADS, -(-2000 // 512))


@pytest.mark.slow  # ~15 s of Triton compiles in a subprocess: CI runs it, the fast tier leaves it out
def test_quick_compile_grid():
    rc, df = compile_check.run_subprocess(full=False, timeout=900)
    assert set(df.target) == {"sm_80", "sm_90"}
    assert set(df.kernel) == {"paged_attn", "paged_attn_reduce", "reshape_and_cache", "copy_blocks", "rms_norm", "rope",
                              "rope_and_cache"}
    assert (df.error == "").all(), df[df.error != ""].to_string()
    assert (df.problem == "").all(), df[df.problem != ""].to_string()
    engine = df[df.engine.astype(str) == "True"]
    assert len(engine) and (engine.spill_stores == 0).all() and (engine.spill_loads == 0).all()
    assert rc == 0


FMA_SCRIPT = """
import os
os.environ["TRITON_INTERPRET"] = "0"
from pagedattn.kernels import compile_check as cc
from pagedattn.kernels.aot import launch_ptx
for family in ("rope", "rope_and_cache"):
    (_, launch), = cc.case_launches(cc.Case(family, "float32", 128, 16))
    fused = launch_ptx(launch.__class__(**dict(vars(launch), fp_fusion=True)), 90)
    print(family, launch_ptx(launch, 90).count("fma.rn.f32"), fused.count("fma.rn.f32"))
"""


@pytest.mark.slow  # ~10 s of Triton compiles in a subprocess
def test_rope_launches_compile_without_fma_contraction():
    """The RoPE launches round ``x * cos`` and ``roll(x) * sin_rot`` apart before the sum, as torch's elementwise ops
    do: in fp32 on a GPU the compiler's default contraction into an FMA would round differently. Their plans switch
    it off (``fp_fusion=False``): no fp32 FMA in the PTX, where the default compile has some."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", FMA_SCRIPT], capture_output=True, text=True, timeout=600, check=True)
    counts = {line.split()[0]: tuple(map(int, line.split()[1:])) for line in out.stdout.splitlines()}
    assert set(counts) == {"rope", "rope_and_cache"}
    for family, (planned, default) in counts.items():
        assert planned == 0 and default > 0, (family, planned, default)


def test_summarize_counts_engine_spills_apart():
    import pandas as pd

    rows = [dict(target="sm_80", kernel="paged_attn", dtype="float16", engine=e, registers=r, spill_stores=s,
                 spill_loads=s, shared=2048, num_warps=4, num_stages=2, problem=p)
            for e, r, s, p in [(True, 100, 0, ""), (False, 255, 64, ""), (True, 255, 8, "spills")]]
    out = compile_check.summarize(pd.DataFrame(rows)).iloc[0]
    assert (out.variants, out.spilling, out.engine_spilling, out.failing) == (3, 2, 1, 1)
    assert out.max_registers == 255 and out.max_spill_bytes == 64 and out.max_shared_kb == 2.0
