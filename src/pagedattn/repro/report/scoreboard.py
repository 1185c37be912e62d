"""The scoreboard (issues 51, 61): ``results/SUMMARY.md`` opens with one tally line, then one table per figure or
table of the paper, one row per number the paper states (``repro.paper.REGISTRY``): the paper's value, ours, the
difference in percent, one verdict and a short reason written by the experiment; then the cross-checks (the same
number measured again by another notebook) and the run time. ``results/DETAILS.md`` keeps each experiment's bands,
tolerances, notes and provenance. Both are generated from ``results/*/summary.json`` and ``run.json``, never edited
by hand.

``python -m pagedattn.repro.report.scoreboard`` writes them (``python -m pagedattn.repro.report.readme``, ``make
summary``: README.md's generated blocks too); ``--check`` lists the stale results instead. The verdicts are
``results.verdict``; DESIGN.md, "Results convention", says what each means.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pagedattn.repro.paper import REGISTRY, PaperNumber
from pagedattn.repro.report.results import (CORNER, FAILS, HOLDS, INVARIANT, KINDS, NOT_MEASURED, RECORDED, REPO_ROOT,
                                            RESULTS_DIR, RUN_FILE, STALE_FILE, WITHIN_PCT, _fmt, difference_pct,
                                            fmt_interval, fmt_pct, measured_reason, stale_reason, verdict,
                                            verdict_text)

COMMAND = "python -m pagedattn.repro.report.scoreboard"
MAX_ROW = 300  # characters: no scoreboard row is longer (issue 51)
MAX_REASON = 200  # characters of a row's reason (issue 61); DETAILS.md keeps the whole
GPU_CHECK = "gpu_check"  # the GPU run's record: 02 and 06 copy and judge its numbers; its own claims are recorded

#: The figures and tables in the paper's order, each with the notebooks whose numbers it holds (the README's rows).
FIGURES = ("§3", "Fig. 2", "Fig. 11", "Fig. 12", "Abstract", "Fig. 13", "Fig. 14", "Fig. 15", "Fig. 16", "Fig. 17",
           "Fig. 18a", "Fig. 18b", "Fig. 19", "Table 1")


def stale_reasons(folder: Path, doc: dict, root: Path = REPO_ROOT) -> list[str]:
    """Why a result is stale: its last run failed (a ``STALE`` file) or its sources changed since (provenance)."""
    failed = Path(folder) / STALE_FILE
    return [r for r in [failed.read_text().strip() if failed.exists() else None, stale_reason(doc, root)] if r]


def summaries(results_dir: str | os.PathLike = RESULTS_DIR) -> dict[str, dict]:
    """Every ``<results_dir>/*/summary.json`` by folder name, in name order."""
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(Path(results_dir).glob("*/summary.json"))}


def scored_claims(docs: dict[str, dict]) -> list[tuple[str, dict]]:
    """``(folder, claim)`` for every claim, each counted once: the GPU run's own record (``gpu_check``) is recorded,
    never judged (02 and 06 judge the numbers they copy from it), and a claim it shares with a notebook is left to
    the notebook."""
    elsewhere = {(c["name"], json.dumps(c.get("ours"))) for name, doc in docs.items() if name != GPU_CHECK
                 for c in doc["claims"]}
    return [(name, c if name != GPU_CHECK else {**c, "kind": "tracking", "paper_id": None})
            for name, doc in docs.items() for c in doc["claims"]
            if name != GPU_CHECK or (c["name"], json.dumps(c.get("ours"))) not in elsewhere]


@dataclass
class Row:
    """One number of the paper on the scoreboard: its registry entry, the claim that judges it (None: not measured)
    and the notebook that holds the claim."""

    entry: PaperNumber
    claim: dict | None
    notebook: str | None
    stale_source: str = ""

    @property
    def verdict(self) -> str:
        return NOT_MEASURED if self.claim is None else verdict(self.claim)

    @property
    def difference(self) -> float | None:
        return None if self.claim is None else difference_pct(self.claim, self.entry.value)

    @property
    def reason(self) -> str:
        if self.claim is None:
            return f"not measured: {self.entry.not_measured or f'no run of {self.entry.owner} judges it yet'}"
        why = self.claim.get("reason") or measured_reason(self.claim)
        return f"{self.stale_source}; {why}" if self.stale_source else why


