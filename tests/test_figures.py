"""Figures that tell the truth (issue 51, item 5): every committed reproduction of a paper figure
(``results/<notebook>/fig*.png``; never ``results/quick``) states which paper figure it is, marks the paper's values,
draws something on every axes, fits a 2,400 px wide canvas and uses the paper's axis scales.

Every committed figure carries its full record (``plots.savefig``'s ``pagedattn`` text chunk, with ``figure``,
``paper_marks`` and each axes' scales): a PNG without one fails. Everything a record states is checked."""
import json

import pytest
from PIL import Image

from pagedattn.repro.report import plots
from pagedattn.repro.report.results import RESULTS_DIR

FIGURES = sorted(p for p in RESULTS_DIR.glob("*/fig*.png") if p.parent.name != "quick")

#: figures that mark no paper value, and why
NO_PAPER_MARK = {
    "fig12_latency_real.png": "a tiny random OPT on this CPU: the paper's A100 rate ratios have no counterpart",
    "fig11_input_vs_output.png": "the paper shows the two length distributions, not their joint distribution",
}

#: the paper's axis scales, by file-name prefix: {"x"|"y": (scale, log base or None)}
EXPECTED_SCALES = {
    "fig11_variants_linear": {"x": ("linear", None)},  # Fig. 11: token counts on a linear axis
    # (fig11_histograms is the log-x companion view; the linear one above is the paper's)
    "fig12_": {"x": ("linear", None), "y": ("linear", None)},  # Fig. 12: latency vs rate, both linear
    "fig14_curves": {"x": ("linear", None), "y": ("linear", None)},
    "fig16_latency": {"x": ("linear", None), "y": ("linear", None)},
    "fig17_latency": {"x": ("linear", None), "y": ("linear", None)},
    "fig18b_": {"x": ("log", 2.0)},  # Fig. 18b: block sizes 1..256 on a log2 axis
    "fig19a_": {"x": ("log", 2.0)},  # Fig. 19: block sizes on a log2 axis
    "fig19b_": {"x": ("log", 2.0)},
}


def _record(path):
    with Image.open(path) as im:
        raw = im.text.get(plots.FIGURE_META_KEY)
        size = im.size
    return (json.loads(raw) if raw else None), size


def test_there_are_committed_figures():
    assert FIGURES, f"no results/*/fig*.png under {RESULTS_DIR}"


@pytest.mark.parametrize("path", FIGURES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_figure_tells_the_truth(path):
    rec, (width, _) = _record(path)
    # checks that need no record first
    assert width <= plots.MAX_WIDTH_PX, f"{width} px wide"
    assert rec is not None and all("xbase" in ax for ax in rec["axes"]), \
        "no full figure record (plots.savefig writes it): written by an older run or by another writer"
    assert rec["figure"], "no paper figure named (plots.savefig(..., figure='Fig. N'))"
    assert rec["axes"], "no axes recorded"
    assert all(ax["artists"] > 0 for ax in rec["axes"]), f"an empty axes: {rec['axes']}"
    if path.name in NO_PAPER_MARK:
        assert rec["paper_marks"] == [], "listed as marking no paper value, but marks some: update NO_PAPER_MARK"
    else:
        assert rec["paper_marks"], "marks no paper value"
        assert all(isinstance(v, (int, float)) for v in rec["paper_marks"])
    for prefix, scales in EXPECTED_SCALES.items():
        if path.name.startswith(prefix):
            for axis, (scale, base) in scales.items():
                for ax in rec["axes"]:
                    assert ax[f"{axis}scale"] == scale, f"{axis} axis {ax[f'{axis}scale']}, paper's {scale}"
                    if base is not None:
                        assert ax[f"{axis}base"] == base, f"{axis} axis log base {ax[f'{axis}base']}, paper's {base}"
