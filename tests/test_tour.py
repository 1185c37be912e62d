"""The tour's live view (paper §4.2-§4.4): the trace recorder copies the real block manager's state after every engine
step, the ipywidgets view builds and renders a frame to PNG without a browser, and, where Chromium is installed, the
view saved in the executed tour notebook renders in JupyterLab (headless Chromium, localhost only, bounded in time).
"""
from __future__ import annotations

import base64
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path

import pytest

from pagedattn import tour
from pagedattn.results import REPO_ROOT

CHROMIUM = Path("/usr/bin/chromium")
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def trace():
    from pagedattn.zoo import load_model

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
    view.show(1)
    assert view.slider.value == 1
    state = view.widget.get_state()
    assert state["children"], "the box holds its children"


def test_gif_of_all_frames(trace, tmp_path):
    from PIL import Image

    _, frames, _, _ = trace
    path = tour.save_gif(frames[:4], tmp_path / "t.gif", duration_ms=100)
    with Image.open(path) as im:
        assert im.n_frames == 4


def test_frame_from_manager_the_notes_forty_token_example():
    from pagedattn.memory import BlockManager

    kv = BlockManager(block_size=16, num_gpu_blocks=10, watermark=0.0)
    for i in range(10):
        kv.allocate(100 + i, 1)
    for i in (5, 2, 9):
        kv.free(100 + i)
    kv.allocate(0, 40)
    f = tour.frame_from_manager(kv, {0: ("req", 0)})
    (req,) = [s for s in f.seqs if s.request_id == "req"]
    assert req.blocks == [5, 2, 9] and req.num_tokens == 40


# ----------------------------------------------------------------------------------- JupyterLab + Chromium
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


class _CDP:
    """A minimal Chrome DevTools Protocol client over one page target (websocket-client, a jupyter_server dep)."""

    def __init__(self, ws_url: str) -> None:
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.next_id = 0

    def call(self, method: str, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def eval(self, expr: str):
        return self.call("Runtime.evaluate", expression=expr, returnByValue=True)["result"].get("value")


def _executed_tour(tmp_path: Path) -> Path:
    """The executed tour notebook with its saved widget state: the committed results copy when present, else a
    quick-mode run into ``tmp_path``."""
    committed = REPO_ROOT / "results" / "00_tour" / "00_tour.ipynb"
    if committed.exists():
        return committed
    from pagedattn.reproduce import NOTEBOOKS_DIR, run_notebook

    return run_notebook(NOTEBOOKS_DIR / "00_tour.ipynb", quick=True, results_dir=tmp_path / "results")


@pytest.mark.slow  # runs the tour notebook, then JupyterLab and Chromium
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs /usr/bin/chromium (apt-get install chromium)")
def test_tour_widget_renders_in_jupyterlab(tmp_path):
    """Open the live-view cell of the executed tour notebook in JupyterLab (widget state restored from the notebook)
    in headless Chromium; wait for the widget's slider and image in the DOM; save a screenshot."""
    nb = json.loads(_executed_tour(tmp_path).read_text())
    assert nb["metadata"].get("widgets"), "the executed notebook carries its widget state"
    nb["cells"] = [c for c in nb["cells"] if c["cell_type"] == "code" and "BlockPoolView" in "".join(c["source"])]
    assert nb["cells"] and nb["cells"][0]["outputs"]
    root = tmp_path / "lab"
    root.mkdir()
    import nbformat
    from nbformat.sign import NotebookNotary

    # widgets render only in a trusted notebook: sign it with a notary of its own (the server below uses the same
    # data dir, so it finds the signature), leaving the user's trust database alone
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    node = nbformat.from_dict(nb)
    NotebookNotary(data_dir=str(data_dir)).sign(node)
    nbformat.write(node, str(root / "tour_view.ipynb"))
    settings = tmp_path / "settings"  # JupyterLab settings for this server only: restore saved widget state, no news
    for rel, doc in {"@jupyter-widgets/jupyterlab-manager/plugin.jupyterlab-settings": {"saveState": True},
                     "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
                         {"fetchNews": "false", "checkForUpdates": False}}.items():
        (settings / rel).parent.mkdir(parents=True, exist_ok=True)
        (settings / rel).write_text(json.dumps(doc))
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings), JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "ws"),
               JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"), JUPYTER_DATA_DIR=str(data_dir))
    port, cdp_port = _free_port(), _free_port()
    lab = subprocess.Popen([sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ServerApp.ip=127.0.0.1",
                            f"--ServerApp.port={port}", "--ServerApp.port_retries=0", "--ServerApp.token=",
                            "--ServerApp.password=", f"--ServerApp.root_dir={root}", "--LabApp.news_url=None"],
                           env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "lab.log", "w"),
                           start_new_session=True)
    chrome = None
    try:
        _wait_http(f"http://127.0.0.1:{port}/api/status", 60)
        url = f"http://127.0.0.1:{port}/lab/tree/tour_view.ipynb"
        chrome = subprocess.Popen([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                                   "--no-first-run", "--disable-background-networking", "--disable-component-update",
                                   "--disable-sync", f"--user-data-dir={tmp_path / 'chrome'}",
                                   "--window-size=1400,1000", "--remote-debugging-address=127.0.0.1",
                                   f"--remote-debugging-port={cdp_port}", url],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        _wait_http(f"http://127.0.0.1:{cdp_port}/json/version", 30)
        with urllib.request.urlopen(f"http://127.0.0.1:{cdp_port}/json/list", timeout=5) as r:
            page = next(t for t in json.loads(r.read()) if t["type"] == "page")
        cdp = _CDP(page["webSocketDebuggerUrl"])
        found, t0 = None, time.monotonic()
        while time.monotonic() - t0 < 90:
            found = cdp.eval("(() => { const s = document.querySelector('.jp-OutputArea .widget-slider');"
                             " const i = document.querySelector('.jp-OutputArea .widget-image');"
                             " return s && i && i.naturalWidth > 0 ? [i.naturalWidth, i.naturalHeight] : null })()")
            if found:
                break
            time.sleep(0.5)
        time.sleep(1.0)  # let the layout settle
        shot = base64.b64decode(cdp.call("Page.captureScreenshot", format="png")["data"])
        out = tmp_path / "jupyterlab_tour_widget.png"
        out.write_bytes(shot)
        if os.environ.get("PAGEDATTN_SCREENSHOT_DIR"):
            shutil.copy(out, Path(os.environ["PAGEDATTN_SCREENSHOT_DIR"]) / out.name)
        assert found, f"the widget's slider and image did not render in JupyterLab within 90 s (see {out})"
        assert found[0] > 600, found
        assert shot.startswith(PNG)
        from PIL import Image

        colors = {tuple(int(c[i:i + 2], 16) for i in (1, 3, 5)) for c in tour.REQUEST_COLORS[:3]}
        img = Image.open(io.BytesIO(shot)).convert("RGB")
        hits = sum(n for n, rgb in img.getcolors(1 << 20) if rgb in colors)
        assert hits > 2000, "the block grid's request colours are on screen"
    finally:
        for p in (chrome, lab):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