def gpu_stale_source(docs: dict[str, dict], name: str, claim: dict, results_dir: Path, root: Path) -> str:
    """``"stale source: the GPU run of <date> (<hardware>)"`` when ``claim`` holds a GPU measurement (a ``gpu`` part in
    its name, measured) while the GPU run's own record (``results/gpu_check``) is stale: a notebook rerun on a CPU
    copies the GPU run's files as they were; else ``""``."""
    if GPU_CHECK not in docs or "gpu" not in claim["name"].split(".") or claim.get("ours") is None:
        return ""
    if not stale_reasons(Path(results_dir) / GPU_CHECK, docs[GPU_CHECK], root):
        return ""
    run = docs[GPU_CHECK]
    return f"stale source: the GPU run of {run.get('date', '?')} ({run.get('hardware', '?')}), code changed since"


def rows(docs: dict[str, dict], results_dir: Path = RESULTS_DIR, root: Path = REPO_ROOT) -> list[Row]:
    """One :class:`Row` per registry entry, in the registry's order."""
    judged = {c.get("paper_id"): (name, c) for name, c in scored_claims(docs) if c.get("paper_id")}
    out = []
    for pid, entry in REGISTRY.items():
        name, claim = judged.get(pid, (None, None))
        stale = gpu_stale_source(docs, name, claim, results_dir, root) if claim is not None else ""
        out.append(Row(entry, claim, name, stale))
    return out


def tally(rs: list[Row]) -> Counter:
    """How many numbers have each verdict, and ``"within"``: how many measured ones lie within ``WITHIN_PCT`` % of
    the paper (``"measured"``: how many have a numeric difference)."""
    counts = Counter(r.verdict for r in rs)
    diffs = [r.difference for r in rs if r.difference is not None]
    counts["measured"] = len(diffs)
    counts["within"] = sum(abs(d) <= WITHIN_PCT for d in diffs)
    return counts


def render_tally(rs: list[Row]) -> str:
    """The tally's one line: the verdicts of the paper's numbers and how many lie within 10 % of the paper."""
    n = tally(rs)
    return (f"**Of the paper's {len(rs)} numbers, {n[HOLDS]} are reproduced, {n[CORNER]} reproduced at our value but "
            f"not across the assumptions, {n[FAILS]} not reproduced and {n[NOT_MEASURED]} not measured; "
            f"{n['within']} of the {n['measured']} with a numeric difference lie within {WITHIN_PCT} % of the "
            f"paper.**")


def _cell(text: object) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def _short(text: str, limit: int = MAX_REASON) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _row(cells: list[str]) -> str:
    """A table row of at most :data:`MAX_ROW` characters; the last cell (the reason) is shortened with an ellipsis
    where needed (DETAILS.md keeps the whole)."""
    row = "| " + " | ".join(map(_cell, cells)) + " |"
    if len(row) > MAX_ROW:
        head = "| " + " | ".join(map(_cell, cells[:-1])) + " | "
        row = head + _cell(cells[-1])[:MAX_ROW - len(head) - 3] + "… |"
    return row


def _ours(c: dict | None) -> str:
    if c is None:
        return NOT_MEASURED
    return _fmt(c.get("ours")) + (f" {c['unit']}" if c.get("unit") and c.get("ours") is not None else "")


def stale_names(docs: dict[str, dict], results_dir: Path = RESULTS_DIR, root: Path = REPO_ROOT) -> set[str]:
    """The results whose last run failed or whose sources changed since (each file hashed once per call)."""
    return {name for name, doc in docs.items() if stale_reasons(Path(results_dir) / name, doc, root)}


def _notebooks(rs: list[Row], stale: set[str]) -> str:
    """The notebooks that hold ``rs``' numbers (their owners where none is measured), STALE where their sources
    changed since the run."""
    books = sorted({r.notebook or r.entry.owner for r in rs if r.notebook or r.entry.owner})
    return ", ".join(f"`{b}`" + (" (STALE)" if b in stale else "") for b in books)


def figure_tables(rs: list[Row], stale: set[str]) -> list[str]:
    """One table per figure or table of the paper, one row per number: result, paper, ours, difference, verdict and
    reason; the heading names the notebooks (STALE where their sources changed since the run)."""
    lines: list[str] = []
    for fig in FIGURES:
        mine = [r for r in rs if r.entry.figure == fig]
        if not mine:
            continue
        where = _notebooks(mine, stale)
        lines += ["", f"### {fig}" + (f" · {where}" if where else ""), "",
                  "| result | paper | ours | difference | verdict | reason |", "|---|---|---|---|---|---|"]
        lines += [_row([r.entry.quantity, r.entry.printed, _ours(r.claim), fmt_pct(r.difference),
                        verdict_text(r.claim) if r.claim is not None else NOT_MEASURED, _short(r.reason)])
                   for r in mine]
    return lines


