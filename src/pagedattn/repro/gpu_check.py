"""Settle every GPU claim in one run (Kwon et al., SOSP 2023: §5.1 kernels, §7.1 Fig. 18a, §7.2 Fig. 18b, §7.3
Fig. 19), for the day a GPU is at hand::

    PYTHONPATH=src python3 -m pagedattn.repro.gpu_check          # or: make gpu
    PYTHONPATH=src python3 -m pagedattn.repro.gpu_check --dry-run   # what it would run (also what happens without CUDA)

Steps (each writes files labelled by the GPU's name; about 5 minutes on one H100-class GPU, mostly Triton compiles):

1. ``kernels``: the Triton paged-attention kernel on CUDA against the float64 reference, over block sizes 1-256,
   MHA and GQA 4, head dims 80 and 128, fp32/fp16/bf16, single pass and split-KV
   (``results/02_attention_kernel/correctness_<gpu>.csv``).
2. ``fig18a``: paged (shuffled block table) vs the same kernel on a contiguous layout vs torch SDPA, one OPT-13B
   layer in fp16, batch 8 and 32, contexts 64-4096, block sizes 1-256 (``bench_<gpu>.json``); fills
   ``paged_over_contiguous_latency.gpu`` and ``bandwidth_fraction.gpu`` in 02's summary, and writes the kernel's
   cost per block size relative to block 16 in the frame notebook 05's simulation consumes
   (``results/05_block_size/kernel_<gpu>.csv``, the columns of :func:`experiments.block_size.measure_kernel`).
3. ``engine_vs_hf``: the engine (Triton kernels) vs Hugging Face ``generate`` greedy, token for token, in fp16 and
   bf16, on a random-weight Llama with GQA (head dim 128) and an OPT (head dim 64).
4. ``swap``: Fig. 19a's microbenchmark: swap out + in of 1024 tokens' blocks between the GPU pool and pinned host
   memory over PCIe per block size, against recomputing them (one prefill); fills
   ``recompute_over_swap_latency.gpu.block{16,64}`` in 06's summary.

Everything goes to ``results/gpu_check/summary.json`` too (claims, timings, versions). Needs no registry and no
downloads; runs with torch 2.11-2.13, triton 3.6-3.9, transformers 5.17-5.23.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

STEPS = ("kernels", "fig18a", "engine_vs_hf", "swap")
#: the CUDA correctness grid (a Triton compile per variant keeps it this small: ~100 variants)
KERNEL_GRID = {"shapes": [(1, [1, 19, 47]), (16, [40, 17, 3, 64, 700]), (32, [65, 31, 300]), (256, [100, 257])],
               "gqa": [1, 4], "head_dims": [80, 128], "num_heads": 8}
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SWAP_TOKENS = 1024
ENGINE_PROMPTS = 16
ENGINE_NEW_TOKENS = 16


@dataclass
class Step:
    name: str
    what: str
    writes: list[str]
    run: Callable[["Context"], dict]


@dataclass
class Context:
    results_dir: Path
    device: str = "cuda"
    hardware: str = ""
    slug: str = ""
    claims: dict = field(default_factory=dict)  # summary experiment -> [Claim]


# ---------------------------------------------------------------------------------------------------- steps
def step_kernels(ctx: Context) -> dict:
    from pagedattn.repro.experiments.attention_kernel import EXPERIMENT, correctness_sweep

    df = correctness_sweep(quick=False, backends=("triton",), grid=KERNEL_GRID)
    path = ctx.results_dir / EXPERIMENT / f"correctness_{ctx.slug}.csv"
    df.assign(hardware=ctx.hardware).to_csv(path, index=False)
    worst = df.groupby("dtype").max_rel_err.max().to_dict()
    return {"cases": len(df), "all_ok": bool(df.ok.all()), "failing": int((~df.ok).sum()), "max_rel_err": worst,
            "file": str(path)}


def kernel_per_block_size(df):
    """Fig. 18a's benchmark rows -> the frame notebook 05's kernel multiplier consumes (batch 8, contexts that are
    multiples of 256, so no block is partly filled): ``ms`` and ``ratio_to_block16`` per block size."""
    import pandas as pd

    rows = []
    sel = df[(df.batch == 8) & (df.context % 256 == 0)]
    for ctx_len, d in sel.groupby("context"):
        d = d.set_index("block_size")
        if 16 not in d.index:
            continue
        for bs, r in d.iterrows():
            ratio = float(r.paged_ms / d.loc[16, "paged_ms"])
            rows.append({"batch": 8, "context": int(ctx_len), "block_size": int(bs), "ms": float(r.paged_ms),
                         "ms_per_1k_tokens": float(r.paged_ms) / (8 * ctx_len / 1000), "ratio_to_block16": ratio,
                         "ratio_min": ratio, "ratio_max": ratio, "rounds": 1})
    return pd.DataFrame(rows)


def step_fig18a(ctx: Context) -> dict:
    from pagedattn.repro.experiments import attention_kernel as ak
    from pagedattn.repro.results import Claim

    cfg = ak.BenchConfig(block_sizes=BLOCK_SIZES)
    df, meta = ak.benchmark(quick=False, device=ctx.device, cfg=cfg)
    path = ak.save_benchmark(df, meta, ctx.results_dir)
    nulls = [Claim(f"{key}.gpu", None, None) for key in ("paged_over_contiguous_latency", "bandwidth_fraction")]
    measured = ak.with_gpu_claims(nulls, {meta["hardware_slug"]: {"meta": meta, "df": df, "path": path}})
    ctx.claims.setdefault(ak.EXPERIMENT, []).extend(measured)  # the stable names of DESIGN.md, hardware in the note
    measured = {c.name.split(".")[0]: c for c in measured}
    per_bs = kernel_per_block_size(df)
    bs_path = ctx.results_dir / "05_block_size" / f"kernel_{ctx.slug}.csv"
    bs_path.parent.mkdir(parents=True, exist_ok=True)
    per_bs.to_csv(bs_path, index=False)
    return {"benchmark": str(path), "per_block_size": str(bs_path), "rows": len(df),
            "ratio_fig18a": measured["paged_over_contiguous_latency"].ours,
            "bandwidth_fraction": measured["bandwidth_fraction"].ours,
            "copy_bandwidth_gbps": meta["copy_bandwidth_gbps"]}


def engine_models(device: str = "cpu"):
    """The two random-weight models of the equivalence check: a Llama with GQA (8 query heads over 4 kv heads,
    head dim 128) and an OPT (4 heads, head dim 64); ``initializer_range`` / ``init_std`` 0.2 keeps greedy decoding
    away from near-ties."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=2048,
                                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                         max_position_embeddings=256, initializer_range=0.2))
    opt = OPTForCausalLM(OPTConfig(vocab_size=512, hidden_size=256, ffn_dim=512, num_hidden_layers=2,
                                   num_attention_heads=4, max_position_embeddings=256, init_std=0.2,
                                   word_embed_proj_dim=256))
    return {"llama_gqa_d128": llama.eval().to(device), "opt_d64": opt.eval().to(device)}


