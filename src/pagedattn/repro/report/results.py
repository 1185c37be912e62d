"""The results convention of ../shared/DESIGN.md: one ``summary.json`` per experiment, and a generated
``results/SUMMARY.md`` table of paper vs reproduced numbers (never edited by hand).

Run ``python -m pagedattn.repro.report.results`` to regenerate ``results/SUMMARY.md`` from every ``summary.json`` present
(``python -m pagedattn.repro.report.readme``, ``make summary``: README.md's generated blocks too); ``--check`` lists the stale
results instead.

Freshness (issue 26): each ``summary.json`` carries a ``provenance`` block, the content hash of every ``pagedattn``
source file the run had imported, of the notebook's source (cell types and sources, not outputs) and of
``requirements.txt``, with paths relative to the repository root. A result whose recorded hashes differ from the
files now, or that records none, is stale, and SUMMARY.md says so.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagedattn.cpuinfo import cpu_field, cpu_flags

from pagedattn.repro import REPO_ROOT

RESULTS_DIR = REPO_ROOT / "results"
QUICK_RESULTS_DIR = RESULTS_DIR / "quick"  # quick runs (git-ignored): never the committed results
STALE_FILE = "STALE"  # written beside a summary.json whose notebook's last run failed (see reproduce.py)
QUICK_RUN_RECORD = "quick/quick_reproduce.json"  # under the results root, git-ignored: the last whole quick run's wall time
RUN_FILE = "run.json"  # written beside a summary.json by reproduce.py: the notebook's duration, jobs, machine, date
NOTEBOOK_ENV = "PAGEDATTN_NOTEBOOK"  # set by reproduce.run_notebook: the notebook's path, relative to the repo root


KINDS = ("reproduction", "invariant", "tracking")


@dataclass
class Claim:
    """One named, paper-vs-ours number. ``ours is None`` means the run could not measure it (``note`` says why).

    ``kind`` (DESIGN.md, results convention): ``"reproduction"`` compares with the paper; ``"invariant"`` is true by
    construction (arithmetic, the block manager's waste bound) and is listed apart in SUMMARY.md; ``"tracking"`` is
    recorded, not judged (CPU timings). ``band`` is ``None`` or ``{"min": x, "max": y, "over": "what was swept"}``
    for a claim that rests on assumptions; ``holds`` is then true only if the claim holds across the band.
    ``reason`` is one line, written by the experiment that measured the claim, saying why it holds or fails (issue 51:
    the scoreboard shows it; it is never typed into the README). Claims from runs before this field read as ``""``.
    """

    name: str
    paper: Any
    ours: Any
    unit: str = ""
    tolerance: str = ""
    holds: bool | None = None
    note: str = ""
    kind: str = "reproduction"
    band: dict | None = None
    reason: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Claim {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.band is not None:
            missing = {"min", "max", "over"} - set(self.band)
            if missing:
                raise ValueError(f"Claim {self.name!r}: band needs keys min, max, over; missing {sorted(missing)}")
        if "\n" in self.reason:
            raise ValueError(f"Claim {self.name!r}: reason must be one line")


def cpu_name() -> str:
    return cpu_field("model name") or platform.processor() or platform.machine()


def cpu_isa(flags: str | None = None) -> str:
    """The CPU's widest vector extensions from its feature flags (``cpuinfo.cpu_flags``, or ``flags``):
    ``"AVX-512, AMX"``, ``"AVX-512 BF16"``, ``"AVX-512"``, ``"AVX2"``, or ``""`` where unknown. Machines of one name
    differ by these (two "AMD EPYC" VMs here ran the same replays 2-3x apart, one with AVX-512 BF16, one with AVX2
    only), and bf16 matmuls run in hardware only with AMX or AVX-512 BF16, so CPU timings say which."""
    have = set((cpu_flags() if flags is None else flags).split())
    if "avx512f" in have:
        return "AVX-512, AMX" if "amx_tile" in have else "AVX-512 BF16" if "avx512_bf16" in have else "AVX-512"
    return "AVX2" if "avx2" in have else ""


def hardware_label(device: str = "cpu") -> str:
    """``"cpu: <model name> (<vector extensions>), N cores"`` (``cpu_isa``) or ``"cuda: <device name>"``; every result
    is labelled with it."""
    if str(device).startswith("cuda"):
        import torch

        return f"cuda: {torch.cuda.get_device_name(torch.device(device))}"
    isa = cpu_isa()
    isa = f" ({isa})" if isa else ""
    if device == "sim":
        return f"sim (cost model; host cpu: {cpu_name()}{isa}, {os.cpu_count()} cores)"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"cpu: {cpu_name()}{isa}, {cores} cores"


def today() -> str:
    return _dt.date.today().isoformat()


def json_safe(x: Any) -> Any:
    """JSON-safe: NaN/inf become None, numpy scalars become Python numbers."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):
        try:
            x = x.item()
        except (ValueError, AttributeError):
            pass
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def write_benchmark(summary: dict, name: str, out: str | os.PathLike | None = None, quick: bool = False
                    ) -> Path | None:
    """Write a benchmark's JSON to ``out``, by default ``results/benchmarks/<name>.json``; a quick run writes
    nothing unless ``out`` is given. Returns the path written, if any."""
    path = Path(out) if out else (None if quick else RESULTS_DIR / "benchmarks" / f"{name}.json")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(json_safe(summary), indent=2) + "\n")
        print(f"wrote {path}")
    return path


