"""The tour's live view (paper §4.2-§4.4): the trace recorder copies the real block manager's state after every engine
step, the ipywidgets view builds and renders a frame to PNG without a browser, the executed tour opens on
copy-on-write for a reader without a kernel, ``make lab`` serves the notebooks with the project's kernel, and, in
headless Chromium, a reader runs the tour in JupyterLab and plays the live view (localhost only, bounded in time).

Chromium comes from the OS packages (``/usr/bin/chromium``; ``.ci/run`` installs it). Without it the browser test
skips, except under ``CI=true``, where it fails. ``PAGEDATTN_TOUR_FULL=1`` runs the tour with full parameters
instead of quick ones, and ``PAGEDATTN_SCREENSHOT_DIR=results/00_tour`` keeps the before/after screenshots (the
committed ones come from such a full run).
"""
from __future__ import annotations

import base64
import io
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from pagedattn.memory.per_sequence import PerSequence
from pagedattn.repro.experiments import tour
from pagedattn.repro.report.results import REPO_ROOT

import jupyterlab_browser
from factories import block_manager
from jupyterlab_browser import (CDP, check_project_kernel, chromium_page, lab_server, open_and_run_all,
                               require_chromium, with_parameters)

RESULTS = REPO_ROOT / "results" / "00_tour"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def trace():
    from pagedattn.repro.experiments.zoo import load_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tok = load_model("opt-stdlib")
    engine = tour.tour_engine(model, tok)
    arrivals, prefix_len = tour.tour_requests(tok, max_tokens=6)
    frames, outputs = tour.record_trace(engine, arrivals)
    return engine, frames, outputs, prefix_len


