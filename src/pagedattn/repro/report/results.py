"""The results convention of ../shared/DESIGN.md: one ``summary.json`` per experiment, and a generated
``results/SUMMARY.md`` table of paper vs reproduced numbers (never edited by hand).

``Claim`` carries the verdict's inputs (issue 51): :func:`verdict`, :func:`strict_verdict` and a fallback reason
(:func:`measured_reason`); :func:`verdict_table` is each notebook's table of its claims. ``report.scoreboard``
renders ``results/SUMMARY.md`` and ``DETAILS.md`` from the stored claims (``python -m
pagedattn.repro.report.scoreboard``).

Freshness (issue 26): each ``summary.json`` carries a ``provenance`` block, the content hash of every ``pagedattn``
source file the run had imported, of the notebook's source (cell types and sources, not outputs) and of
``requirements.txt``, with paths relative to the repository root. A result whose recorded hashes differ from the
files now, or that records none, is stale, and SUMMARY.md says so.
"""
from __future__ import annotations

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
from pagedattn.repro.progress import NOTEBOOK_ENV  # noqa: F401  (reproduce and write_summary use it)

RESULTS_DIR = REPO_ROOT / "results"
QUICK_RESULTS_DIR = RESULTS_DIR / "quick"  # quick runs (git-ignored): never the committed results
STALE_FILE = "STALE"  # written beside a summary.json whose notebook's last run failed (see reproduce.py)
QUICK_RUN_RECORD = "quick/quick_reproduce.json"  # under the results root, git-ignored: the last whole quick run's wall time
RUN_FILE = "run.json"  # written beside a summary.json by reproduce.py: the notebook's duration, jobs, machine, date


KINDS = ("reproduction", "invariant", "tracking")


