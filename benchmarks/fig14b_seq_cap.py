"""Does the cap on the batch (``max_num_seqs``) flatten Fig. 14b's beam-search gain? (§6.3, Fig. 14b; notebook 11)

Notebook 11 finds ours over Orca (Oracle) at beam widths 2 / 4 / 6 with no rise across widths, where the paper's
gain rises. With beams, ``max_num_seqs`` (256, vLLM's default, which the notebook keeps) counts beams, so ours may
stop at 256 / width requests in a batch while memory is left. This script reruns notebook 11's gains, n = 1 and
every beam width (``gain_sources.seq_cap_gains``: the same traces, rule, cost model and beam model as
``fig14_curves``) with the simulator's ``max_num_seqs`` at 256 and at a cap that no run reaches, side by side, and
writes ``results/benchmarks/fig14b_seq_cap.json``.

    PYTHONPATH=src .venv/bin/python benchmarks/fig14b_seq_cap.py            # several minutes
"""
from __future__ import annotations

import argparse
import json

from pagedattn.repro.experiments import fig14_curves, gain_sources
from pagedattn.repro.report.results import REPO_ROOT, hardware_label, today


def gains(cap: int, widths: tuple[int, ...]) -> list[dict]:
    g = gain_sources.seq_cap_gains(fig14_curves.sharing_params(False), widths, cap, progress=False)
    return [{"max_num_seqs": cap, "method": r.method, "width": int(r.width), "rate_paged": float(r.rate_paged),
             "rate_orca_oracle": float(r.rate_orca_oracle), "gain": float(r.gain), "resolution": float(r.resolution),
             "bound_by": [r.bound_by_paged, r.bound_by_orca_oracle]} for r in g.itertuples()]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caps", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 4, 6])
    a = ap.parse_args(argv)
    rows = [row for cap in a.caps for row in gains(cap, tuple(a.widths))]
    for r in rows:
        print(f"max_num_seqs {r['max_num_seqs']:5d} {r['method']} width {r['width']}: ours {r['rate_paged']:.2f} req/s, Orca (Oracle) "
              f"{r['rate_orca_oracle']:.2f} req/s, gain {r['gain']:.2f}x")
    out = {"benchmark": "fig14b_seq_cap", "date": today(), "hardware": hardware_label("sim"),
           "model": "OPT-13B on A100-40GB (simulator, paper scale)",
           "rule": "notebook 11's gains (n = 1 and beam search, gain_sources.seq_cap_gains), only the simulator's "
                   "max_num_seqs changed",
           "rows": rows}
    path = REPO_ROOT / "results" / "benchmarks" / "fig14b_seq_cap.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
