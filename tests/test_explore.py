"""The explore sections of notebooks 01, 03, 04 and 05 (issue 28): each explorer builds its widget from one short
replay, a move of its control reruns the replay and changes the figure and the caption, the PNG a reader without a
kernel sees is the current figure, and, in headless Chromium, the four explore cells run live in JupyterLab, where a
dragged slider redraws every figure and no widget is disconnected."""
from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import pytest

from pagedattn.repro.experiments import explore
from pagedattn.repro.sim.capacity import Load
from pagedattn.repro.report.results import REPO_ROOT

from jupyterlab_browser import check_project_kernel, chromium_page, lab_server, open_and_run_all, require_chromium

#: each notebook's explorer and a move of its controls that must change what it shows
MOVES = {"kv_waste": [{"system": "orca_max"}, {"system": "paged", "block_size": 256}],
         "throughput": [{"rate": 5}, {"system": "orca_max"}],
         "sharing": [{"width": 6}, {"method": "beam"}],
         "block_size": [{"block_size": 256}]}
NOTEBOOKS = {"kv_waste": "01_kv_memory_waste", "throughput": "03_throughput", "sharing": "04_sharing",
             "block_size": "05_block_size"}


@pytest.mark.parametrize("name", MOVES)
def test_explorer_builds_and_a_move_redraws(name):
    e = getattr(explore, name)(quick=True)
    bundle = e._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert base64.b64decode(bundle["image/png"]) == e.png and e.png.startswith(b"\x89PNG")
    assert e.image.value == e.png
    seen = {e.png}
    for move in MOVES[name]:
        caption = e.caption.value
        e.set(**move)
        assert e.values().items() >= move.items()
        assert e.png not in seen and e.image.value == e.png and e.caption.value != caption, move
        seen.add(e.png)


def test_moving_back_shows_the_first_figure_again():
    e = explore.block_size(quick=True)
    first = e.png
    e.set(block_size=1)
    e.set(block_size=16)
    assert e.png == first


def test_the_throughput_caption_is_the_probes_verdict():
    """The caption reports the capacity rule's verdict of the replay it drew, at the rate chosen."""
    e = explore.throughput(quick=True, rates=(1, 16), rate=1)
    base = explore.short_trace("sharegpt", 1.0, quick=True)
    for rate in (1, 16):
        e.set(rate=rate)
        load = explore.replay(explore.with_rate(base, rate)).load()
        assert explore.verdict_line(load) in e.caption.value
    assert "-> ok" not in e.caption.value  # sixteen requests per second overload the short trace


def test_probe_log_records_each_probe():
    trace = explore.short_trace("sharegpt", 1.0, quick=True)
    log = explore.ProbeLog(lambda r: explore.replay(explore.with_rate(trace, r)).requests)
    for rate in (1.0, 8.0):
        log(rate)
    t = log.table()
    assert list(t.rate) == [1.0, 8.0] and list(t.probe) == [1, 2]
    assert t.verdict.iloc[1] == Load.of(explore.replay(explore.with_rate(trace, 8.0)).requests).verdict(0.2)


def test_queue_figure_slope_is_the_capacity_rules():
    r = explore.replay(explore.short_trace("sharegpt", 8.0, quick=True))
    fig = explore.queue_figure(r)
    (fit,) = [ln for ln in fig.axes[0].lines if ln.get_linestyle() == "--"]
    x, y = fit.get_data()
    assert (y[-1] - y[0]) / (x[-1] - x[0]) == pytest.approx(
        r.load().queue_growth)


def test_every_explore_notebook_ends_with_its_explorer():
    for name, nb in NOTEBOOKS.items():
        assert f"explore.{name}(quick=quick)" in "".join(explore_cells(nb)[-1]["source"]), nb


def explore_cells(notebook: str) -> list[dict]:
    """The cells of a notebook's explore section: from its "## Explore" heading to the next heading or the end."""
    cells = json.loads((REPO_ROOT / "notebooks" / f"{notebook}.ipynb").read_text())["cells"]
    (k,) = [i for i, c in enumerate(cells) if "".join(c["source"]).startswith("## Explore")]
    end = next((i for i in range(k + 1, len(cells)) if "".join(cells[i]["source"]).startswith("#")), len(cells))
    return cells[k:end]