def test_trace_is_a_copy_of_the_block_manager(trace):
    engine, frames, outputs, prefix_len = trace
    bs = engine.kv.block_size
    assert frames[0].step == -1 and frames[0].new_requests == ["A", "B"]
    assert any("C" in f.new_requests for f in frames[1:]), "C arrives after the first steps"
    for f in frames:
        assert f.table_refs() == f.ref_counts, f"frame {f.step}: reference counts != block-table entries + pins"
        for s in f.seqs:
            assert len(s.blocks) == -(-s.num_tokens // bs)
    # the prefix's full blocks are pinned and shared by every sequence of every request
    pinned = frames[-1].pinned
    assert len(pinned) == prefix_len // bs
    busiest = max(frames, key=lambda f: len(f.seqs))
    assert len(busiest.seqs) == 1 + 2 + 4
    for b in pinned:
        assert busiest.ref_counts[b] == len(busiest.seqs) + 1
        assert all(s.blocks[: len(pinned)] == pinned for s in busiest.seqs)
    # parallel samples share their prompt's last block until copy-on-write
    assert any(f.num_copies for f in frames)
    # a frame is a copy: later steps do not change earlier frames
    assert frames[1].seqs[0].num_tokens < frames[-2].seqs[0].num_tokens or frames[1].seqs[0] != frames[-2].seqs[0]
    # when everything finished only the pinned prefix holds blocks, and the engine's pool agrees
    assert not frames[-1].seqs and sum(1 for c in frames[-1].ref_counts if c) == len(pinned)
    assert engine.kv.num_free_gpu_blocks == engine.kv.num_gpu_blocks - len(pinned)
    assert set(outputs) == {"A", "B", "C"} and [len(outputs[r].outputs) for r in "ABC"] == [1, 2, 4]


def test_frame_renders_to_png_and_the_widget_builds(trace):
    import ipywidgets as w
    from PIL import Image

    _, frames, _, _ = trace
    png = tour.frame_png(frames[3])
    assert png.startswith(PNG)
    img = Image.open(io.BytesIO(png))
    assert img.width > 600 and img.height > 250
    view = tour.BlockPoolView(frames)
    assert isinstance(view.widget, w.VBox)
    assert view.slider.max == len(frames) - 1 and view.play.max == len(frames) - 1
    first = bytes(view.image.value)
    assert first.startswith(PNG)
    view.slider.value = 3  # moving the slider redraws the frame
    assert bytes(view.image.value) != first and bytes(view.image.value) == view._png(3)
    assert "frame 3" in view.caption.value
    assert view.tables.value == view._tables(3) and 'data-frame="3"' in view.tables.value
    for s in frames[3].seqs:
        assert f'data-seq="{s.label}"' in view.tables.value
    view.show(1)
    assert view.slider.value == 1
    state = view.widget.get_state()
    assert state["children"], "the box holds its children"
    # displayed, the view carries its current frame as PNG for a reader without a kernel (block tables included)
    bundle = view._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert base64.b64decode(bundle["image/png"]) == tour.frame_png(frames[1], view.colors)
    with pytest.raises(ValueError, match="start must be a frame index"):
        tour.BlockPoolView(frames, start=len(frames))


def test_view_opens_on_copy_on_write_and_the_trace_round_trips(trace, tmp_path):
    _, frames, _, _ = trace
    i = tour.copy_on_write_frame(frames)
    assert frames[i].num_copies == max(f.num_copies for f in frames) > 0
    assert all(f.num_copies < frames[i].num_copies for f in frames[:i])
    view = tour.BlockPoolView(frames, start=i)
    assert view.slider.value == view.play.value == i and "copy-on-write" in view.caption.value
    assert tour.load_trace(tour.save_trace(frames, tmp_path / "trace.json")) == frames
    with pytest.raises(ValueError, match="copy-on-write"):
        tour.copy_on_write_frame(frames[:1])


def test_executed_tour_shows_copy_on_write_without_a_kernel():
    """The committed executed tour: its live-view output opens on a copy-on-write frame, both in the saved widget
    state and in the PNG that readers without a kernel see; the GIF is linked from the first cell and the README."""
    nb = json.loads((RESULTS / "00_tour.ipynb").read_text())
    (cell,) = [c for c in nb["cells"] if c["cell_type"] == "code" and "BlockPoolView" in "".join(c["source"])]
    (out,) = [o for o in cell["outputs"] if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert base64.b64decode(out["data"]["image/png"]).startswith(PNG)
    trace = tour.load_trace(RESULTS / "block_pool_trace.json")
    i = tour.copy_on_write_frame(trace)
    assert trace[i].num_copies > 0
    from PIL import Image

    shown = Image.open(io.BytesIO(base64.b64decode(out["data"]["image/png"]))).convert("RGB")
    drawn = Image.open(io.BytesIO(tour.frame_png(trace[i], tour.request_colors(trace)))).convert("RGB")
    assert shown.size == drawn.size and shown.tobytes() == drawn.tobytes(), "the PNG shown is the trace's frame i"
    captions = [m["state"]["value"] for m in nb["metadata"]["widgets"]["application/vnd.jupyter.widget-state+json"]
                ["state"].values() if m["model_name"] == "HTMLModel" and "frame " in m["state"].get("value", "")]
    assert len(captions) == 1, captions
    assert captions[0].startswith(f"<b>frame {i}/{len(trace) - 1}</b>") and "copy-on-write" in captions[0]
    first = "".join(nb["cells"][0]["source"])
    # the executed copy's links are rewritten to resolve from results/00_tour/ (reproduce.relink)
    assert "(block_pool.gif)" in first and "notebooks/block_pool" not in first
    assert "(../results/00_tour/block_pool.gif)" in (REPO_ROOT / "notebooks" / "00_tour.ipynb").read_text()
    assert (REPO_ROOT / "notebooks" / "../results/00_tour/block_pool.gif").resolve() == (RESULTS / "block_pool.gif")
    assert "(results/00_tour/block_pool.gif)" in (REPO_ROOT / "README.md").read_text()
    with Image.open(RESULTS / "block_pool.gif") as gif:
        assert gif.n_frames == len(trace)


def test_gif_of_all_frames(trace, tmp_path):
    from PIL import Image

    _, frames, _, _ = trace
    path = tour.save_gif(frames[:4], tmp_path / "t.gif", duration_ms=100)
    with Image.open(path) as im:
        assert im.n_frames == 4


def test_frame_from_manager_the_notes_forty_token_example():
    kv = block_manager(block_size=16, num_gpu_blocks=10, watermark=0.0)
    per_seq = PerSequence(kv)
    for i in range(10):
        per_seq.allocate(100 + i, 1)
    for i in (5, 2, 9):
        per_seq.free(100 + i)
    per_seq.allocate(0, 40)
    f = tour.frame_from_manager(kv, {0: ("req", 0)})
    (req,) = [s for s in f.seqs if s.request_id == "req"]
    assert req.blocks == [5, 2, 9] and req.num_tokens == 40


# ----------------------------------------------------------------------------------- JupyterLab + Chromium
def test_missing_chromium_fails_under_ci_and_skips_elsewhere(monkeypatch, tmp_path):
    monkeypatch.setattr(jupyterlab_browser, "CHROMIUM", tmp_path / "no-chromium")
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        require_chromium()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception):
        require_chromium()


def test_ci_run_installs_chromium_when_missing(tmp_path):
    """.ci/run, with Chromium missing: apt-get update, a quiet non-interactive install of Debian's chromium, then
    `make test` (apt-get, sudo and make are stand-ins that record their arguments)."""
    repo = tmp_path / "repo"
    (repo / ".ci").mkdir(parents=True)
    shutil.copy(REPO_ROOT / ".ci" / "run", repo / ".ci" / "run")
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for name in ("apt-get", "make", "sudo"):
        body = 'exec "$@"' if name == "sudo" else f'echo "{name} $* DEBIAN_FRONTEND=${{DEBIAN_FRONTEND:-}}" >> {log}'
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", CHROMIUM=str(tmp_path / "no-chromium"), CI="true")
    subprocess.run(["bash", str(repo / ".ci" / "run")], env=env, check=True, timeout=60, stdin=subprocess.DEVNULL)
    calls = log.read_text().splitlines()
    assert calls[0].startswith("apt-get") and " update" in calls[0], calls
    assert calls[1].startswith("apt-get") and " install " in calls[1] and calls[1].split()[-2] == "chromium", calls
    assert " -y" in calls[1] and "DEBIAN_FRONTEND=noninteractive" in calls[1], calls
    assert calls[2:] == ["make test DEBIAN_FRONTEND=noninteractive"], calls
    # with Chromium present, nothing is installed
    log.unlink()
    subprocess.run(["bash", str(repo / ".ci" / "run")], env=dict(env, CHROMIUM=sys.executable), check=True, timeout=60,
                   stdin=subprocess.DEVNULL)
    assert [c.split()[:2] for c in log.read_text().splitlines()] == [["make", "test"]]


def test_make_lab_serves_the_notebooks_with_the_project_kernel(tmp_path):
    """`make lab` runs pagedattn.repro.report.lab; that server lists the notebooks, has the `pagedattn (.venv)` kernel spec as its
    default, and a notebook opened there gets that kernel, which starts and answers."""
    from pagedattn.repro.report.lab import KERNEL_NAME, NOTEBOOKS_DIR

    recipe = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(REPO_ROOT), "lab"], capture_output=True,
                            text=True, check=True)
    assert "-m pagedattn.repro.report.lab" in recipe.stdout.splitlines()[-1], recipe.stdout
    with lab_server(NOTEBOOKS_DIR, tmp_path) as lab:
        check_project_kernel(lab)
        assert "00_tour.ipynb" in [c["name"] for c in lab.api("contents")["content"]]
        nb = lab.api("contents/00_tour.ipynb")["content"]
        assert nb["metadata"]["kernelspec"]["name"] == KERNEL_NAME
        session = lab.api("sessions", {"path": "00_tour.ipynb", "type": "notebook", "name": "00_tour.ipynb",
                                       "kernel": {"name": nb["metadata"]["kernelspec"]["name"]}}, "POST")
        assert session["kernel"]["name"] == KERNEL_NAME
        out = lab.execute(session["kernel"]["id"],
                          "import sys, pagedattn; print(sys.prefix); print(pagedattn.__file__)")
        prefix, module = out.split()
        assert Path(prefix) == Path(sys.prefix) and Path(module).is_relative_to(REPO_ROOT / "src"), out