def step_engine_vs_hf(ctx: Context) -> dict:
    import torch

    from pagedattn.baselines.hf import generate_static
    from pagedattn.llm import LLM
    from pagedattn.repro.results import Claim
    from pagedattn.sequence import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 100, (ENGINE_PROMPTS,), generator=g)]
    sp = SamplingParams(temperature=0, max_tokens=ENGINE_NEW_TOKENS, ignore_eos=True)
    out = {}
    for dtype in (torch.float16, torch.bfloat16):
        dname = str(dtype).replace("torch.", "")
        same = total = 0
        for name, hf in engine_models(ctx.device).items():
            hf = hf.to(dtype)
            # unpadded: one prompt per generate() call
            ref = generate_static(hf, prompts, [ENGINE_NEW_TOKENS] * len(prompts), batch_size=1)["outputs"]
            llm = LLM(hf, block_size=16, attention_backend="triton", num_gpu_blocks=512)
            ours = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
            first_diff = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(ours, ref)]
            out[f"{name}.{dname}"] = {"identical": sum(d is None for d in first_diff), "prompts": len(prompts),
                                      "first_divergence": [d for d in first_diff if d is not None]}
            same += sum(d is None for d in first_diff)
            total += len(prompts)
            del llm
        ctx.claims.setdefault("gpu_check", []).append(Claim(
            f"engine_matches_hf_greedy.gpu.{dname}", None, round(same / total, 4), "of prompts token-identical",
            "ours == 1", same == total,
            f"{ctx.hardware}: engine with the Triton kernels vs HF generate(do_sample=False), {total} prompts x "
            f"{ENGINE_NEW_TOKENS} tokens over a random-weight Llama (GQA 8/4, head dim 128) and OPT (head dim 64)"))
    return out