# What each explorer shows, read from the page: caption, slider readout, image bytes (base64), plus every
# disconnected widget and widget error.
_STATE = """(async () => {
  const outs = [...document.querySelectorAll('.jp-OutputArea-output')]
    .filter(o => o.querySelector('.pa-explore-caption'));
  const views = [];
  for (const out of outs) {
    const img = out.querySelector('img');
    const bytes = new Uint8Array(await (await fetch(img.src)).arrayBuffer());
    let bin = ''; for (const b of bytes) bin += String.fromCharCode(b);
    views.push({caption: out.querySelector('.pa-explore-caption').textContent,
                readout: out.querySelector('.widget-readout').textContent.trim(), image: btoa(bin)});
  }
  return {views, disconnected: document.querySelectorAll('.jupyter-widgets-disconnected').length,
          errors: document.body.innerText.includes('Error displaying widget')};
})()"""


def _settled(cdp, n: int, settle: float = 1.5) -> dict:
    """The page's state once it shows ``n`` explorers and stays unchanged for ``settle`` s."""
    t0, last, since = time.monotonic(), None, time.monotonic()
    while time.monotonic() - t0 < 60:
        v = cdp.eval(_STATE)
        if v != last:
            last, since = v, time.monotonic()
        elif len(v["views"]) == n and time.monotonic() - since >= settle:
            return v
        time.sleep(0.25)
    raise TimeoutError("the explorers did not settle within 60 s")


@pytest.mark.slow
def test_explorers_run_live_in_jupyterlab(tmp_path):
    """A reader's session: a notebook holding the explore sections of 01, 03, 04 and 05 (as they stand in those
    notebooks, after a `quick` parameter) opened in JupyterLab with the project's kernel and run from the Run menu;
    then each explorer's slider is dragged to its far right end with real input events. Each figure and caption must
    change, the slider's readout must move, and no widget may be disconnected or fail to display."""
    require_chromium()
    root = tmp_path / "lab"
    root.mkdir()
    cells = [{"cell_type": "code", "id": "parameters", "execution_count": None, "metadata": {"tags": ["parameters"]},
              "outputs": [], "source": "quick = True"}]
    for nb in NOTEBOOKS.values():
        cells += explore_cells(nb)
    template = json.loads((REPO_ROOT / "notebooks" / "03_throughput.ipynb").read_text())
    (root / "explore.ipynb").write_text(json.dumps({**template, "cells": cells}))
    with lab_server(root, tmp_path) as lab, chromium_page(lab.page("lab/tree/explore.ipynb"), tmp_path) as cdp:
        check_project_kernel(lab)
        open_and_run_all(cdp, 300)
        before = _settled(cdp, len(NOTEBOOKS))
        assert before["disconnected"] == 0 and not before["errors"], before
        cdp.screenshot(tmp_path / "explore_before.png")
        for i in range(len(NOTEBOOKS)):
            sel = f"[...document.querySelectorAll('.jp-OutputArea-output')].filter(o => o.querySelector(" \
                  f"'.pa-explore-caption'))[{i}]"
            cdp.eval(f"{sel}.scrollIntoView({{block: 'center'}})")
            time.sleep(0.5)
            box = cdp.eval(f"(() => {{ const o = {sel}; const h = o.querySelector('.widget-slider .noUi-handle')"
                           ".getBoundingClientRect(); const t = o.querySelector('.widget-slider .noUi-target')"
                           ".getBoundingClientRect(); return [h.left + h.width / 2, h.top + h.height / 2,"
                           " t.right] })()")
            cdp.drag((box[0], box[1]), (box[2] + 20, box[1]))
            after = _settled(cdp, len(NOTEBOOKS))
            old, new = before["views"][i], after["views"][i]
            assert new["readout"] != old["readout"], (i, old["readout"])
            assert new["image"] != old["image"] and new["caption"] != old["caption"], (i, new["caption"])
            assert after["disconnected"] == 0 and not after["errors"], after
            before = after
        cdp.screenshot(tmp_path / "explore_after.png")
