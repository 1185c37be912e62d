"""The scoreboard of issue 51: ``results/SUMMARY.md`` opens with the tallies, one row per paper result and one
row per claim (the paper's value, ours, the verdict, the strict verdict at the paper's own value and the reason
written by the experiment), then the run time; ``results/DETAILS.md`` keeps each experiment's bands, notes and
provenance. Both are generated from ``results/*/summary.json`` and ``run.json``, never edited by hand.

``python -m pagedattn.repro.report.scoreboard`` writes them (``python -m pagedattn.repro.report.readme``, ``make
summary``: README.md's generated blocks too); ``--check`` lists the stale results instead. The verdicts are
``results.verdict`` and ``results.strict_verdict``; DESIGN.md, "Results convention", says what each means.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import fnmatch
import json
import os
import sys
from collections import Counter
from pathlib import Path

from pagedattn.repro.report.results import (CORNER, FAILS, HOLDS, INVARIANT, KINDS, NOT_MEASURED, RECORDED, REPO_ROOT,
                                            RESULTS_DIR, RUN_FILE, STALE_FILE, _fmt, fmt_interval, measured_reason,
                                            stale_reason, strict_verdict, verdict)

COMMAND = "python -m pagedattn.repro.report.scoreboard"
MAX_ROW = 300  # characters: no scoreboard row is longer (issue 51)
GPU_CHECK = "gpu_check"  # its claims are copied into 02 and 06; counted once, where the notebook shows them

#: notebook -> (the paper result it reproduces, the headline claims' name patterns (fnmatch), in the paper's order)
PAPER_RESULTS: dict[str, tuple[str, list[str]]] = {
    "00_tour": ("§3-§4 worked examples", ["kv_bytes_per_token.opt_13b"]),
    "01_kv_memory_waste": ("Fig. 2, Fig. 13", ["token_states_pct.paged", "mean_batch.paged"]),
    "02_attention_kernel": ("Fig. 18a", ["paged_over_contiguous_latency.*"]),
    "03_throughput": ("Figs. 12-13", ["rate_ratio.sharegpt.paged_vs_orca_oracle"]),
    "04_sharing": ("Figs. 14-15", ["saving_pct.sharegpt.parallel_n6", "saving_pct.sharegpt.beam_w6"]),
    "05_block_size": ("Fig. 18b", ["best_block_sizes.sharegpt"]),
    "06_preemption": ("Fig. 19", ["recompute_over_swap_latency.*block16"]),
    "07_shared_prefix": ("Fig. 16", ["prefix_speedup.five_shot"]),
    "08_workloads": ("Fig. 11", ["trace_mean.sharegpt.output"]),
    "09_chatbot": ("Fig. 17", ["rate_ratio.chatbot.paged_vs_orca_oracle"]),
    "10_table1_fig12": ("Table 1, Fig. 12", ["rate_ratio.OPT-175B.sharegpt.paged_vs_orca_oracle"]),
    "11_fig14_curves": ("Fig. 14", ["gain_at_fixed_latency.beam_w6"]),
    "12_fig2_running_engines": ("Fig. 2, running engines", ["token_states_pct_running.paged"]),
    "13_online_serving": ("Fig. 12, live servers", ["online.rate_ratio.paged_vs_orca_oracle.*"]),
    GPU_CHECK: ("GPU check (Figs. 18a, 19)", ["engine_matches_hf_greedy.gpu.*"]),
}


def stale_reasons(folder: Path, doc: dict, root: Path = REPO_ROOT) -> list[str]:
    """Why a result is stale: its last run failed (a ``STALE`` file) or its sources changed since (provenance)."""
    failed = Path(folder) / STALE_FILE
    return [r for r in [failed.read_text().strip() if failed.exists() else None, stale_reason(doc, root)] if r]


def summaries(results_dir: str | os.PathLike = RESULTS_DIR) -> dict[str, dict]:
    """Every ``<results_dir>/*/summary.json`` by folder name, in name order."""
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("*/summary.json"))}


def scored_claims(docs: dict[str, dict]) -> list[tuple[str, dict]]:
    """``(folder, claim)`` for every claim, each counted once: a ``gpu_check`` claim that a notebook also stores
    (02 and 06 copy the GPU run's claims) is left to the notebook."""
    elsewhere = {(c["name"], json.dumps(c.get("ours"))) for name, doc in docs.items() if name != GPU_CHECK
                 for c in doc["claims"]}
    return [(name, c) for name, doc in docs.items() for c in doc["claims"]
            if name != GPU_CHECK or (c["name"], json.dumps(c.get("ours"))) not in elsewhere]


def tally(claims: list[dict]) -> Counter:
    """How many claims have each verdict, and ``"strict " + verdict`` for the strict ones judged."""
    counts = Counter(verdict(c) for c in claims)
    counts.update("strict " + v for v in map(strict_verdict, claims) if v != "-")
    return counts