def step_swap(ctx: Context) -> dict:
    import pandas as pd
    import torch

    from pagedattn.repro.experiments import preemption as pe

    p = pe.Params()
    hf = pe.micro_model(p, SWAP_TOKENS + 16).to(ctx.device, torch.float16)
    recompute = pe.micro_recompute(hf, SWAP_TOKENS, p.micro_reps, p.seed, device=ctx.device)
    rows = [pe.micro_swap(hf, bs, SWAP_TOKENS, p.micro_reps, p.seed, device=ctx.device) for bs in BLOCK_SIZES]
    df = pd.DataFrame(rows).assign(scale=f"GPU (measured): {ctx.hardware}", tokens=SWAP_TOKENS, recompute_ms=recompute)
    df["recompute_over_swap"] = df.recompute_ms / df.swap_ms
    path = ctx.results_dir / pe.EXPERIMENT / f"micro_{ctx.slug}.csv"
    df.to_csv(path, index=False)
    ratio = df.set_index("block_size").recompute_over_swap
    ctx.claims.setdefault(pe.EXPERIMENT, []).extend(pe.gpu_claims(df))
    return {"file": str(path), "recompute_ms": recompute, "recompute_over_swap": ratio.round(4).to_dict()}


def steps() -> list[Step]:
    return [
        Step("kernels", "Triton paged attention on CUDA vs float64: block sizes "
             f"{[s for s, _ in KERNEL_GRID['shapes']]}, GQA {KERNEL_GRID['gqa']}, "
             f"head dims {KERNEL_GRID['head_dims']}, fp32/fp16/bf16, single pass and split-KV",
             ["02_attention_kernel/correctness_<gpu>.csv"], step_kernels),
        Step("fig18a", f"Fig. 18a: paged vs contiguous layout vs SDPA, OPT-13B layer fp16, batch 8/32, contexts "
             f"64-4096, block sizes {list(BLOCK_SIZES)}; bandwidth fraction; per-block-size cost for notebook 05",
             ["02_attention_kernel/bench_<gpu>.json", "05_block_size/kernel_<gpu>.csv",
              "02_attention_kernel/summary.json (paged_over_contiguous_latency.gpu, bandwidth_fraction.gpu)"],
             step_fig18a),
        Step("engine_vs_hf", f"engine (Triton) vs HF generate greedy, fp16 and bf16, {ENGINE_PROMPTS} prompts x "
             f"{ENGINE_NEW_TOKENS} tokens, Llama GQA d128 and OPT d64",
             ["gpu_check/summary.json (engine_matches_hf_greedy.gpu.{float16,bfloat16})"], step_engine_vs_hf),
        Step("swap", f"Fig. 19a: swap out + in of {SWAP_TOKENS} tokens over PCIe (pinned host memory) per block size "
             f"{list(BLOCK_SIZES)} vs one prefill", ["06_preemption/micro_<gpu>.csv",
                                                     "06_preemption/summary.json (recompute_over_swap_latency.gpu.*)"],
             step_swap),
    ]


