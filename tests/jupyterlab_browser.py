"""A reader's JupyterLab in a test: the `make lab` server (``python -m pagedattn.repro.report.lab``) on a free local port, headless
Chromium on one of its pages, driven through the Chrome DevTools Protocol with real input events, and a notebook run
from the Run menu as a reader runs it. Shared by the live-browser tests (``test_tour``, ``test_explore``).

Chromium comes from the OS packages (``/usr/bin/chromium``; ``.ci/run`` installs it). Without it a browser test
skips, except under ``CI=true``, where it fails.
"""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from pagedattn.repro.report.results import REPO_ROOT

CHROMIUM = Path("/usr/bin/chromium")


def require(path: Path, msg: str, provider: str) -> None:
    """Skip unless ``path`` exists, except under ``CI=true``, which must run the check (``provider`` makes it)."""
    if path.exists():
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but {msg}: {provider} makes it, and CI must not skip this check")
    pytest.skip(msg)


def require_chromium() -> None:
    """Skip without Chromium, except under ``CI=true``: CI must run the browser check (``.ci/run`` installs it)."""
    require(CHROMIUM, f"needs {CHROMIUM} (apt-get install chromium)", ".ci/run")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


@dataclasses.dataclass
class Lab:
    """A running Jupyter server: its base URL and its token (API calls send it, so they need no XSRF cookie)."""

    base: str
    token: str

    def api(self, path: str, body: dict | None = None, method: str | None = None):
        req = urllib.request.Request(f"{self.base}/api/{path}", method=method, headers={
            "Authorization": f"token {self.token}", "Content-Type": "application/json"},
            data=None if body is None else json.dumps(body).encode())
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def page(self, path: str) -> str:
        return f"{self.base}/{path}?token={self.token}"

    def execute(self, kernel_id: str, code: str, timeout: float = 90) -> str:
        """Run ``code`` in a kernel of this server through its websocket, as JupyterLab does; return its stdout."""
        import websocket

        ws = websocket.create_connection(f"{self.base.replace('http', 'ws')}/api/kernels/{kernel_id}/channels"
                                         f"?token={self.token}", timeout=timeout, suppress_origin=True)
        msg_id = secrets.token_hex(8)
        ws.send(json.dumps({"header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "test",
                                       "session": secrets.token_hex(8), "version": "5.3"},
                            "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
                            "content": {"code": code, "silent": False, "store_history": False,
                                        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}}))
        out, t0 = [], time.monotonic()
        try:
            while time.monotonic() - t0 < timeout:
                msg = json.loads(ws.recv())
                if msg.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                kind, content = msg["header"]["msg_type"], msg["content"]
                if kind == "stream" and content["name"] == "stdout":
                    out.append(content["text"])
                elif kind == "error":
                    raise RuntimeError("\n".join(content["traceback"]))
                elif kind == "status" and content["execution_state"] == "idle":
                    return "".join(out)
        finally:
            ws.close()
        raise TimeoutError(f"the kernel did not finish {code!r} within {timeout} s")


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()  # the Jupyter server shuts its kernels down on SIGTERM
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and text in (d / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


@contextlib.contextmanager
def lab_server(root: Path, tmp_path: Path):
    """The ``make lab`` server (``python -m pagedattn.repro.report.lab``) on ``root``, on a free port of 127.0.0.1, with JupyterLab
    settings, workspaces and runtime files of its own under ``tmp_path``; yields a ``Lab``. On exit the server is
    stopped, and no process (a kernel) started under its runtime dir is left."""
    settings, runtime = tmp_path / "lab-settings", tmp_path / "lab-runtime"
    for rel, doc in {"@jupyterlab/apputils-extension/notification.jupyterlab-settings":
                     {"fetchNews": "false", "checkForUpdates": False},
                     "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"}}.items():
        (settings / rel).parent.mkdir(parents=True, exist_ok=True)
        (settings / rel).write_text(json.dumps(doc))
    src = str(REPO_ROOT / "src")
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(settings), JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "lab-ws"),
               JUPYTER_RUNTIME_DIR=str(runtime),
               PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    port, token = free_port(), secrets.token_hex(16)
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "pagedattn.repro.report.lab", f"--ServerApp.root_dir={root}", "--no-browser",
                             f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
                             f"--IdentityProvider.token={token}", "--LabApp.news_url=None"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/api/status?token={token}", 90, proc)
        yield Lab(base, token)
    finally:
        stop(proc)
        log.close()
        left = processes_mentioning(str(runtime))
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode is not None and not left, f"left running: server {proc.returncode}, kernels {left}"


def check_project_kernel(lab: Lab) -> None:
    from pagedattn.repro.report.lab import KERNEL_DISPLAY_NAME, KERNEL_NAME

    specs = lab.api("kernelspecs")
    assert specs["default"] == KERNEL_NAME, specs["default"]
    assert specs["kernelspecs"][KERNEL_NAME]["spec"]["display_name"] == KERNEL_DISPLAY_NAME


