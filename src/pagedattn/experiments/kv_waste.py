"""Experiment 01: where KV memory goes (paper §3, Fig. 2) and how many requests each system batches (Fig. 13).

The paper's OPT-13B / A100-40GB setting (12 GB of KV = 15.7K token slots, max length 2048) is replayed with the
simulated executor (``sim.py``): the real scheduler and the real KV managers (paged block manager; Orca's
reservations over a buddy allocator), a roofline step-time model, and a ShareGPT-like trace at 2 req/s.

Fig. 2's breakdown is the time-weighted share of slots in each kind, averaged over the *memory-bound* steps: those in
which an arrived request is waiting although the batch has room for it, i.e. memory is what holds it back. At a load
that does not fill memory, free slots would dominate every system. Mean batched requests (Fig. 13) are averaged over
all decode steps of the same run.

The study note's exercise 6 is answered by a block-size sweep of the paged system against pre-allocating the maximum
(Orca Max) and exact pre-allocation (Orca Oracle): paging's waste shrinks towards zero as blocks shrink.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
from tqdm.auto import tqdm

from pagedattn import sensitivity
from pagedattn.config import paper_slots
from pagedattn.paper import FIG2_SHARES, FIG13_MEAN_BATCH
from pagedattn.results import RESULTS_DIR, Claim, hardware_label, write_summary
from pagedattn.sim import LABELS, SYSTEMS, CostModel, SimResult, simulate
from pagedattn.workloads import make_trace, trace_stats

EXPERIMENT = "01_kv_memory_waste"
MODEL = "sim: OPT-13B/A100-40GB (15.7K token slots, roofline step time)"
KINDS = ["token_states", "reserved", "internal", "external"]


@dataclass
class Params:
    quick: bool = False
    num_requests: int = 1500
    seed: int = 0
    block_size: int = 16
    sharegpt_rate: float = FIG13_MEAN_BATCH["sharegpt"]["rate"]
    alpaca_rate: float = FIG13_MEAN_BATCH["alpaca"]["rate"]
    sweep_block_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)

    @classmethod
    def make(cls, quick: bool = False, **kw) -> "Params":
        if quick:
            kw.setdefault("num_requests", 250)
            kw.setdefault("sweep_block_sizes", (1, 16, 256))
        return cls(quick=quick, **kw)


def run_systems(trace, params: Params, systems=SYSTEMS, placement: str = "buddy",
                progress: bool = True, cost: CostModel | None = None) -> dict[str, SimResult]:
    """Replay one trace through each system on the same KV budget and cost model."""
    cost = cost or CostModel()
    return {s: simulate(trace, s, paper_slots(), params.block_size, cost, placement=placement)
            for s in tqdm(systems, desc="systems", disable=not progress, leave=False)}


def breakdown_table(results: dict[str, SimResult]) -> pd.DataFrame:
    """Fig. 2: ours and the paper's shares per system, one row each."""
    rows = []
    for s, r in results.items():
        paper = FIG2_SHARES[s]
        rows.append({"system": s, "label": LABELS[s], **r.shares(),
                     **{f"paper_{k}": paper.get(k) for k in KINDS},
                     "memory_bound_steps_pct": 100 * float(r.steps["memory_bound"].mean()),
                     "max_request_waste_slots": int(r.steps["max_request_waste"].max())})
    return pd.DataFrame(rows)