@dataclass
class Claim:
    """One named, paper-vs-ours number. ``ours is None`` means the run could not measure it (``note`` says why).

    ``kind`` (DESIGN.md, results convention): ``"reproduction"`` compares with the paper; ``"invariant"`` is true by
    construction (arithmetic, the block manager's waste bound) and is listed apart in SUMMARY.md; ``"tracking"`` is
    recorded, not judged (CPU timings). ``band`` is ``None`` or ``{"min": x, "max": y, "over": "what was swept"}``
    for a claim that rests on assumptions; ``holds`` is then true only if the claim holds across the band.
    ``reason`` is one line, written by the experiment that measured the claim, saying why it holds or fails (issue 51:
    the scoreboard shows it; it is never typed into the README). An experiment that gives none gets
    :func:`measured_reason`'s, built from the claim's own fields when ``summary.json`` is written.

    Two intervals make the verdicts of the scoreboard (``[lo, hi]``, ``None`` for an open end):

    - ``accept``: the interval the measured value is judged against, the paper's value or range widened by the
      stated tolerance (``sensitivity.WIDEN``, points, ...). A claim that fails while ``ours`` lies inside it fails
      *only at a band corner* (:func:`verdict`);
    - ``strict``: the paper's own value and tolerance, with no widening: its reported range, or a single value to
      the precision it was printed with (:func:`printed_interval`). :func:`strict_verdict` judges ``ours`` by it.

    ``at_measured`` (the verdict of ``ours`` alone, no band) is derived from ``accept`` where not given; claims that
    are not intervals (sets of block sizes, orderings) pass it themselves.

    One paper number, one claim (issue 61): ``paper_id`` names the entry of ``repro.paper.REGISTRY`` that a claim
    judges, ``cross_check`` the entry that a recorded claim measures again beside its owner, and ``variants`` are the
    claim's sensitivity rows (another trace, a forced preemption mode: ``{"variant", "name", "ours", "holds"}``),
    folded under it by :func:`apply_registry` when ``summary.json`` is written.
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
    accept: list | None = None
    strict: list | None = None
    at_measured: bool | None = None
    paper_id: str | None = None
    cross_check: str | None = None
    variants: list | None = None

    def __post_init__(self):
        for name in ("accept", "strict"):
            interval = getattr(self, name)
            if interval is not None:
                if len(interval) != 2:
                    raise ValueError(f"Claim {self.name!r}: {name} must be [lo, hi], got {interval!r}")
                setattr(self, name, [None if v is None else float(v) for v in interval])
        if self.at_measured is None and self.accept is not None and _is_number(self.ours):
            self.at_measured = within(self.ours, self.accept)
        if self.kind not in KINDS:
            raise ValueError(f"Claim {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.band is not None:
            missing = {"min", "max", "over"} - set(self.band)
            if missing:
                raise ValueError(f"Claim {self.name!r}: band needs keys min, max, over; missing {sorted(missing)}")
        if "\n" in self.reason:
            raise ValueError(f"Claim {self.name!r}: reason must be one line")


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def within(x: float, interval: list | tuple) -> bool:
    """``lo <= x <= hi``, an end that is ``None`` being open."""
    lo, hi = interval
    return (lo is None or x >= lo) and (hi is None or x <= hi)


def printed_interval(value: float | str) -> list[float]:
    """A paper's single value to the precision it was printed with: ``1.3`` -> ``[1.25, 1.35]``, ``30.42`` ->
    ``[30.415, 30.425]``, ``22`` -> ``[21.5, 22.5]`` (the strict tolerance of a value the paper gives without a
    spread)."""
    text = str(value)
    decimals = len(text.split(".")[1]) if "." in text else 0
    half = 0.5 * 10 ** -decimals
    v = float(text)
    return [round(v - half, decimals + 1), round(v + half, decimals + 1)]


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
           "claims": [json_safe({**asdict(c), "reason": c.reason or measured_reason(c)})
                      for c in apply_registry(experiment, claims)],
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


#: The scoreboard's verdicts (issue 61): a number the paper states is *reproduced* (inside the accepted interval, the
#: paper's value widened by the stated tolerance, at our value and at every point of the swept assumptions),
#: *reproduced at our value, not across the assumptions* (some points of the band fall outside), *not reproduced*, or
#: *not measured*. A claim that judges no paper number is an *invariant* (true by construction) or *recorded*.
HOLDS, FAILS, CORNER = "reproduced", "not reproduced", "reproduced at our value, not across the assumptions"
RECORDED, INVARIANT = "recorded", "invariant"
VERDICTS = (HOLDS, CORNER, FAILS, NOT_MEASURED, INVARIANT, RECORDED)
WITHIN_PCT = 10  #: the tally also counts the numbers whose difference from the paper is at most this (percent)

#: The sensitivity rows that :func:`apply_registry` folds under their claim: ``<claim>.<suffix>`` -> what differs.
VARIANT_SUFFIXES = {"synthetic": "synthetic ShareGPT-like trace", "forced_swap": "preemption forced to swapping",
                    "forced_recompute": "preemption forced to recomputation",
                    "knee": "judged at the knee's latency threshold instead"}


def _claim_dict(c: Claim | dict) -> dict:
    return asdict(c) if isinstance(c, Claim) else c


def verdict(c: Claim | dict) -> str:
    """One of :data:`VERDICTS`. A failing claim whose measured value alone passes (``at_measured``) is reproduced at
    our value, not across the assumptions; an invariant that checks a paper number (``paper_id``) is reproduced or
    not by construction."""
    c = _claim_dict(c)
    kind = c.get("kind", "reproduction")
    if kind == "tracking":
        return RECORDED
    if kind == "invariant" and not c.get("paper_id"):
        return INVARIANT
    if c.get("ours") is None or c.get("holds") is None:
        return NOT_MEASURED
    if c["holds"]:
        return HOLDS
    return CORNER if c.get("at_measured") and kind == "reproduction" else FAILS


def verdict_text(c: Claim | dict) -> str:
    """:func:`verdict`, with how many points of the band fall outside where some do: "reproduced at our value, not
    across the assumptions (3 of 13 outside)"."""
    c = _claim_dict(c)
    v, band = verdict(c), c.get("band") or {}
    if v == CORNER and band.get("outside") is not None:
        return f"{v} ({band['outside']} of {band['points']} outside)"
    return v


def difference_pct(c: Claim | dict, paper: Any = None) -> float | None:
    """How far ``ours`` lies from the paper, in percent: from its value, or from the nearest end of its range (0
    inside); None where either is not a number (a set of block sizes, "comparable", not measured). ``paper``
    defaults to the registry's value of the claim's ``paper_id``, else the claim's ``paper``."""
    c = _claim_dict(c)
    ours = c.get("ours")
    if paper is None:
        from pagedattn.repro.paper import REGISTRY

        entry = REGISTRY.get(c.get("paper_id") or c.get("cross_check") or "")
        paper = entry.value if entry else c.get("paper")
    if not _is_number(ours):
        return None
    if isinstance(paper, (list, tuple)) and len(paper) == 2 and all(v is None or _is_number(v) for v in paper):
        lo, hi = paper
        if within(ours, [lo, hi]):
            return 0.0
        end = lo if lo is not None and ours < lo else hi
        return None if not end else 100.0 * (ours - end) / end
    if _is_number(paper) and paper:
        return 100.0 * (ours - paper) / paper
    return None