def write_summary(out_dir: str | os.PathLike, experiment: str, hardware: str, model: str, quick: bool,
                  claims: list[Claim], extra: dict | None = None, notebook: str | None = None) -> Path:
    """Write ``<out_dir>/summary.json`` in the convention of DESIGN.md and return its path.

    ``notebook`` (a path relative to the repository root) defaults to ``$PAGEDATTN_NOTEBOOK``, which
    ``reproduce.run_notebook`` sets; the ``provenance`` block hashes it beside the imported sources. Keys are sorted
    and nothing in the file depends on the process that wrote it (timings go to ``run.json``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"experiment": experiment, "hardware": hardware, "model": model, "date": today(), "quick": bool(quick),
           "claims": [json_safe(asdict(c)) for c in claims],
           "provenance": provenance(notebook or os.environ.get(NOTEBOOK_ENV))}
    if extra:
        doc["extra"] = json_safe(extra)
    path = out / "summary.json"
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return path


def source_hash(path: Path) -> str:
    """sha256 (first 16 hex digits) of a file; of a notebook, only its cells' types and sources, so that executing
    it (outputs, counts, papermill metadata) leaves the hash unchanged."""
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        data = json.dumps([[c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list) else c["source"]]
                           for c in cells]).encode()
    else:
        data = path.read_bytes()
    return hashlib.sha256(data).hexdigest()[:16]


def imported_sources(root: Path = REPO_ROOT) -> list[Path]:
    """The ``pagedattn`` source files this process has imported (``sys.modules`` entries whose file lies under
    ``<root>/src/pagedattn``), plus the C++ sources of the CPU kernel when ``pagedattn.kernels.cpu`` is loaded (it
    compiles them at run time)."""
    package = (root / "src" / "pagedattn").resolve()
    files = {Path(m.__file__).resolve() for m in list(sys.modules.values()) if getattr(m, "__file__", None)}
    found = {f for f in files if f.is_relative_to(package)}
    if "pagedattn.kernels.cpu" in sys.modules:
        found |= set((package / "kernels").glob("*.cpp"))
    return sorted(found)


def provenance(notebook: str | None = None, root: Path = REPO_ROOT) -> dict:
    """``{"files": {path relative to root: source_hash}}`` for the imported sources, ``requirements.txt`` and the
    notebook (relative to ``root``), if given."""
    root = Path(root).resolve()
    paths = imported_sources(root) + [root / "requirements.txt"] + ([root / notebook] if notebook else [])
    return {"files": {_relative(p, root): source_hash(p) for p in paths if p.exists()}}


def _relative(path: Path, root: Path) -> str:
    """``path`` relative to ``root`` (posix), or absolute when it lies outside (a test's notebook in a tmp folder)."""
    path = path.resolve()
    return (path.relative_to(root) if path.is_relative_to(root) else path).as_posix()


def changed_files(doc: dict, root: Path = REPO_ROOT) -> list[str] | None:
    """The files of ``doc["provenance"]`` whose hash differs from the file under ``root`` now (a deleted file reads
    ``"<path> (deleted)"``); None when the summary records no provenance."""
    recorded = (doc.get("provenance") or {}).get("files")
    if not recorded:
        return None
    changed = []
    for rel, digest in sorted(recorded.items()):
        path = Path(root) / rel
        if not path.exists():
            changed.append(f"{rel} (deleted)")
        elif source_hash(path) != digest:
            changed.append(rel)
    return changed


def stale_reason(doc: dict, root: Path = REPO_ROOT) -> str | None:
    """Why a summary's numbers may no longer come from the code (None when every recorded hash matches)."""
    changed = changed_files(doc, root)
    if changed is None:
        return "no provenance recorded"
    return f"changed since the run: {', '.join(changed)}" if changed else None


NOT_MEASURED = "not measured"


def _fmt(v: Any, missing: str = NOT_MEASURED) -> str:
    """A cell: ``missing`` for None or NaN (``ours``: "not measured"; ``paper``: the paper gives no number)."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return missing
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x, missing) for x in v) + "]"
    return str(v)


def render_summary_md(results_dir: str | os.PathLike = RESULTS_DIR, root: Path = REPO_ROOT) -> str:
    """The text of ``SUMMARY.md`` for every ``<results_dir>/*/summary.json``: each result's claims, marked STALE when
    its last run failed (a ``STALE`` file) or its sources under ``root`` changed since (provenance), and the timing
    table of the ``run.json`` records."""
    results = Path(results_dir)
    lines = ["# Paper vs reproduced", "",
             "Generated by `python -m pagedattn.repro.report.results` from every `results/*/summary.json`; do not edit by hand.", ""]
    summaries = sorted(results.glob("*/summary.json"))
    if not summaries:
        lines.append("No results yet: run `make reproduce`.")
    for path in summaries:
        doc = json.loads(path.read_text())
        failed = path.parent / STALE_FILE
        reasons = [r for r in [failed.read_text().strip() if failed.exists() else None, stale_reason(doc, root)] if r]
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
    return "\n".join(lines + _timing_table(read_runs(results)))


def build_summary_md(results_dir: str | os.PathLike = RESULTS_DIR) -> Path:
    """Write :func:`render_summary_md` to ``<results_dir>/SUMMARY.md`` and return its path."""
    out = Path(results_dir) / "SUMMARY.md"
    out.write_text(render_summary_md(results_dir))
    return out


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
    lines += [f"| total (wall) | {wall_seconds(runs) / 60:.1f} | | | | | | |", "",
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


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedattn.repro.report.results``: regenerate SUMMARY.md (``python -m pagedattn.repro.report.readme``: README.md's
    generated blocks too); ``--check``: list stale results and exit 1 if there is any."""
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
