"""The results convention of ../shared/DESIGN.md: one ``summary.json`` per experiment, and a generated
``results/SUMMARY.md`` table of paper vs reproduced numbers (never edited by hand).

Run ``python -m pagedattn.results`` to regenerate ``results/SUMMARY.md`` from every ``summary.json`` present.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "results"
QUICK_RESULTS_DIR = RESULTS_DIR / "quick"  # quick runs (git-ignored): never the committed results
STALE_FILE = "STALE"  # written beside a summary.json whose notebook's last run failed (see reproduce.py)


KINDS = ("reproduction", "invariant", "tracking")


@dataclass
class Claim:
    """One named, paper-vs-ours number. ``ours is None`` means the run could not measure it (``note`` says why).

    ``kind`` (DESIGN.md, results convention): ``"reproduction"`` compares with the paper; ``"invariant"`` is true by
    construction (arithmetic, the block manager's waste bound) and is listed apart in SUMMARY.md; ``"tracking"`` is
    recorded, not judged (CPU timings). ``band`` is ``None`` or ``{"min": x, "max": y, "over": "what was swept"}``
    for a claim that rests on assumptions; ``holds`` is then true only if the claim holds across the band.
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

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Claim {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.band is not None:
            missing = {"min", "max", "over"} - set(self.band)
            if missing:
                raise ValueError(f"Claim {self.name!r}: band needs keys min, max, over; missing {sorted(missing)}")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def hardware_label(device: str = "cpu") -> str:
    """``"cpu: <model name>, N cores"`` or ``"cuda: <device name>"``; every result is labelled with it."""
    if str(device).startswith("cuda"):
        import torch

        return f"cuda: {torch.cuda.get_device_name(torch.device(device))}"
    if device == "sim":
        return f"sim (cost model; host cpu: {cpu_name()}, {os.cpu_count()} cores)"
    return f"cpu: {cpu_name()}, {len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()} cores"


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
                  claims: list[Claim], extra: dict | None = None) -> Path:
    """Write ``<out_dir>/summary.json`` in the convention of DESIGN.md and return its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"experiment": experiment, "hardware": hardware, "model": model, "date": today(), "quick": bool(quick),
           "claims": [json_safe(asdict(c)) for c in claims]}
    if extra:
        doc["extra"] = json_safe(extra)
    path = out / "summary.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    return path


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


def build_summary_md(results_dir: str | os.PathLike = RESULTS_DIR) -> Path:
    """Collect every ``results/*/summary.json`` into ``results/SUMMARY.md``."""
    root = Path(results_dir)
    lines = ["# Paper vs reproduced", "",
             "Generated by `python -m pagedattn.results` from every `results/*/summary.json`; do not edit by hand.", ""]
    summaries = sorted(root.glob("*/summary.json"))
    if not summaries:
        lines.append("No results yet: run `make reproduce`.")
    for path in summaries:
        doc = json.loads(path.read_text())
        stale = path.parent / STALE_FILE
        lines += [f"## {doc['experiment']}{' (STALE)' if stale.exists() else ''}", ""]
        if stale.exists():
            lines += [f"**Stale:** {stale.read_text().strip()}", ""]
        lines += [f"- hardware: {doc['hardware']}", f"- model: {doc['model']}",
                  f"- date: {doc['date']}{' (quick mode)' if doc.get('quick') else ''}", ""]
        by_kind = {k: [c for c in doc["claims"] if c.get("kind", "reproduction") == k] for k in KINDS}
        for kind, title in zip(KINDS, _KIND_TITLES):
            if by_kind[kind]:
                lines += _claims_table(by_kind[kind], title)
    out = root / "SUMMARY.md"
    out.write_text("\n".join(lines))
    return out


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


if __name__ == "__main__":
    print(build_summary_md())