def render_tally(claims: list[dict]) -> str:
    """The tallies' sentence: reproduction verdicts, strict ones, invariants and recorded claims."""
    n = tally(claims)
    judged = n[HOLDS] + n[FAILS] + n[CORNER] + n[NOT_MEASURED]
    strict = n["strict " + HOLDS] + n["strict " + FAILS]
    return (f"**{judged} reproduction claims: {n[HOLDS]} hold, {n[FAILS]} fail, {n[CORNER]} fail only at a band "
            f"corner, {n[NOT_MEASURED]} not measured.** Strictly, at the paper's own numbers (its range, or a single "
            f"value to the precision it was printed with; no widening), {n['strict ' + HOLDS]} of {strict} hold. Apart from these: {n[INVARIANT]} "
            f"invariants (true by construction) and {n[RECORDED]} recorded claims (CPU timings, model outputs; not "
            f"judged).")


def _cell(text: object) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def _row(cells: list[str]) -> str:
    """A table row of at most :data:`MAX_ROW` characters; the last cell (the reason) is shortened with an ellipsis
    where needed (DETAILS.md keeps the whole)."""
    row = "| " + " | ".join(map(_cell, cells)) + " |"
    if len(row) > MAX_ROW:
        head = "| " + " | ".join(map(_cell, cells[:-1])) + " | "
        row = head + _cell(cells[-1])[:MAX_ROW - len(head) - 3] + "… |"
    return row


def _ours(c: dict) -> str:
    return _fmt(c.get("ours")) + (f" {c['unit']}" if c.get("unit") and c.get("ours") is not None else "")


def stale_names(docs: dict[str, dict], results_dir: Path = RESULTS_DIR, root: Path = REPO_ROOT) -> set[str]:
    """The results whose last run failed or whose sources changed since (each file hashed once per call)."""
    return {name for name, doc in docs.items() if stale_reasons(Path(results_dir) / name, doc, root)}


def stale_mark(name: str, claim: dict, docs: dict[str, dict], stale: set[str]) -> str:
    """" (STALE ...)" for a row whose value comes from a stale source, else "": the claim's notebook is stale, or the
    claim was measured on a GPU (a ``gpu`` part in its name: ``make gpu`` wrote it, or the benchmark its notebook read)
    and the GPU run (``results/gpu_check``) is stale (issue 61: 02's and 06's GPU rows did not say so)."""
    if name in stale:
        return " (STALE)"
    if GPU_CHECK in stale and "gpu" in claim["name"].split("."):
        return f" (STALE: from the GPU run of {docs.get(GPU_CHECK, {}).get('date', '?')})"
    return ""