def fmt_pct(d: float | None) -> str:
    """``+4.1 %``, ``0 %`` or ``-``."""
    return "-" if d is None else "0 %" if d == 0 else f"{d:+.1f} %"


def apply_registry(experiment: str, claims: list[Claim]) -> list[Claim]:
    """The claims as ``summary.json`` stores them (issue 61, one paper number, one claim): each claim that judges a
    number of ``repro.paper.REGISTRY`` for ``experiment`` (its owner) names it (``paper_id``); a claim that measures
    another owner's number again is recorded (``kind="tracking"``, ``cross_check``); and every sensitivity row
    ``<claim>.<suffix>`` (:data:`VARIANT_SUFFIXES`) is folded under its claim as one of its ``variants``."""
    from dataclasses import replace

    from pagedattn.repro import paper

    owned, crossed = paper.owned_claims(experiment), paper.cross_check_claims(experiment)
    names = {c.name for c in claims}
    variants: dict[str, list[dict]] = {}
    kept = []
    for c in claims:
        base, _, suffix = c.name.rpartition(".")
        if suffix in VARIANT_SUFFIXES and base in names:
            variants.setdefault(base, []).append(json_safe({
                "variant": VARIANT_SUFFIXES[suffix], "name": c.name, "ours": c.ours,
                "holds": c.holds if c.kind != "tracking" else None, "band": c.band}))
        else:
            kept.append(c)
    out = []
    for c in kept:
        if c.name in owned:
            c = replace(c, paper_id=owned[c.name])
        elif c.name in crossed:
            pid, x = crossed[c.name]
            entry = paper.REGISTRY[pid]
            how = f"must agree within {100 * x.agree:g} %" if x.agree is not None else f"differs: {x.why}"
            c = replace(c, kind="tracking", holds=None, cross_check=pid,
                        reason=f"cross-check of {entry.owner}'s {pid}, recorded, not judged; {how}")
        if c.name in variants:
            c = replace(c, variants=variants[c.name])
        out.append(c)
    return out


def fmt_interval(interval: list | None) -> str:
    """``1.27-3.38``, ``>= 96``, ``<= 0.2`` or ``""``."""
    if not interval:
        return ""
    lo, hi = interval
    if lo is None:
        return f"<= {_fmt(hi)}"
    if hi is None:
        return f">= {_fmt(lo)}"
    return _fmt(lo) if lo == hi else f"{_fmt(lo)}-{_fmt(hi)}"


def measured_reason(c: Claim | dict) -> str:
    """The one-line reason a claim gets when its experiment wrote none, from its own fields: where ``ours`` and its
    band lie against ``accept`` (or the tolerance's words), or why nothing was judged."""
    c = _claim_dict(c)
    v, ours, accept, band = verdict(c), c.get("ours"), c.get("accept"), c.get("band")
    first = (c.get("note") or "").split(";")[0].strip()
    if v == INVARIANT:
        return f"true by construction ({c.get('tolerance') or 'equal'})"
    if v == RECORDED:
        return "recorded, not judged" + (f": {first}" if first else "")
    if v == NOT_MEASURED:
        return ("not measured: " + first) if ours is None and first else \
            "not measured" if ours is None else "measured but not judged: " + (first or "no agreed measurement")
    target = f"the accepted {fmt_interval(accept)}" if accept else f"'{c.get('tolerance', '')}'"
    if v == HOLDS:
        spread = f" and its band {_fmt(band.get('min'))}-{_fmt(band.get('max'))}" if band else ""
        return f"{_fmt(ours)}{spread} inside {target}"
    if v == CORNER:
        ends = [(e, band.get(e)) for e in ("min", "max")] if band else []
        out = [f"{'low' if e == 'min' else 'high'} end {_fmt(x)}" for e, x in ends
               if _is_number(x) and accept and not within(x, accept)]
        return f"{_fmt(ours)} inside {target}; the band's {' and '.join(out) or 'worst corner'} is outside"
    return f"{_fmt(ours)} outside {target}"