def cross_check_rows(docs: dict[str, dict]) -> list[str]:
    """The numbers measured again beside their owner (recorded, never judged): each with both values and whether
    they agree as the registry says they must, or why they differ."""
    judged = {c.get("paper_id"): c for _, c in scored_claims(docs) if c.get("paper_id")}
    lines = ["| number | owner: ours | cross-check: ours | agreement |", "|---|---|---|---|"]
    for pid, entry in REGISTRY.items():
        for x in entry.cross_checks:
            mine = next((c for c in docs.get(x.notebook, {}).get("claims", []) if c["name"] == x.claim), None)
            if mine is None:
                continue
            owner = judged.get(pid)
            d = difference_pct(mine, owner.get("ours")) if owner is not None else None
            if x.agree is not None:
                ok = d is not None and abs(d) <= 100 * x.agree
                how = f"{fmt_pct(d)}: {'agrees' if ok else 'DISAGREES'} (within {100 * x.agree:g} %)"
            else:
                how = f"{fmt_pct(d)}: differs by design, {x.why}"
            lines.append(_row([f"{pid} ({entry.owner})", _ours(owner), f"{_ours(mine)} (`{x.notebook}`)",
                               _short(how)]))
    return lines if len(lines) > 2 else []


def compact_rows(rs: list[Row], stale: set[str]) -> list[str]:
    """README's compact table: one row per figure or table, its counts by verdict and its notebooks."""
    lines = ["| paper result | numbers | reproduced | at our value only | not reproduced | not measured | "
             f"within {WITHIN_PCT} % | notebooks |", "|---|---|---|---|---|---|---|---|"]
    for fig in FIGURES:
        mine = [r for r in rs if r.entry.figure == fig]
        if not mine:
            continue
        n = tally(mine)
        lines.append(_row([fig, str(len(mine)), str(n[HOLDS]), str(n[CORNER]), str(n[FAILS]), str(n[NOT_MEASURED]),
                           f"{n['within']}/{n['measured']}",
                           _notebooks(mine, stale)]))
    return lines


def other_claims_line(docs: dict[str, dict]) -> str:
    """The claims that judge no paper number, counted: invariants (true by construction) and recorded values."""
    n = Counter(verdict(c) for _, c in scored_claims(docs) if not c.get("paper_id"))
    return (f"Beside the paper's numbers the notebooks hold {n[INVARIANT]} invariants (true by construction) and "
            f"{n[RECORDED]} recorded values (CPU timings, cross-checks, model outputs; not judged): "
            "[DETAILS.md](DETAILS.md).")


VERDICT_WORDS = ("*Reproduced*: inside the accepted interval (the paper's value widened by the stated tolerance, "
                 "[METHOD.md](../docs/METHOD.md)) at our value and at every point of the swept assumptions; "
                 "*reproduced at our value, not across the assumptions*: some points of that sweep fall outside "
                 "(how many of how many); *difference*: ours against the paper's value, or the nearest end of its "
                 "range (0 inside it).")


def render_summary_md(results_dir: str | os.PathLike = RESULTS_DIR, root: Path = REPO_ROOT) -> str:
    """The text of ``SUMMARY.md``: the tally, one table per paper figure, the cross-checks and the run time."""
    docs = summaries(results_dir)
    lines = ["# Paper vs reproduced: the scoreboard", "",
             f"Generated by `{COMMAND}` from every `results/*/summary.json`; do not edit by hand. Bands, notes, "
             "tolerances and provenance: [DETAILS.md](DETAILS.md).", ""]
    if not docs:
        return "\n".join(lines + ["No results yet: run `make reproduce`.", ""])
    stale = stale_names(docs, Path(results_dir), root)
    rs = rows(docs, Path(results_dir), root)
    lines += [render_tally(rs), "", VERDICT_WORDS, ""]
    if stale:
        lines += [f"**Stale:** {', '.join(sorted(stale))} (their last run failed or their sources changed since; "
                  "DETAILS.md says which).", ""]
    lines += ["## The paper's numbers, figure by figure"] + figure_tables(rs, stale)
    cross = cross_check_rows(docs)
    if cross:
        lines += ["", "## Cross-checks: a number measured again by another notebook", ""] + cross
    lines += ["", other_claims_line(docs)]
    return "\n".join(lines + _timing_table(read_runs(results_dir)))