class CDP:
    """A minimal Chrome DevTools Protocol client over one page target (websocket-client)."""

    def __init__(self, ws_url: str, shot_dir: Path) -> None:
        import websocket

        self.ws = websocket.create_connection(ws_url, timeout=60, suppress_origin=True)
        self.next_id = 0
        self.shot_dir = shot_dir  # where a timed-out wait leaves a screenshot

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
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr[:80]}...: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expr: str, timeout: float, what: str):
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            value = self.eval(expr)
            if value:
                return value
            time.sleep(0.25)
        shot = self.screenshot(self.shot_dir / "timeout.png")
        raise TimeoutError(f"{what}: not within {timeout} s (screenshot: {shot})")

    def center(self, selector: str, text: str | None = None) -> tuple[float, float]:
        """The centre of the first element matching ``selector`` (and whose text is ``text``), in CSS pixels."""
        box = self.eval(f"(() => {{ const e = [...document.querySelectorAll({json.dumps(selector)})].find(e =>"
                        f" {json.dumps(text)} === null || e.textContent.trim() === {json.dumps(text)});"
                        " if (!e) return null; const r = e.getBoundingClientRect();"
                        " return [r.left + r.width / 2, r.top + r.height / 2] })()")
        assert box, f"no element {selector} {text or ''}"
        return box[0], box[1]

    def mouse(self, kind: str, x: float, y: float, pressed: bool = False) -> None:
        self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left" if kind != "mouseMoved" or pressed
                  else "none", buttons=1 if pressed or kind == "mousePressed" else 0, clickCount=1)

    def click(self, selector: str, text: str | None = None) -> None:
        x, y = self.center(selector, text)
        self.mouse("mouseMoved", x, y)
        self.mouse("mousePressed", x, y)
        self.mouse("mouseReleased", x, y)

    def drag(self, start: tuple[float, float], end: tuple[float, float], steps: int = 8) -> None:
        self.mouse("mouseMoved", *start)
        self.mouse("mousePressed", *start)
        for k in range(1, steps + 1):
            self.mouse("mouseMoved", start[0] + (end[0] - start[0]) * k / steps,
                       start[1] + (end[1] - start[1]) * k / steps, pressed=True)
        self.mouse("mouseReleased", *end)

    def key(self, key: str, code: int) -> None:
        for kind in ("rawKeyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key=key, code=key, windowsVirtualKeyCode=code)

    def screenshot(self, path: Path) -> Path:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))
        return path


@contextlib.contextmanager
def chromium_page(url: str, tmp_path: Path):
    """Headless Chromium (the OS package) on ``url``, its DevTools endpoint on a free port of 127.0.0.1."""
    port = free_port()
    proc = subprocess.Popen([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                             "--no-first-run", "--disable-background-networking", "--disable-component-update",
                             "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'chrome'}",
                             "--window-size=1400,1050",
                             "--remote-debugging-address=127.0.0.1", f"--remote-debugging-port={port}", url],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/json/version", 60, proc)
        page = next(t for t in get_json(f"http://127.0.0.1:{port}/json/list") if t["type"] == "page")
        yield CDP(page["webSocketDebuggerUrl"], tmp_path)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def open_and_run_all(cdp: CDP, timeout: float) -> list[str]:
    """Wait for the notebook to open with the project's kernel, idle; run Run > Run All Cells from the menu as a reader
    clicks it, and wait until every cell has run (fails with the notebook's stderr if one raised). Returns the input
    prompts."""
    from pagedattn.repro.report.lab import KERNEL_DISPLAY_NAME

    kernel = "document.querySelector('.jp-Toolbar-kernelName')?.textContent.trim()"
    cdp.wait(f"{kernel} === {json.dumps(KERNEL_DISPLAY_NAME)} && document.querySelector("
             "'.jp-Notebook-ExecutionIndicator[data-status=\"idle\"]') !== null", 120,
             f"the notebook opened with the {KERNEL_DISPLAY_NAME} kernel, idle")
    cdp.click(".lm-MenuBar-item", "Run")
    cdp.wait("[...document.querySelectorAll('.lm-Menu-itemLabel')].some(e => e.textContent === 'Run All Cells')",
             10, "the Run menu opened")
    cdp.click(".lm-Menu-itemLabel", "Run All Cells")
    prompts = "[...document.querySelectorAll('.jp-CodeCell .jp-InputPrompt')].map(p => p.textContent.trim())"
    cdp.wait(f"{prompts}.some(p => p === '[*]:')", 30, "run-all started")
    done = cdp.wait(f"(() => {{ const p = {prompts}; const i = document.querySelector("
                    "'.jp-Notebook-ExecutionIndicator'); return i && i.dataset.status === 'idle' &&"
                    " !p.includes('[*]:') ? p : null })()", timeout, "run-all finished")
    if not all(p[1:-2].isdigit() for p in done):
        errors = cdp.eval("[...document.querySelectorAll('.jp-OutputArea-output[data-mime-type="
                          "\"application/vnd.jupyter.stderr\"]')].map(e => e.textContent).join('\\n')")
        pytest.fail(f"run-all stopped: prompts {done}\n{errors[-3000:]}")
    return done


def with_parameters(nb: dict, **params) -> dict:
    """``nb`` with a cell after its `parameters` cell that sets ``params``, as papermill injects them."""
    (k,) = [i for i, c in enumerate(nb["cells"]) if "parameters" in c["metadata"].get("tags", [])]
    nb["cells"].insert(k + 1, {"cell_type": "code", "id": "injected-parameters", "execution_count": None,
                               "metadata": {"tags": ["injected-parameters"]}, "outputs": [],
                               "source": "\n".join(f"{k} = {v!r}" for k, v in params.items())})
    return nb