def test_lab_command_line_and_a_missing_kernel_spec(monkeypatch, capsys):
    from pagedattn.repro.report import lab

    argv = lab.lab_argv("--no-browser")
    assert argv[1:3] == ["-m", "jupyterlab"] and argv[-1] == "--no-browser"
    assert f"--ServerApp.root_dir={lab.NOTEBOOKS_DIR}" in argv and "--ServerApp.ip=127.0.0.1" in argv
    assert f"--MappingKernelManager.default_kernel_name={lab.KERNEL_NAME}" in argv
    mine = lab.lab_argv("--ip=127.0.0.2", "--ServerApp.root_dir=/tmp")
    assert not any(a.startswith(("--ServerApp.ip=", f"--ServerApp.root_dir={lab.NOTEBOOKS_DIR}")) for a in mine)
    monkeypatch.setattr(lab, "KERNEL_NAME", "pagedattn-no-such-kernel")
    assert lab.main(["--no-browser"]) == 2
    assert "no Jupyter kernel spec named 'pagedattn-no-such-kernel'" in capsys.readouterr().err


# What the live view shows, read from the page: the caption's frame number, the slider's readout, the block tables
# (frame index and rows) and the pool image's bytes (base64), plus every disconnected widget and widget error.
_VIEW_STATE = """(async () => {
  const out = [...document.querySelectorAll('.jp-OutputArea-output')].find(o => o.querySelector('.pa-block-tables'));
  if (!out) return null;
  const caption = [...out.querySelectorAll('.widget-html-content')].map(e => e.textContent)
    .find(t => /^frame \\d+\\//.test(t));
  const table = out.querySelector('.pa-block-tables');
  const img = out.querySelector('img');
  const bytes = new Uint8Array(await (await fetch(img.src)).arrayBuffer());
  let bin = ''; for (const b of bytes) bin += String.fromCharCode(b);
  return {caption, readout: out.querySelector('.widget-readout').textContent.trim(),
          frame: Number(table.dataset.frame), image: btoa(bin),
          rows: [...table.querySelectorAll('tr')]
            .map(tr => [tr.dataset.seq, tr.querySelector('.pa-blocks').textContent]),
          disconnected: document.querySelectorAll('.jupyter-widgets-disconnected').length,
          errors: document.body.innerText.includes('Error displaying widget')};
})()"""


