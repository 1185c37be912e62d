"""Generated tokens/s of our engine vs Hugging Face ``generate()`` and HF continuous batching, side by side.

All three run the same random-weight tiny Llama (GQA) on the same prompts (random tokens; lengths from the
real ShareGPT trace of pagedattn.workloads, cl100k tokens, 4-256 tokens, by default) with greedy decoding of exactly
``--output-len`` tokens per prompt (EOS ignored), at each batch size: our ``LLM`` with ``max_num_seqs = batch``;
HF ``generate()`` on one left-padded static batch (its contiguous KV cache); HF's own continuous batching
(``model.generate_batch`` with a ``ContinuousBatchingConfig`` sized like our KV pool). Every system is timed
``--repeats`` times, interleaved, after a warm-up run; the best run counts (the CPU is shared, so the minimum is
the least noisy estimate). Also reported: the share of our engine's step time spent outside the model forward
(scheduling, block tables, sampling, outputs), and whether our tokens equal HF ``generate()``'s.

    .venv/bin/python benchmarks/engine_vs_hf.py            # writes results/benchmarks/engine_vs_hf.json
    .venv/bin/python benchmarks/engine_vs_hf.py --quick    # a smoke run (not written unless --out is given)
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from pagedattn.engine import LLM
from pagedattn.results import REPO_ROOT, hardware_label, today
from pagedattn.sequence import SamplingParams

MODEL = dict(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=1024, initializer_range=0.2)


def make_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**MODEL)).eval()


def make_prompts(n: int, min_len: int, max_len: int, seed: int = 0, dist: str = "sharegpt") -> list[list[int]]:
    """``n`` random-token prompts whose lengths follow a trace of ``pagedattn.workloads`` (default: real ShareGPT, the
    paper's main workload, §6.1; ``"sharegpt_synthetic"``: the log-normal trace matched to Fig. 11's means),
    kept within ``[min_len, max_len]``, or are uniform in that range (``dist="uniform"``)."""
    g = torch.Generator().manual_seed(seed)
    if dist == "uniform":
        lens = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    else:
        from pagedattn.workloads import sample_lengths

        pool, _ = sample_lengths(dist, 20 * n + 100, seed=seed)
        lens = [int(x) for x in pool if min_len <= x <= max_len][:n]
        if len(lens) < n:
            raise ValueError(f"too few {dist} prompt lengths in [{min_len}, {max_len}]")
    return [torch.randint(3, MODEL["vocab_size"], (k,), generator=g).tolist() for k in lens]


class Timer:
    """Wall-clock and process CPU seconds (all threads) of a block; CPU time is less sensitive to other processes
    on a shared machine."""

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def run_ours(llm: LLM, prompts, out_len: int) -> tuple[Timer, list[list[int]], dict]:
    engine = llm.engine
    engine.step_metrics.clear()
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    with Timer() as t:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = t.wall
    m = engine.step_metrics
    step = sum(x.step_time for x in m)
    fwd = sum(x.forward_time for x in m)
    dec = [x for x in m if x.kind == "decode"]
    full = [x for x in dec if x.batch_size == len(prompts)]  # decode steps at the full batch
    stats = {"overhead_share": 1 - fwd / step,
             "overhead_share_decode": 1 - sum(x.forward_time for x in dec) / sum(x.step_time for x in dec),
             "overhead_share_full_batch_decode":
                 (1 - sum(x.forward_time for x in full) / sum(x.step_time for x in full)) if full else None,
             "mean_decode_step_ms": 1e3 * sum(x.step_time for x in dec) / len(dec),
             "mean_decode_forward_ms": 1e3 * sum(x.forward_time for x in dec) / len(dec),
             "num_steps": len(m), "wall_outside_steps_share": 1 - step / dt}
    return t, [o.outputs[0].token_ids for o in outs], stats


@torch.inference_mode()
def run_hf_generate(hf, prompts, out_len: int) -> tuple[Timer, list[list[int]]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with Timer() as t:
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=out_len, min_new_tokens=out_len,
                          do_sample=False, eos_token_id=None, pad_token_id=0)
    return t, out[:, width:].tolist()


def cb_config(batch: int, max_total_len: int, page_size: int = 64):
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    pages = batch * -(-max_total_len // page_size) + 4
    return ContinuousBatchingConfig(page_size=page_size, num_blocks=pages, max_batch_tokens=2048,
                                    max_requests_per_batch=batch)


@torch.inference_mode()
def run_hf_cb(hf, prompts, out_len: int) -> tuple[Timer, int]:
    from transformers import GenerationConfig

    gc = GenerationConfig(max_new_tokens=out_len, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cfg = cb_config(len(prompts), max(map(len, prompts)) + out_len)
    with Timer() as t:
        res = hf.generate_batch(prompts, generation_config=gc, continuous_batching_config=cfg, progress_bar=False,
                                warmup=False)
    return t, sum(len(r.generated_tokens) for r in res.values())


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--prompt-dist", default="sharegpt",
                    choices=["sharegpt", "sharegpt_synthetic", "alpaca", "uniform"],
                    help="prompt-length distribution (pagedattn.workloads), kept within --prompt-len")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[4, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for every system (default 1: on a shared 2-core VM, 2 threads "
                         "stall on each other's barriers whenever another process holds a core)")
    ap.add_argument("--no-cb", action="store_true", help="skip HF continuous batching")
    ap.add_argument("--quick", action="store_true", help="batch 8 and 16, 16 new tokens, 1 repeat")
    ap.add_argument("--out", default=None, help="JSON path (default: results/benchmarks/engine_vs_hf.json; "
                                                "--quick writes nothing unless given)")
    a = ap.parse_args(argv)
    if a.quick:
        a.batch_sizes, a.output_len, a.repeats = [8, 16], 16, 1
    torch.set_num_threads(a.threads)
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    hf = make_model()
    rows = []
    for batch in a.batch_sizes:
        prompts = make_prompts(batch, *a.prompt_len, seed=batch, dist=a.prompt_dist)
        llm = LLM(hf, max_num_seqs=batch)
        warm = prompts[: min(4, batch)]
        run_ours(llm, warm, 4)
        run_hf_generate(hf, warm, 4)
        cb_error = None
        if not a.no_cb:
            try:
                run_hf_cb(hf, warm, 4)
            except Exception as e:  # record why HF continuous batching could not run here
                cb_error = f"{type(e).__name__}: {e}"
        systems = ("ours", "hf_generate", "hf_continuous_batching")
        wall = {k: float("inf") for k in systems}
        cpu = {k: float("inf") for k in systems}
        stats, ours_tokens, hf_tokens, cb_tokens = None, None, None, batch * a.output_len

        def keep(name: str, t: Timer) -> bool:
            cpu[name] = min(cpu[name], t.cpu)
            if t.wall < wall[name]:
                wall[name] = t.wall
                return True
            return False

        for _ in range(a.repeats):
            t, ours_tokens, s = run_ours(llm, prompts, a.output_len)
            if keep("ours", t):
                stats = s
            t, hf_tokens = run_hf_generate(hf, prompts, a.output_len)
            keep("hf_generate", t)
            if not a.no_cb and cb_error is None:
                t, cb_tokens = run_hf_cb(hf, prompts, a.output_len)
                keep("hf_continuous_batching", t)
        n_tokens = batch * a.output_len
        counts = {"ours": n_tokens, "hf_generate": n_tokens, "hf_continuous_batching": cb_tokens}
        tps = {k: (counts[k] / wall[k] if wall[k] < float("inf") else None) for k in systems}
        tpc = {k: (counts[k] / cpu[k] if cpu[k] < float("inf") else None) for k in systems}
        plens = [len(p) for p in prompts]
        row = {"batch_size": batch, "num_prompts": batch, "generated_tokens": n_tokens,
               "prompt_len": {"mean": sum(plens) / batch, "min": min(plens), "max": max(plens)},
               "tokens_per_s": tps, "tokens_per_cpu_s": tpc,
               "seconds": {k: (v if v < float("inf") else None) for k, v in wall.items()},
               "hf_continuous_batching_error": cb_error,
               "tokens_equal_hf_generate": sum(x == y for x, y in zip(ours_tokens, hf_tokens)) / batch,
               "ours": stats}
        row["speedup"] = {"vs_hf_generate": tps["ours"] / tps["hf_generate"],
                          "vs_hf_continuous_batching": (tps["ours"] / tps["hf_continuous_batching"])
                          if tps["hf_continuous_batching"] else None,
                          "cpu_time_vs_hf_generate": tpc["ours"] / tpc["hf_generate"],
                          "cpu_time_vs_hf_continuous_batching": (tpc["ours"] / tpc["hf_continuous_batching"])
                          if tpc["hf_continuous_batching"] else None}
        rows.append(row)
        cb = tps["hf_continuous_batching"]
        sp_ = row["speedup"]
        ratio = lambda x: "n/a" if x is None else f"{x:.2f}x"  # noqa: E731
        print(f"batch {batch:3d}: ours {tps['ours']:8.1f} tok/s | HF generate {tps['hf_generate']:8.1f} tok/s | "
              f"HF continuous batching {'n/a' if cb is None else f'{cb:.1f}'} tok/s | speedup "
              f"{ratio(sp_['vs_hf_generate'])} / {ratio(sp_['vs_hf_continuous_batching'])} | overhead outside "
              f"forward {100 * stats['overhead_share']:.1f}% (decode {100 * stats['overhead_share_decode']:.1f}%) | "
              f"tokens equal HF: {100 * row['tokens_equal_hf_generate']:.0f}% | per CPU-second: "
              f"{ratio(sp_['cpu_time_vs_hf_generate'])} / {ratio(sp_['cpu_time_vs_hf_continuous_batching'])}",
              flush=True)
    import transformers

    summary = {"benchmark": "engine_vs_hf", "date": today(), "hardware": hardware_label("cpu"),
               "torch": torch.__version__, "transformers": transformers.__version__,
               "torch_threads": torch.get_num_threads(),
               "model": {"arch": "LlamaForCausalLM (random weights)", "dtype": "float32", **MODEL},
               "workload": {"prompt_dist": a.prompt_dist, "prompt_len_bounds": a.prompt_len,
                            "output_len": a.output_len, "decoding": "greedy, ignore_eos",
                            "repeats": a.repeats,
                            "timing": "best of repeats, systems interleaved; tokens_per_s is wall clock, "
                                      "tokens_per_cpu_s divides by the process CPU time (all threads)"},
               "engine": {"block_size": 16, "attention_backend": "torch", "max_num_seqs": "= batch size"},
               "hf_continuous_batching_config": {"page_size": 64, "max_batch_tokens": 2048,
                                                 "num_blocks": "batch * ceil(max_total_len / 64) + 4",
                                                 "max_requests_per_batch": "= batch size"},
               "load_average_1min": {"before": load_before,
                                     "after": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                                     "note": "other processes share the CPU; ratios interleaved within a run are "
                                             "comparable, absolute tokens/s across runs are not"},
               "batch_sizes": a.batch_sizes, "rows": rows}
    out = a.out or (None if a.quick else REPO_ROOT / "results" / "benchmarks" / "engine_vs_hf.json")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {out}")
    return summary


if __name__ == "__main__":
    main()