def verdict_rows(claims: list[Claim | dict]) -> list[dict]:
    """One row per claim, the paper's numbers first (in the order given), then the invariants and recorded claims:
    the registry's number (``paper_id``, or the number a cross-check measures again), the claim, the paper's value,
    ours (with its unit), the difference from the paper in percent (:func:`difference_pct`), the verdict
    (:func:`verdict_text`) and the reason."""
    ordered = sorted(map(_claim_dict, claims), key=lambda c: not c.get("paper_id"))
    return [{"paper number": c.get("paper_id") or c.get("cross_check") or "-", "claim": c["name"],
             "paper": _fmt(c.get("paper"), missing="-"),
             "ours": _fmt(c.get("ours")) + (f" {c['unit']}" if c.get("unit") and c.get("ours") is not None else ""),
             "difference": fmt_pct(difference_pct(c)), "verdict": verdict_text(c),
             "reason": c.get("reason") or measured_reason(c)} for c in ordered]


def verdict_table(claims: list[Claim | dict]):
    """:func:`verdict_rows` as a DataFrame."""
    import pandas as pd

    return pd.DataFrame(verdict_rows(claims))


def verdict_markdown(claims: list[Claim | dict]) -> str:
    """:func:`verdict_rows` as a Markdown table (each notebook's first output: ``show_verdicts``)."""
    rows = verdict_rows(claims)
    if not rows:
        return "No claims."
    cols = list(rows[0])
    cell = lambda v: str(v).replace("|", "/").replace("\n", " ")  # noqa: E731
    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                     + ["| " + " | ".join(cell(r[k]) for k in cols) + " |" for r in rows])


def show_claims(claims: list[Claim | dict]) -> None:
    """Display :func:`verdict_markdown` in a notebook."""
    from IPython.display import Markdown, display

    display(Markdown(verdict_markdown(claims)))


def variants_table(claims: list[Claim | dict]):
    """Each claim beside its sensitivity rows (``variants``: the synthetic trace, a forced preemption mode), one row
    per variant: the claim, the paper's value, ours and its verdict, the variant, its value and whether it holds."""
    import pandas as pd

    return pd.DataFrame([{"claim": c["name"], "paper": _fmt(c.get("paper"), missing="-"), "ours": _fmt(c.get("ours")),
                          "verdict": verdict(c), "variant": v["variant"], "variant's value": _fmt(v.get("ours")),
                          "variant holds": v.get("holds")}
                         for c in map(_claim_dict, claims) for v in c.get("variants") or []])


VERDICT_CELL_TAG = "verdicts"  #: the tag of each notebook's first code cell, which shows its verdicts


def verdicts_markdown(summary: dict) -> str:
    """The verdict cell's text for a stored ``summary.json``: its hardware, date and :func:`verdict_markdown`."""
    head = (f"**Verdicts of this run** ({summary['hardware']}; {summary['date']}"
            f"{'; quick mode' if summary.get('quick') else ''}): each number of the paper that this notebook judges, "
            "ours beside it; the method follows.")
    return head + "\n\n" + verdict_markdown(summary["claims"])


def show_verdicts(experiment: str, results_dir: str | os.PathLike = RESULTS_DIR) -> None:
    """The notebook's first output: its verdicts. ``make reproduce`` replaces this cell's output with the verdicts of
    the run that just finished (``reproduce.fill_verdicts``); run by hand, it shows those of the last stored run."""
    from IPython.display import Markdown, display

    path = Path(results_dir) / experiment / "summary.json"
    if not path.exists():
        display(Markdown(f"No stored run of {experiment} yet: its verdicts appear here after `make reproduce`."))
        return
    display(Markdown(verdicts_markdown(json.loads(path.read_text()))))


def fill_verdicts(notebook: str | os.PathLike, summary_path: str | os.PathLike) -> bool:
    """Set the output of ``notebook``'s verdict cell (tagged :data:`VERDICT_CELL_TAG`) to the verdicts of
    ``summary_path``, the run that just wrote it; False when the notebook has no such cell."""
    import nbformat

    if not Path(notebook).exists() or not Path(summary_path).exists():
        return False
    nb = nbformat.read(notebook, as_version=4)
    cells = [c for c in nb.cells if VERDICT_CELL_TAG in c.get("metadata", {}).get("tags", [])]
    if not cells:
        return False
    text = verdicts_markdown(json.loads(Path(summary_path).read_text()))
    cells[0].outputs = [nbformat.v4.new_output("display_data", data={"text/markdown": text,
                                                                      "text/plain": "<verdicts>"})]
    nbformat.write(nb, notebook)
    return True


def _fmt(v: Any, missing: str = NOT_MEASURED) -> str:
    """A cell: ``missing`` for None or NaN (``ours``: "not measured"; ``paper``: the paper gives no number)."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return missing
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x, missing) for x in v) + "]"
    return str(v)