def _view(cdp: CDP, frames: list, colors: dict, settle: float = 1.0) -> dict:
    """The view's state once the caption, slider, tables and image agree on one frame and stay for ``settle`` s
    (the kernel redraws on every slider change, and the browser shows each change as it comes: on a loaded machine
    the image can trail the caption by more than ``settle``, so the image must also be the frame's before it counts
    as settled). A view that never agrees within 60 s fails with what it last showed."""
    t0, last, since = time.monotonic(), None, time.monotonic()
    while time.monotonic() - t0 < 60:
        v = cdp.eval(_VIEW_STATE)
        if v != last:
            last, since = v, time.monotonic()
        elif v and int(v["caption"].split()[1].split("/")[0]) == int(v["readout"]) == v["frame"] \
                and time.monotonic() - since >= settle and _image_is_frame(v, frames, colors):
            return v
        time.sleep(0.2)
    raise TimeoutError(f"the live view did not settle on one frame within 60 s: {last and {**last, 'image': '...'}}"
                       + (f" (its image is frame {last['frame']}'s: {_image_is_frame(last, frames, colors)})"
                          if last else ""))


def _steady_center(cdp: CDP, selector: str, settle: float = 0.6, timeout: float = 20.0) -> tuple[float, float]:
    """``cdp.center(selector)`` once it has stayed put for ``settle`` s: outputs above the element can still grow
    after the view settles, and a press where the element was misses it."""
    t0, last, since = time.monotonic(), None, time.monotonic()
    while time.monotonic() - t0 < timeout:
        c = cdp.center(selector)
        if c != last:
            last, since = c, time.monotonic()
        elif time.monotonic() - since >= settle:
            return c
        time.sleep(0.1)
    raise TimeoutError(f"{selector} kept moving for {timeout} s (last at {last})")


def _image_is_frame(v: dict, frames: list, colors: dict) -> bool:
    """Whether the pool image shown is the trace's frame ``v["frame"]``, pixel for pixel."""
    from PIL import Image

    if not 0 <= v["frame"] < len(frames):
        return False
    shown = Image.open(io.BytesIO(base64.b64decode(v["image"]))).convert("RGB")
    drawn = Image.open(io.BytesIO(tour.frame_png(frames[v["frame"]], colors, tables=False))).convert("RGB")
    return shown.size == drawn.size and shown.tobytes() == drawn.tobytes()


def _assert_shows(v: dict, frames: list, colors: dict) -> int:
    """The view shows frame ``i`` of the recorded trace: its block tables, row by row, and its pool image."""
    i = v["frame"]
    assert v["rows"] == [[s.label, " ".join(f"[{b}]" if frames[i].ref_counts[b] > 1 else str(b) for b in s.blocks)]
                         for s in frames[i].seqs], f"frame {i}: the tables shown are not the trace's"
    assert _image_is_frame(v, frames, colors), f"frame {i}: the image is not the trace's"
    assert v["disconnected"] == 0 and not v["errors"], "a widget shows the disconnected indicator or an error"
    return i