def result_rows(docs: dict[str, dict], stale: set[str]) -> list[str]:
    """One row per paper result: its notebook (STALE when in ``stale``), the counts of its reproduction claims by
    verdict, the strict count, the count of its invariants and recorded claims (a result with none judged, such as
    Fig. 11's trace means or the live servers' CPU timings, shows there what it holds) and its headline claim
    (paper → ours, verdict)."""
    claims = scored_claims(docs)
    lines = ["| paper result | notebook | hold | fail | fail at corner | not measured | strict hold | invariant / recorded "
             "| headline: paper → ours (verdict) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, (label, patterns) in PAPER_RESULTS.items():
        if name not in docs:
            continue
        mine = [c for n, c in claims if n == name]
        n = tally(mine)
        matches = [c for c in mine if any(fnmatch.fnmatchcase(c["name"], p) for p in patterns)]
        head = sorted(matches, key=lambda c: c.get("kind", "reproduction") != "reproduction")[:1]
        headline = "; ".join(f"`{c['name']}` {_fmt(c.get('paper'), missing='-')} → {_ours(c)} ({verdict(c)})"
                             f"{'' if name in stale else stale_mark(name, c, docs, stale)}" for c in head)
        mark = " (STALE)" if name in stale else ""
        lines.append(_row([label, f"`{name}`{mark}", str(n[HOLDS]), str(n[FAILS]), str(n[CORNER]),
                           str(n[NOT_MEASURED]),
                           f"{n['strict ' + HOLDS]}/{n['strict ' + HOLDS] + n['strict ' + FAILS]}",
                           f"{n[INVARIANT]} / {n[RECORDED]}", headline]))
    return lines


def claim_rows(docs: dict[str, dict], stale: set[str] = frozenset()) -> list[str]:
    """One row per reproduction claim: result, claim (marked when its source is stale, ``stale_mark``), paper, ours,
    accepted interval, verdict, strict, reason."""
    lines = ["| result | claim | paper | ours | accepted | verdict | strict | reason |",
             "|---|---|---|---|---|---|---|---|"]
    for name, c in scored_claims(docs):
        if c.get("kind", "reproduction") != "reproduction":
            continue
        label = PAPER_RESULTS.get(name, (name, []))[0]
        lines.append(_row([label, f"`{c['name']}`{stale_mark(name, c, docs, stale)}", _fmt(c.get("paper"), missing="-"), _ours(c),
                           fmt_interval(c.get("accept")) or "-", verdict(c), strict_verdict(c),
                           c.get("reason") or measured_reason(c)]))
    return lines


def render_summary_md(results_dir: str | os.PathLike = RESULTS_DIR, root: Path = REPO_ROOT) -> str:
    """The text of ``SUMMARY.md``: the tallies, the rows per paper result and per claim, and the run time."""
    docs = summaries(results_dir)
    lines = ["# Paper vs reproduced: the scoreboard", "",
             f"Generated by `{COMMAND}` from every `results/*/summary.json`; do not edit by hand. Bands, notes, "
             "tolerances and provenance: [DETAILS.md](DETAILS.md).", ""]
    if not docs:
        return "\n".join(lines + ["No results yet: run `make reproduce`.", ""])
    claims = [c for _, c in scored_claims(docs)]
    stale = stale_names(docs, Path(results_dir), root)
    lines += [render_tally(claims), ""]
    if stale:
        lines += [f"**Stale:** {', '.join(sorted(stale))} (their last run failed or their sources changed since; DETAILS.md says which).", ""]
    lines += ["Verdicts: *holds* inside the accepted interval (the paper's value widened by the stated tolerance) "
              "across the band of swept assumptions; *fails only at a band corner*: the measured value passes, an "
              "end of the band does not; *strict*: the measured value against the paper's own value and tolerance.",
              "", "## By paper result", ""] + result_rows(docs, stale)
    lines += ["", "## Every reproduction claim", ""] + claim_rows(docs, stale)
    return "\n".join(lines + _timing_table(read_runs(results_dir)))


def render_details_md(results_dir: str | os.PathLike = RESULTS_DIR, root: Path = REPO_ROOT) -> str:
    """The text of ``DETAILS.md``: for every ``<results_dir>/*/summary.json``, its hardware, model, date and every
    claim with its band (and what was swept), tolerance and note, marked STALE when its last run failed (a ``STALE``
    file) or its sources under ``root`` changed since (provenance)."""
    results = Path(results_dir)
    lines = ["# Paper vs reproduced: details", "",
             f"Generated by `{COMMAND}` from every `results/*/summary.json`; do not edit by hand. The scoreboard "
             "is [SUMMARY.md](SUMMARY.md).", ""]
    summaries = sorted(results.glob("*/summary.json"))
    if not summaries:
        lines.append("No results yet: run `make reproduce`.")
    for path in summaries:
        doc = json.loads(path.read_text())
        reasons = stale_reasons(path.parent, doc, root)
        lines += [f"## {doc['experiment']}{' (STALE)' if reasons else ''}", ""]
        lines += [f"**Stale:** {r}" for r in reasons] + ([""] if reasons else [])
        lines += [f"- hardware: {doc['hardware']}", f"- model: {doc['model']}",
                  f"- date: {doc['date']}{' (quick mode)' if doc.get('quick') else ''}"]
        lines += [f"- restamped {r['date']} at {r['commit']}, not rerun: {r['reason']}"
                  for r in (doc.get("provenance") or {}).get("restamps", [])] + [""]
        by_kind = {k: [c for c in doc["claims"] if c.get("kind", "reproduction") == k] for k in KINDS}
        for kind, title in zip(KINDS, _KIND_TITLES):
            if by_kind[kind]:
                lines += _claims_table(by_kind[kind], title)
    return "\n".join(lines)



def read_runs(results_dir: str | os.PathLike = RESULTS_DIR) -> list[dict]:
    """Every ``<results_dir>/*/run.json`` (written by ``reproduce``), in notebook order."""
    return [json.loads(p.read_text()) for p in sorted(Path(results_dir).glob(f"*/{RUN_FILE}"))]


def full_run(runs: list[dict]) -> bool:
    """True when the records come from one invocation of ``reproduce`` that ran every notebook."""
    return bool(runs) and all(r.get("all_notebooks") for r in runs) and len({r["started"] for r in runs}) == 1


def wall_seconds(runs: list[dict]) -> float:
    """The runs' wall time: for one full run whose records say when each notebook finished, from the command's start
    to the last notebook's end (notebooks side by side overlap); else the sum of the notebooks' seconds."""
    if full_run(runs) and all(r.get("finished") for r in runs):
        start = _dt.datetime.fromisoformat(runs[0]["started"])
        return max((_dt.datetime.fromisoformat(r["finished"]) - start).total_seconds() for r in runs)
    return sum(r["seconds"] for r in runs)


def _cores_busy(run: dict) -> str:
    """The machine's busy cores on average while the notebook ran (``reproduce.machine_cores_busy``), "-" where not
    recorded."""
    busy = run.get("machine_cores_busy")
    return "-" if busy is None else f"{busy:.2f}"


def _timing_table(runs: list[dict]) -> list[str]:
    """SUMMARY.md's timing section: one row per ``run.json`` and the total."""
    if not runs:
        return ["", "## Run time", "",
                "No run of `python -m pagedattn.repro.report.reproduce` is recorded yet (`results/*/run.json`).", ""]
    title = ("the last full `make reproduce`" if full_run(runs)
             else "the latest run of each notebook (not one full `make reproduce`)")
    lines = ["", "## Run time", "", f"From `run.json`: {title}.", "",
             "| notebook | minutes | notebooks at once | cores busy | jobs | simulator | machine | date |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| `{r['notebook']}` | {r['seconds'] / 60:.1f} | {r.get('at_once', 1)} | {_cores_busy(r)} | "
                     f"{r['jobs']} | {r.get('simulator', 'interpreted').split(' (')[0]} | {r['machine']} | "
                     f"{r['date']} |")
    machines = {r["machine"] for r in runs}  # issue 61: no total adds the minutes of two machines
    total = f"{wall_seconds(runs) / 60:.1f}" if len(machines) == 1 else f"not added: {len(machines)} machines"
    lines += [f"| total (wall) | {total} | | | | | | |", "",
              "Notebooks side by side (at once > 1) time nothing on the CPU (`reproduce.SHARE_THE_MACHINE`); their "
              "minutes overlap. Cores busy: the whole machine's, on average, while the notebook ran.", ""]
    return lines


_KIND_TITLES = ("Reproduction claims (compared with the paper)",
                "Invariants (true by construction; not evidence of reproduction)",
                "Tracking (recorded, not judged)")


def _fmt_ours(c: dict) -> str:
    """The measured value, with its band across the swept assumptions when it has one."""
    ours = _fmt(c.get("ours"))
    band = c.get("band")
    if band:
        ours += f" [{_fmt(band.get('min'))} .. {_fmt(band.get('max'))} over {band.get('over', '?')}]"
    return ours


def _claims_table(claims: list[dict], title: str) -> list[str]:
    lines = [f"{title}:", "", "| claim | paper | ours [band] | unit | tolerance | holds | note |",
             "|---|---|---|---|---|---|---|"]
    for c in claims:
        holds = {True: "yes", False: "**no**", None: "n/a"}[c.get("holds")]
        cells = [f"`{c['name']}`", _fmt(c["paper"], missing="-"), _fmt_ours(c), c.get("unit", ""), c.get("tolerance", ""), holds,
                 c.get("note", "")]
        lines.append("| " + " | ".join(str(x).replace("|", "/").replace("\n", " ") for x in cells) + " |")
    lines.append("")
    return lines


def missing_reasons(results_dir: str | os.PathLike = RESULTS_DIR) -> list[str]:
    """``"<experiment>/<claim>"`` for every stored claim without a ``reason`` (issue 51): summaries written before the
    field existed, until the next full rerun writes them."""
    out = []
    for path in sorted(Path(results_dir).glob("*/summary.json")):
        doc = json.loads(path.read_text())
        out += [f"{path.parent.name}/{c['name']}" for c in doc["claims"] if not c.get("reason")]
    return out


def check(results_dir: str | os.PathLike = RESULTS_DIR, root: Path = REPO_ROOT) -> list[str]:
    """One line per stale result under ``results_dir``: its folder and why (the changed files)."""
    stale = []
    for path in sorted(Path(results_dir).glob("*/summary.json")):
        reason = stale_reason(json.loads(path.read_text()), root)
        if reason:
            stale.append(f"{path.parent.name}: {reason}")
    return stale


def build_summary_md(results_dir: str | os.PathLike = RESULTS_DIR) -> Path:
    """Write :func:`render_summary_md` to ``<results_dir>/SUMMARY.md`` and :func:`render_details_md` to
    ``DETAILS.md`` beside it; return SUMMARY.md's path."""
    out = Path(results_dir) / "SUMMARY.md"
    out.write_text(render_summary_md(results_dir))
    (Path(results_dir) / "DETAILS.md").write_text(render_details_md(results_dir))
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedattn.repro.report.scoreboard``: regenerate SUMMARY.md and DETAILS.md (``python -m
    pagedattn.repro.report.readme``: README.md's generated blocks too); ``--check``: list stale results and exit 1
    if there is any."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="list the stale results (exit 1 if any); write nothing")
    args = ap.parse_args(argv)
    if args.check:
        stale = check()
        print("\n".join(stale) if stale else "no stale results")
        return 1 if stale else 0
    print(f"wrote {build_summary_md()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
