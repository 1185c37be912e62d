"""The reproduced figures' library code (issue 30, part 6): every system on every panel, off-scale points kept, the
paper's values in the legend, titles naming the model and the trace. Small frames in, no committed result read."""
import pandas as pd

from pagedattn.repro.report import plots
from pagedattn.repro.paper import FIG12_RATE_RATIO, FIG14_GAIN, FIG15_SAVING

LABELS = {"ft": "FasterTransformer", "orca_max": "Orca (Max)", "orca_oracle": "Orca (Oracle)", "paged": "vLLM (ours)"}


def _legend_labels(fig) -> list[str]:
    return [t.get_text() for lg in fig.legends for t in lg.get_texts()]


def test_fig12_panels_keep_every_system_and_mark_the_paper():
    # FT is off the scale at every rate; Orca (Oracle) lies on ours' points.
    lat = {"ft": [5.0, 9.0], "orca_max": [0.1, 3.0], "orca_oracle": [0.05, 0.1], "paged": [0.05, 0.1]}
    curves = pd.DataFrame([{"model": m, "trace": w, "rate": r, "system": s, "label": LABELS[s],
                            "normalized_latency_s": lat[s][i]}
                           for m in ("OPT-13B", "OPT-175B") for w in ("sharegpt", "alpaca")
                           for s in LABELS for i, r in enumerate((1.0, 2.0))])
    sus = pd.DataFrame([{"model": m, "trace": w, "system": s, "sustainable_rate": 1.0}
                        for m in ("OPT-13B", "OPT-175B") for w in ("sharegpt", "alpaca") for s in LABELS])
    panels = [{"model": m, "trace": w} for w in ("sharegpt", "alpaca") for m in ("OPT-13B", "OPT-175B")]
    fig = plots.fig12_panels(curves, sus, 0.2, FIG12_RATE_RATIO, panels, plots.setup_title, label="x")
    axes = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in axes][:2] == ["OPT-13B (1 x A100-40GB), ShareGPT (real, OPT tokens)",
                                                   "OPT-175B (8 x A100-80GB), ShareGPT (real, OPT tokens)"]
    for ax in axes:
        assert {line.get_label() for line in ax.get_lines()} >= set(LABELS.values())
        assert ax.get_ylim()[1] > 1.0 and ax.get_yscale() == "linear"  # the off-scale strip sits above 1 s/token
        ft = next(line for line in ax.get_lines() if line.get_label() == "FasterTransformer")
        assert all(1.0 < y < ax.get_ylim()[1] for y in ft.get_ydata())  # drawn in the strip, not off the panel
    legend = _legend_labels(fig)
    assert "paper: ours at 1.7-2.7x Orca (Oracle)'s rate" in legend
    assert "paper: ours at 2.7-8x Orca (Max)'s rate" in legend
    assert any(label.startswith("above 1 s/token") for label in legend)


def test_sustainable_rates_beyond_the_swept_curves_are_marked_on_the_threshold():
    """Issue 61: a latency curve swept to 2 req/s whose systems sustain 5 and 9 req/s still shows where each ratio is
    read: a diamond per system on the threshold, the x axis widened to take them in, and a legend entry."""
    curves = pd.DataFrame([{"trace": "sharegpt", "rate": r, "system": s, "label": LABELS[s],
                            "normalized_latency_s": 0.01 * r} for s in ("orca_oracle", "paged") for r in (1.0, 2.0)])
    sus = pd.DataFrame([{"trace": "sharegpt", "system": s, "label": LABELS[s], "sustainable_rate": r}
                        for s, r in (("orca_oracle", 5.0), ("paged", 9.0))])
    fig = plots.fig12_panels(curves, sus, 0.1, None, ymax=0.5, mark_rates=True)
    ax = next(ax for ax in fig.axes if ax.get_title())
    diamonds = [line for line in ax.get_lines() if line.get_marker() == "D"]
    assert sorted((float(d.get_xdata()[0]), float(d.get_ydata()[0])) for d in diamonds) == [(5.0, 0.1), (9.0, 0.1)]
    assert ax.get_xlim()[1] >= 9.0 and plots.sustainable_handle().get_label() in _legend_labels(fig)
    unmarked = plots.fig12_panels(curves, sus, 0.1, None, ymax=0.5)
    assert not [line for ax in unmarked.axes for line in ax.get_lines() if line.get_marker() == "D"]
    live = curves.rename(columns={"normalized_latency_s": "nl_measured_s"}).assign(nl_predicted_s=float("nan"))
    fig = plots.online_curves(live, 0.1, sustainable=sus.assign(which=["measured", "predicted"]))
    open_ = [d.get_markerfacecolor() for d in fig.axes[0].get_lines() if d.get_marker() == "D"]
    assert open_[1] == "white" != open_[0]  # the simulator's rate is an open diamond