def _tour_copy(root: Path, results_dir: Path, quick: bool) -> Path:
    """The tour notebook with its parameters set as papermill sets them (a cell after the `parameters` cell)."""
    nb = with_parameters(json.loads((REPO_ROOT / "notebooks" / "00_tour.ipynb").read_text()), quick=quick,
                         results_dir=str(results_dir))
    path = root / "00_tour.ipynb"
    path.write_text(json.dumps(nb))
    return path


@pytest.mark.slow
def test_tour_plays_live_in_jupyterlab(tmp_path):
    """A reader's session: open the tour in JupyterLab (the `make lab` server) with the project's kernel, run all
    cells from the Run menu, then drag the live view's slider, step it with the arrow key and press play, with real
    input events. Each time the caption, slider, block tables and pool image must agree on one frame of the trace the
    notebook recorded (``block_pool_trace.json``), the frame must change, and no widget may be disconnected."""
    require_chromium()
    full = os.environ.get("PAGEDATTN_TOUR_FULL") == "1"
    root, results = tmp_path / "lab", tmp_path / "results"
    root.mkdir()
    _tour_copy(root, results, quick=not full)
    shots, t0 = [], time.monotonic()
    phases = {}  # seconds per phase, printed for CI-time budgeting (never asserted)
    with lab_server(root, tmp_path) as lab, chromium_page(lab.page("lab/tree/00_tour.ipynb"), tmp_path) as cdp:
        check_project_kernel(lab)
        open_and_run_all(cdp, 900 if full else 180)
        phases["open and run all"] = time.monotonic() - t0
        frames = tour.load_trace(results / "00_tour" / "block_pool_trace.json")
        colors = tour.request_colors(frames)
        cdp.eval("document.querySelector('.pa-block-tables').closest('.jp-OutputArea-output')"
                 ".scrollIntoView({block: 'center'})")
        before = _view(cdp, frames, colors)
        start = _assert_shows(before, frames, colors)
        assert start == tour.copy_on_write_frame(frames), "the view opens on the copy-on-write frame"
        shots.append(cdp.screenshot(tmp_path / "jupyterlab_tour_before.png"))

        # drag the slider's handle to the far left: frame 0
        handle = ".jp-OutputArea-output .widget-slider .noUi-handle"
        x, y = _steady_center(cdp, handle)  # measured once the notebook's layout has stopped moving
        track = cdp.eval("(() => { const r = document.querySelector('.jp-OutputArea-output .widget-slider"
                         " .noUi-target').getBoundingClientRect(); return [r.left, r.width] })()")
        cdp.drag((x, y), (track[0] - 20, y))
        dragged = _view(cdp, frames, colors)
        assert _assert_shows(dragged, frames, colors) == 0 and dragged["image"] != before["image"]
        # the arrow key on the focused handle: one frame on
        cdp.key("ArrowRight", 39)
        stepped = _view(cdp, frames, colors)
        assert _assert_shows(stepped, frames, colors) == 1 and stepped["image"] != dragged["image"]
        # play: the frames advance by themselves; the same button pauses, past the frame the view opened on
        play, target = ".jp-OutputArea-output .widget-play button:nth-of-type(1)", min(start + 3, len(frames) - 1)
        cdp.click(play)
        cdp.wait("(() => { const r = document.querySelector('.jp-OutputArea-output .widget-readout');"
                 f" return r && Number(r.textContent) >= {target} }})()", 60, "play advanced")
        cdp.click(play)
        after = _view(cdp, frames, colors, settle=2.0)
        end = _assert_shows(after, frames, colors)
        assert end >= target and after["image"] != stepped["image"]
        shots.append(cdp.screenshot(tmp_path / "jupyterlab_tour_after.png"))
        assert before["caption"] != after["caption"] and before["image"] != after["image"]
        phases["interact"] = time.monotonic() - t0 - phases["open and run all"]
    phases["stop"] = time.monotonic() - t0 - sum(phases.values())
    print("live tour phases (s):", {k: round(v, 1) for k, v in phases.items()})
    if os.environ.get("PAGEDATTN_SCREENSHOT_DIR"):
        for shot in shots:
            shutil.copy(shot, Path(os.environ["PAGEDATTN_SCREENSHOT_DIR"]) / shot.name)