# ---------------------------------------------------------------------------------------------------- claims
def fill_claims(summary: Path, claims: list, hardware: str) -> None:
    """Replace the claims of the same name in an experiment's ``summary.json`` (or add them), and record the GPU
    run under ``extra.gpu_check``; the file's other claims and fields stay as they are."""
    from pagedattn.repro.results import json_safe, today

    doc = json.loads(summary.read_text())
    new = {c.name: json_safe(asdict(c)) for c in claims}
    doc["claims"] = [new.pop(c["name"], c) for c in doc["claims"]] + list(new.values())
    doc.setdefault("extra", {})["gpu_check"] = {"hardware": hardware, "date": today(),
                                                "claims": sorted(c.name for c in claims)}
    summary.write_text(json.dumps(doc, indent=2) + "\n")


def dry_run(selected: list[Step], results_dir: Path) -> None:
    """List what a GPU run would do, and build what can be built without one (configs, the models on the CPU)."""
    from pagedattn.repro.experiments import attention_kernel as ak

    ak.BenchConfig(block_sizes=BLOCK_SIZES)
    models = engine_models("cpu") if any(s.name == "engine_vs_hf" for s in selected) else {}
    print(f"dry run: no GPU work; results would go under {results_dir}")
    for i, s in enumerate(selected, 1):
        print(f"{i}. {s.name}: {s.what}")
        for w in s.writes:
            print(f"     writes {w}")
    for name, m in models.items():
        c = m.config
        print(f"   model {name}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
              f"{c.num_attention_heads} heads (head dim {c.hidden_size // c.num_attention_heads})")


def main(argv: Optional[list[str]] = None) -> int:
    import torch

    from pagedattn.repro.experiments.attention_kernel import hardware_slug
    from pagedattn.repro.results import RESULTS_DIR, hardware_label, write_summary

    ap = argparse.ArgumentParser(prog="python -m pagedattn.repro.gpu_check", description=__doc__.split("\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="list the steps and exit (the default without CUDA)")
    ap.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps of {STEPS}")
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args(argv)
    wanted = [s for s in args.only.split(",") if s]
    unknown = sorted(set(wanted) - set(STEPS))
    if unknown:
        ap.error(f"unknown step(s) {unknown}; choose from {STEPS}")
    selected = [s for s in steps() if s.name in wanted]
    if args.dry_run or not torch.cuda.is_available():
        if not args.dry_run:
            print("no CUDA device: dry run")
        dry_run(selected, args.results_dir)
        return 0

    import triton
    import transformers

    hw = hardware_label("cuda")
    ctx = Context(args.results_dir, "cuda", hw, hardware_slug(hw))
    report = {"hardware": hw, "torch": torch.__version__, "triton": triton.__version__,
              "transformers": transformers.__version__, "steps": {}}
    t_all = time.perf_counter()
    for s in selected:
        print(f"[{s.name}] {s.what}", flush=True)
        t0 = time.perf_counter()
        result = s.run(ctx)
        report["steps"][s.name] = dict(result, seconds=round(time.perf_counter() - t0, 1))
        print(f"[{s.name}] {time.perf_counter() - t0:.0f} s: {json.dumps(result, default=str)[:400]}", flush=True)
    report["seconds"] = round(time.perf_counter() - t_all, 1)
    for experiment, claims in ctx.claims.items():
        if experiment != "gpu_check":
            fill_claims(ctx.results_dir / experiment / "summary.json", claims, hw)
    write_summary(ctx.results_dir / "gpu_check", "gpu_check", hw, "see extra.steps", False,
                  [c for cl in ctx.claims.values() for c in cl], extra=report)
    print(f"done in {report['seconds']:.0f} s; commit results/ (02, 05, 06, gpu_check) and run "
          "`python -m pagedattn.repro.results` to refresh SUMMARY.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
