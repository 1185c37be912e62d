"""Paged vs contiguous decode attention (Fig. 18a of Kwon et al., SOSP 2023; §5.1, §7.1).

A thin command-line wrapper over :mod:`pagedattn.repro.experiments.attention_kernel`. On a GPU it times the Triton paged
kernel (shuffled block table) against the same kernel on a contiguous layout (identity block table) and against
torch SDPA on contiguous K/V, and reports the achieved bandwidth against the device's measured copy bandwidth. On
a CPU it times the torch paths instead (torch reference paged attention vs torch SDPA), and says so.

Writes ``results/02_attention_kernel/bench_<hardware-slug>[_quick].json`` and ``.csv``.

    .venv/bin/python benchmarks/attention_kernel.py [--quick] [--device cuda] [--results-dir results]
"""
from __future__ import annotations

import argparse
import sys

from pagedattn.repro.experiments import attention_kernel as ak
from pagedattn.repro.report.results import RESULTS_DIR


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few points only (seconds)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--results-dir", default=str(RESULTS_DIR))
    ap.add_argument("--batch-sizes", type=int, nargs="*", help="override the batch sizes")
    ap.add_argument("--context-lens", type=int, nargs="*", help="override the context lengths")
    ap.add_argument("--block-sizes", type=int, nargs="*", help="override the block sizes")
    args = ap.parse_args(argv)

    device = args.device or ak.default_device()
    cfg = ak.default_config(device, args.quick)
    for name in ("batch_sizes", "context_lens", "block_sizes"):
        if getattr(args, name):
            setattr(cfg, name, tuple(getattr(args, name)))
    df, meta = ak.benchmark(quick=args.quick, device=device, cfg=cfg, progress=True)
    path = ak.save_benchmark(df, meta, args.results_dir)
    print(f"\nhardware: {meta['hardware']}  (backend: {meta['backend']})")
    print(f"note: {meta['note']}")
    print(f"ratio = {meta['paths']['ratio']}")
    if meta["copy_bandwidth_gbps"]:
        print(f"device copy bandwidth: {meta['copy_bandwidth_gbps']:.0f} GB/s")
    cols = ["batch", "context", "block_size", "paged_ms", "contig_layout_ms", "sdpa_ms", "ratio"]
    cols += [c for c in ("bandwidth_gbps", "bw_fraction") if c in df]
    print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    ratio = ak.fig18a_ratio(df)
    if ratio is not None:
        lo, hi = ak.FIG18A_PAGED_OVER_CONTIGUOUS
        print(f"\nFig. 18a points (batch 8/32, contexts 64-256, block 16): mean ratio {ratio:.3f} "
              f"(paper, GPU kernels: {lo:.2f}-{hi:.2f})")
    print(f"wrote {path} and {path.with_suffix('.csv')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