BAND_WORDS = ("A claim that rests on assumptions is computed at every point of a grid of them (the step-time "
              "constants, the request rate, the trace; [METHOD.md](../docs/METHOD.md)): its *band* is the smallest "
              "and largest value across the grid, and it is reproduced only if it holds at every point.")


def render_details_md(results_dir: str | os.PathLike = RESULTS_DIR, root: Path = REPO_ROOT) -> str:
    """The text of ``DETAILS.md``: the band defined once, then for every ``<results_dir>/*/summary.json`` its
    hardware, model, date, and its claims by kind (claim, paper number, paper, ours, band, tolerance, verdict) with
    their notes and sensitivity rows listed under each table, marked STALE when its last run failed (a ``STALE``
    file) or its sources under ``root`` changed since (provenance)."""
    results = Path(results_dir)
    lines = ["# Paper vs reproduced: details", "",
             f"Generated by `{COMMAND}` from every `results/*/summary.json`; do not edit by hand. The scoreboard "
             "is [SUMMARY.md](SUMMARY.md).", "", BAND_WORDS, ""]
    paths = sorted(results.glob("*/summary.json"))
    if not paths:
        lines.append("No results yet: run `make reproduce`.")
    for path in paths:
        doc = json.loads(path.read_text())
        reasons = stale_reasons(path.parent, doc, root)
        lines += [f"## {doc['experiment']}{' (STALE)' if reasons else ''}", ""]
        lines += [f"**Stale:** {r}" for r in reasons] + ([""] if reasons else [])
        lines += [f"- hardware: {doc['hardware']}", f"- model: {doc['model']}",
                  f"- date: {doc['date']}{' (quick mode)' if doc.get('quick') else ''}"]
        lines += [f"- restamped {r['date']} at {r['commit']}, not rerun: {r['reason']}"
                  for r in (doc.get("provenance") or {}).get("restamps", [])] + [""]
        claims = [c if doc["experiment"] != GPU_CHECK else {**c, "kind": "tracking"} for c in doc["claims"]]
        sweeps = list(dict.fromkeys(c["band"].get("over", "?") for c in claims if c.get("band")))
        if sweeps:
            lines += ["Bands swept over:", ""] + [f"{i + 1}. {_cell(s)}" for i, s in enumerate(sweeps)] + [""]
        by_kind = {k: [c for c in claims if c.get("kind", "reproduction") == k] for k in KINDS}
        for kind, title in zip(KINDS, _KIND_TITLES):
            if by_kind[kind]:
                lines += _claims_table(by_kind[kind], title, sweeps)
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


_KIND_TITLES = ("Claims on the paper's numbers",
                "Invariants (true by construction; not evidence of reproduction)",
                "Recorded (not judged)")


def _fmt_band(c: dict, sweeps: list[str]) -> str:
    """``lo .. hi (n)``, ``n`` numbering what the band swept in the experiment's list (``sweeps``)."""
    band = c.get("band")
    if not band:
        return "-"
    over = band.get("over", "?")
    return f"{_fmt(band.get('min'))} .. {_fmt(band.get('max'))}" + (f" ({sweeps.index(over) + 1})" if over in sweeps
                                                                    else "")


def _claims_table(claims: list[dict], title: str, sweeps: list[str] = ()) -> list[str]:
    """A short table (claim, paper number, paper, ours, band, tolerance, verdict), then each claim's note and its
    sensitivity rows as a list below it: no cell holds a paragraph, and what a band swept is listed once per
    experiment (``sweeps``)."""
    sweeps = list(sweeps)
    lines = [f"{title}:", "", "| claim | paper number | paper | ours | band | tolerance | verdict |",
             "|---|---|---|---|---|---|---|"]
    notes = []
    for c in claims:
        tolerance = fmt_interval(c.get("accept")) or c.get("tolerance", "") or "-"
        lines.append(_row([f"`{c['name']}`", c.get("paper_id") or c.get("cross_check") or "-",
                           _fmt(c.get("paper"), missing="-"), _ours(c), _fmt_band(c, sweeps), tolerance,
                           verdict_text(c)]))
        extra = [c.get("note") or ""]
        extra += [f"{v['variant']}: {_fmt(v.get('ours'))}"
                  + ("" if v.get("holds") is None else f" ({'holds' if v['holds'] else 'fails'})")
                  for v in c.get("variants") or []]
        text = "; ".join(e for e in extra if e)
        if text:
            notes.append(f"- `{c['name']}`: {_cell(text)}")
    return lines + [""] + notes + [""]


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