def usage_over_time(r: SimResult, bins: int = 400) -> pd.DataFrame:
    """The run's KV breakdown and queue lengths, averaged into ``bins`` equal time bins (to keep the CSV small)."""
    d = r.steps[["time", "num_running", "num_waiting", "memory_bound", *KINDS]].copy()
    d["memory_bound"] = d["memory_bound"].astype(float)
    width = max(d["time"].max(), 1e-9) / bins
    d["bin"] = (d["time"] // width).astype(int)
    out = d.groupby("bin").mean().reset_index(drop=True)
    return out.assign(system=r.system)[["system", "time", "num_running", "num_waiting", "memory_bound", *KINDS]]


def mean_batch_table(results: dict[str, SimResult], trace: str) -> pd.DataFrame:
    paper = FIG13_MEAN_BATCH[trace]
    return pd.DataFrame([{"trace": trace, "rate": paper["rate"], "system": s, "label": LABELS[s],
                          "mean_batch": r.mean_batch(), "paper_mean_batch": paper[s],
                          "normalized_latency_s": r.normalized_latency(), "preemptions": sum(r.num_preemptions.values())}
                         for s, r in results.items()])


def block_size_waste(trace, params: Params, progress: bool = True) -> pd.DataFrame:
    """Exercise 6: the share of *allocated* slots that hold no token, for paging at each block size vs pre-allocating
    the maximum length (Orca Max) or the exact length (Orca Oracle), over the memory-bound steps."""
    rows = []
    cost = CostModel()
    runs = [("paged", bs) for bs in params.sweep_block_sizes] + [("orca_max", None), ("orca_oracle", None)]
    for system, bs in tqdm(runs, desc="exercise 6", disable=not progress, leave=False):
        r = simulate(trace, system, paper_slots(), bs or params.block_size, cost)
        sh = r.shares()
        allocated = sh["token_states"] + sh["reserved"] + sh["internal"]
        rows.append({"system": system, "label": LABELS[system], "block_size": bs,
                     "allocated_pct": allocated, "token_states_pct": sh["token_states"],
                     "waste_of_allocated_pct": 100 * (1 - sh["token_states"] / allocated),
                     "mean_batch": r.mean_batch(),
                     "max_request_waste_slots": int(r.steps["max_request_waste"].max())})
    return pd.DataFrame(rows)


def claims(breakdown: pd.DataFrame, batches: pd.DataFrame, block_size: int) -> list[Claim]:
    out = []
    for _, row in breakdown.iterrows():
        s, ours, paper = row["system"], row["token_states"], FIG2_SHARES[row["system"]]["token_states"]
        if s == "paged":
            out.append(Claim(f"token_states_pct.{s}", paper, round(ours, 2), "%", "ours >= 96", bool(ours >= 96)))
        else:
            out.append(Claim(f"token_states_pct.{s}", paper, round(ours, 2), "%", "within 8 points",
                             bool(abs(ours - paper) <= 8)))
    for _, row in batches.iterrows():
        prefix = "mean_batch" if row["trace"] == "sharegpt" else f"mean_batch_{row['trace']}"
        ours, paper = row["mean_batch"], row["paper_mean_batch"]
        out.append(Claim(f"{prefix}.{row['system']}", paper, round(ours, 2), "requests", "within 25%",
                         bool(abs(ours / paper - 1) <= 0.25),
                         note=f"{row['trace']} at {row['rate']:g} req/s"))
    waste = int(breakdown.set_index("system").loc["paged", "max_request_waste_slots"])
    out.append(Claim("max_request_waste_slots.paged", f"< {block_size} (one block)", waste, "slots",
                     f"< {block_size}", waste < block_size, "the block manager's bound: one partly filled block",
                     kind="invariant"))
    return out


def claims_at(point: sensitivity.Point, params: Params) -> list[Claim]:
    """Fig. 2 and Fig. 13's claims under one point's assumptions (step time, rate, trace): the band's evaluation."""
    cost = point.cost()
    runs = {}
    for w, rate in (("sharegpt", params.sharegpt_rate), ("alpaca", params.alpaca_rate)):
        r = sensitivity.rate_at(point, w, rate, params.num_requests, params.seed)
        runs[w] = run_systems(make_trace(point.trace_name(w), params.num_requests, r, params.seed), params,
                              progress=False, cost=cost)
    batches = pd.concat([mean_batch_table(runs[w], w) for w in runs], ignore_index=True)
    return claims(breakdown_table(runs["sharegpt"]), batches, params.block_size)


def run(quick: bool = False, results_dir: str | Path = RESULTS_DIR, progress: bool = True, **kw) -> dict:
    """Run everything, write CSVs and ``summary.json`` to ``<results_dir>/01_kv_memory_waste/``; return the tables."""
    params = Params.make(quick, **kw)
    out_dir = Path(results_dir) / EXPERIMENT
    out_dir.mkdir(parents=True, exist_ok=True)
    share_trace = make_trace("sharegpt", params.num_requests, params.sharegpt_rate, params.seed)
    alpaca_trace = make_trace("alpaca", params.num_requests, params.alpaca_rate, params.seed)
    sharegpt = run_systems(share_trace, params, progress=progress)
    alpaca = run_systems(alpaca_trace, params, progress=progress)
    exact = run_systems(share_trace, params, systems=("orca_pow2", "orca_oracle"), placement="exact",
                        progress=progress)
    tables = {
        "fig2_breakdown": breakdown_table(sharegpt),
        "fig13_mean_batch": pd.concat([mean_batch_table(sharegpt, "sharegpt"), mean_batch_table(alpaca, "alpaca")],
                                      ignore_index=True),
        "placement_variant": pd.concat([breakdown_table(exact).assign(placement="exact"),
                                        breakdown_table({k: sharegpt[k] for k in exact}).assign(placement="buddy")],
                                       ignore_index=True),
        "exercise6_block_size": block_size_waste(share_trace, params, progress),
        "traces": pd.DataFrame([{"trace": "sharegpt", "rate": params.sharegpt_rate, **trace_stats(share_trace)},
                                {"trace": "alpaca", "rate": params.alpaca_rate, **trace_stats(alpaca_trace)}]),
        "kv_usage_over_time": pd.concat([usage_over_time(r) for r in sharegpt.values()], ignore_index=True),
    }
    for name, df in tables.items():
        df.to_csv(out_dir / f"{name}.csv", index=False)
    hw = hardware_label("sim")
    default = claims(tables["fig2_breakdown"], tables["fig13_mean_batch"], params.block_size)
    pts = sensitivity.points(quick)
    band = sensitivity.sweep(EXPERIMENT, lambda p: claims_at(p, params), pts, {"params": asdict(params)}, default,
                             progress=progress)
    tables["sensitivity"] = band
    band.to_csv(out_dir / "sensitivity.csv", index=False)
    write_summary(out_dir, EXPERIMENT, hw, MODEL, quick, sensitivity.with_bands(default, band, sensitivity.describe(pts)),
                  extra={"params": asdict(params), "cost_model": asdict(CostModel())})
    tables["label"] = f"{MODEL} | {hw} | {params.num_requests} requests/trace | quick={quick}"
    tables["out_dir"] = out_dir
    return tables