def test_fig14_panels_mark_the_papers_gains():
    rows = [("n=1", 1), ("parallel", 2), ("beam", 2), ("beam", 6)]
    curves = pd.DataFrame([{"method": m, "width": n, "rate": r, "system": s, "label": LABELS[s],
                            "normalized_latency_s": 0.1 * r} for m, n in rows
                           for s in ("orca_oracle", "paged") for r in (1.0, 2.0, 3.0)])
    gain = pd.DataFrame([{"method": m, "width": n, "preemption": "vllm", "rate_orca_oracle": 1.0, "rate_paged": 2.0}
                         for m, n in rows])
    fig = plots.fig14_panels(curves, gain, FIG14_GAIN, 0.2, "OPT-13B, Alpaca")
    legend = _legend_labels(fig)
    assert "paper: ours at 1.3x Orca (Oracle)'s rate (n = 1)" in legend
    assert "paper: ours at 2.3x Orca (Oracle)'s rate (beam width 6)" in legend
    assert fig._suptitle.get_text() == "OPT-13B, Alpaca"


def test_fig15_names_the_papers_lines_in_the_legend():
    sav = pd.DataFrame([{"trace": w, "method": m, "width": n, "saving_pct": 10.0 * n}
                        for w in ("alpaca", "sharegpt", "sharegpt_synthetic") for m in ("parallel", "beam")
                        for n in (2, 4, 6)])
    legend = _legend_labels(plots.fig15_savings(sav, FIG15_SAVING, ("alpaca", "sharegpt"), "sharegpt_synthetic"))
    assert {"parallel · paper (per width)", "beam · paper (per width)", "beam · paper (range over widths 2-6)",
            "parallel · paper (range over widths 2-6)"} <= set(legend)


def test_savefig_records_figure_metadata(tmp_path):
    """plots.savefig writes the figure's record into the PNG: the paper's figure, its marks, each axes' scales and
    number of data artists."""
    import json

    import matplotlib.pyplot as plt
    from PIL import Image

    from pagedattn.repro.report import plots
    fig, (a, b) = plt.subplots(1, 2)
    a.plot([1, 2], [3, 4])
    a.axhline(1.67)
    b.plot([1, 2], [1, 10])  # savefig refuses an empty axes (test_empty_axes_are_detected_and_not_saved)
    b.set_yscale("log")
    path = plots.savefig(fig, tmp_path / "f.png", figure="Fig. 16", paper_marks=[1.67])
    plt.close(fig)
    rec = json.loads(Image.open(path).text[plots.FIGURE_META_KEY])
    assert rec["figure"] == "Fig. 16" and rec["paper_marks"] == [1.67]
    assert [ax["yscale"] for ax in rec["axes"]] == ["linear", "log"]
    assert rec["axes"][0]["artists"] == 2 and rec["axes"][1]["artists"] == 1


def _saved(fig, path, **kw):
    import json

    import matplotlib.pyplot as plt
    from PIL import Image
    p = plots.savefig(fig, path, **kw)
    plt.close(fig)
    with Image.open(p) as im:
        return json.loads(im.text[plots.FIGURE_META_KEY]), im.size


