"""Does the cap on the batch (``max_num_seqs``) flatten Fig. 14b's beam-search gain? (§6.3, Fig. 14b; notebook 11)

Notebook 11 finds ours over Orca (Oracle) at beam widths 2 / 4 / 6 with no rise across widths, where the paper's
gain rises. With beams, ``max_num_seqs`` (256, vLLM's default, which the notebook keeps) counts beams, so ours may
stop at 256 / width requests in a batch while memory is left. This script reruns notebook 11's beam gains
(``fig14_curves.beam_gain``: the same trace, rule, cost model and beam model) with the simulator's ``max_num_seqs``
at 256 and at a cap that no run reaches, side by side, and writes ``results/benchmarks/fig14b_seq_cap.json``.

    PYTHONPATH=src .venv/bin/python benchmarks/fig14b_seq_cap.py            # about two minutes
"""
from __future__ import annotations

import argparse
import functools
import json
from unittest.mock import patch

from pagedattn import sim
from pagedattn.experiments import fig14_curves, sharing
from pagedattn.results import REPO_ROOT, hardware_label, today


def gains(cap: int, widths: tuple[int, ...]) -> list[dict]:
    with patch.object(sharing, "simulate", functools.partial(sim.simulate, max_num_seqs=cap)):
        g = fig14_curves.beam_gain(fig14_curves.sharing_params(False), widths, progress=False)
    return [{"max_num_seqs": cap, "width": int(r.width), "rate_paged": float(r.rate_paged),
             "rate_orca_oracle": float(r.rate_orca_oracle), "gain": float(r.rate_paged / r.rate_orca_oracle),
             "at_upper_bound": bool(r.at_upper_bound)} for r in g.itertuples()]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--caps", type=int, nargs="+", default=[256, 2048])
    ap.add_argument("--widths", type=int, nargs="+", default=[2, 4, 6])
    a = ap.parse_args(argv)
    rows = [row for cap in a.caps for row in gains(cap, tuple(a.widths))]
    for r in rows:
        print(f"max_num_seqs {r['max_num_seqs']:5d} width {r['width']}: ours {r['rate_paged']:.2f} req/s, Orca (Oracle) "
              f"{r['rate_orca_oracle']:.2f} req/s, gain {r['gain']:.2f}x")
    out = {"benchmark": "fig14b_seq_cap", "date": today(), "hardware": hardware_label("sim"),
           "model": "OPT-13B on A100-40GB (simulator, paper scale)",
           "rule": "notebook 11's beam gain (fig14_curves.beam_gain), only the simulator's max_num_seqs changed",
           "rows": rows}
    path = REPO_ROOT / "results" / "benchmarks" / "fig14b_seq_cap.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
