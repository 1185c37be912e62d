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
           "claims": [json_safe({**asdict(c), "reason": c.reason or measured_reason(c)}) for c in claims],
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


#: The scoreboard's verdicts (issue 51): a reproduction claim holds, fails, fails only at a corner of its band
#: (the measured value passes, the swept assumptions' worst end does not), or was not measured; invariants are
#: true by construction; tracking claims are recorded, not judged.
HOLDS, FAILS, CORNER, RECORDED, INVARIANT = "holds", "fails", "fails only at a band corner", "recorded", "invariant"
VERDICTS = (HOLDS, FAILS, CORNER, NOT_MEASURED, INVARIANT, RECORDED)


def _claim_dict(c: Claim | dict) -> dict:
    return asdict(c) if isinstance(c, Claim) else c


def verdict(c: Claim | dict) -> str:
    """One of :data:`VERDICTS`. A failing claim whose measured value alone passes (``at_measured``) fails only at a
    band corner."""
    c = _claim_dict(c)
    kind = c.get("kind", "reproduction")
    if kind == "invariant":
        return INVARIANT
    if kind == "tracking":
        return RECORDED
    if c.get("ours") is None or c.get("holds") is None:
        return NOT_MEASURED
    if c["holds"]:
        return HOLDS
    return CORNER if c.get("at_measured") else FAILS


def strict_verdict(c: Claim | dict) -> str:
    """The measured value judged by the paper's own value and tolerance (``strict``), no widening: ``holds``,
    ``fails``, or ``-`` where the claim has no strict interval (a qualitative claim, an invariant, not measured)."""
    c = _claim_dict(c)
    strict, ours = c.get("strict"), c.get("ours")
    if strict is None or not _is_number(ours) or c.get("kind", "reproduction") != "reproduction":
        return "-"
    return HOLDS if within(ours, strict) else FAILS


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


def verdict_table(claims: list[Claim | dict]):
    """The claims as a table, one row each, in the order given: claim, paper, ours (with its unit), tolerance (the
    accepted interval), band, verdict, the strict verdict at the paper's own value and the reason. Each notebook
    shows it for the claims it wrote to ``summary.json``."""
    import pandas as pd

    rows = []
    for c in map(_claim_dict, claims):
        band = c.get("band")
        rows.append({"claim": c["name"], "paper": _fmt(c.get("paper"), missing="-"),
                     "ours": _fmt(c.get("ours")) + (f" {c['unit']}" if c.get("unit") and c.get("ours") is not None
                                                    else ""),
                     "tolerance": fmt_interval(c.get("accept")) or c.get("tolerance", ""),
                     "band": f"{_fmt(band.get('min'))}-{_fmt(band.get('max'))}" if band else "",
                     "verdict": verdict(c), "strict": strict_verdict(c),
                     "reason": c.get("reason") or measured_reason(c)})
    return pd.DataFrame(rows)


def show_claims(claims: list[Claim | dict]) -> None:
    """Display :func:`verdict_table` in a notebook, every reason whole (pandas cuts cells at 50 characters)."""
    import pandas as pd
    from IPython.display import display

    with pd.option_context("display.max_colwidth", None):
        display(verdict_table(claims))


def _fmt(v: Any, missing: str = NOT_MEASURED) -> str:
    """A cell: ``missing`` for None or NaN (``ours``: "not measured"; ``paper``: the paper gives no number)."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return missing
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x, missing) for x in v) + "]"
    return str(v)