def test_footnote_wraps_to_the_figure_width(tmp_path):
    """A long footnote (a label naming hardware, model and date) wraps instead of widening the saved canvas."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot([0, 1], [0, 1])
    plots.footnote(fig, "sim: LLaMA-13B KV (800 KB/token) on A100-40GB | cpu: AMD EPYC, 2 cores | " * 12)
    _, (width, height) = _saved(fig, tmp_path / "f.png")
    assert width <= 6 * plots.SAVE_DPI + 10
    assert height > 3 * plots.SAVE_DPI  # the wrapped lines are below the axes, on the canvas
    assert all(len(line) < 200 for line in plots.wrap_to_width("x " * 500, 6).split("\n"))


def test_mark_paper_draws_and_records(tmp_path):
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2)
    a.bar([0, 1], [1.0, 2.0])
    plots.mark_paper(a, 1.67, span=(-0.4, 0.4))
    plots.mark_paper(a, 3.58)
    b.plot([1, 2], [1, 2])
    plots.mark_paper(b, (1.2, 1.26), label="paper band")
    plots.mark_paper(b, 16, axis="x")
    assert "paper" in [line.get_label() for line in a.get_lines()]
    rec, _ = _saved(fig, tmp_path / "m.png", figure="Fig. 16", paper_marks=[9.0])
    assert rec["paper_marks"] == [9.0, 1.67, 3.58, 1.2, 1.26, 16.0]


def test_figure_helpers_record_the_papers_values(tmp_path):
    sav = pd.DataFrame([{"trace": w, "method": m, "width": n, "saving_pct": 10.0 * n}
                        for w in ("alpaca", "sharegpt") for m in ("parallel", "beam") for n in (2, 4, 6)])
    rec, _ = _saved(plots.fig15_savings(sav, FIG15_SAVING, ("alpaca", "sharegpt")), tmp_path / "s.png")
    assert {6.09, 37.56, 16.2, 66.3} <= set(rec["paper_marks"])


def test_log2_axes_record_their_base(tmp_path):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    ax.plot([1, 256], [1, 2])
    ax.set_xscale("log", base=2)
    rec, _ = _saved(fig, tmp_path / "l.png")
    assert rec["axes"][0]["xscale"] == "log" and rec["axes"][0]["xbase"] == 2.0 and rec["axes"][0]["ybase"] is None


def test_empty_axes_are_detected_and_not_saved(tmp_path):
    import matplotlib.pyplot as plt
    import pytest
    fig, (a, b, c) = plt.subplots(1, 3)
    a.plot([1, 2], [1, 2])
    c.axis("off")  # a hidden axes (no frame) is layout, not an empty chart
    assert plots.empty_axes(fig) == [b]
    assert [ax["artists"] for ax in plots.figure_record(fig)["axes"]] == [1, 0]
    with pytest.raises(ValueError, match="draw nothing"):
        plots.savefig(fig, tmp_path / "e.png")
    assert not (tmp_path / "e.png").exists()
    plt.close(fig)


def test_sensitivity_plot_draws_no_empty_chart(capsys):
    """Claims without a numeric paper value (block-size sets, tracking-only claims) leave nothing to draw: no figure,
    and a sentence saying why."""
    from pagedattn.repro.experiments import sensitivity
    table = pd.DataFrame([{"claim": "best_block_size.sharegpt", "point": "default", "ours": "16,32", "holds": True,
                           "is_default": True}])
    claims = [{"name": "best_block_size.sharegpt", "paper": [16, 32, 64, 128]}]
    assert sensitivity.plot(table, claims) is None
    assert "no claim here has a numeric paper value" in capsys.readouterr().out


def test_fig18a_legend_tells_block_sizes_from_batches_and_fig2_names_the_papers_bars():
    """Issue 61: latency_ratio.png's legend gave batch 8 and 32 the colours of block sizes 8 and 32 (same labels); the
    paper's Fig. 2 bars were labelled "vLLM (ours) · paper"."""
    from pagedattn.repro.experiments import attention_kernel as ak
    from pagedattn.repro.experiments import kv_waste

    rows = [{"block_size": bs, "batch": b, "context": c, "ratio_vs_sdpa": 2.0, "ratio_same_code": 1.0}
            for bs in (8, 16, 32) for b in (8, 32) for c in (64, 128)]
    meta = {"hardware": "cpu: x", "quick": False, "labels": {"paged": "paged", "sdpa": "sdpa"}}
    fig = ak.plot_ratios({"cpu-x": {"df": pd.DataFrame(rows), "meta": meta}})
    legend = _legend_labels(fig)
    assert legend[:5] == ["block 8", "block 16", "block 32", "batch 8", "batch 32"]
    handles = fig.legends[0].legend_handles
    assert len({h.get_color() for h in handles[:3]}) == 3 and {h.get_linestyle() for h in handles[3:5]} == {"-", "--"}
    assert fig.axes[0].get_yscale() == "log" and fig.axes[0].get_ylim()[0] < 1.2  # the paper's band on the axis
    assert kv_waste.paper_label("paged") == "vLLM" and kv_waste.paper_label("orca_max") == "Orca (Max)"
