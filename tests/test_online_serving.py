"""Notebook 13's pieces (``experiments.online_serving``): the CPU step-time fit, the simulator run with it, and the
sustainable rate read off a rate grid with the capacity rule. The live-server sweep itself runs in the notebook test
(quick mode) and in ``tests/test_serve.py``'s end-to-end tests."""
import math
import os
import sys
import time

import numpy as np
import pandas as pd
import pytest

from pagedattn.repro.experiments import online_serving as O


def test_fit_recovers_a_known_step_time():
    rng = np.random.default_rng(0)
    n = rng.integers(1, 40, 200)
    ctx = n * rng.integers(20, 200, 200)
    dec = pd.DataFrame({"kind": "decode", "batch_size": n, "slots_filled": ctx, "num_prefill_tokens": 0,
                        "step_time": 1e-3 + 2e-4 * n + 3e-6 * ctx})
    tok = rng.integers(50, 2000, 20)
    pre = pd.DataFrame({"kind": "prefill", "batch_size": 1, "slots_filled": 0, "num_prefill_tokens": tok,
                        "step_time": 5e-4 + 4e-5 * tok})
    fit, err = O.fit_step_time(pd.concat([dec, pre]))
    assert (fit.decode_s, fit.decode_per_seq_s, fit.decode_per_context_token_s) == \
        (pytest.approx(1e-3), pytest.approx(2e-4), pytest.approx(3e-6))
    assert (fit.prefill_s, fit.prefill_per_token_s) == (pytest.approx(5e-4), pytest.approx(4e-5))
    assert err["decode_rel_rms"] < 1e-9 and fit.decode_time(10, 1000) == pytest.approx(1e-3 + 2e-3 + 3e-3)


def test_the_servers_cost_per_token_is_added_to_each_decoded_sequence():
    fit = O.FittedStepTime(decode_s=1e-3, decode_per_seq_s=1e-4)
    per_token = O.server_cost_per_token(in_process_s=2.0, served_s=3.0, tokens=10_000)
    served = O.with_server_cost(fit, per_token)
    assert per_token == pytest.approx(1e-4) and O.server_cost_per_token(3.0, 2.0, 10) == 0.0
    assert served.decode_per_seq_s == pytest.approx(1e-4 + 1e-4) and served.decode_s == 1e-3


def test_prediction_runs_the_simulator_on_the_servers_budget():
    p = O.Params.make(True)
    slow = O.FittedStepTime(decode_s=1e-2, prefill_per_token_s=1e-5)
    fast = O.FittedStepTime(decode_s=1e-3, prefill_per_token_s=1e-6)
    trace = p.trace(20.0)
    a, b = O.predict(trace, "paged", p, slow), O.predict(trace, "paged", p, fast)
    assert len(a) == len(trace) and (a.finish_time >= a.arrival_time).all()
    assert a.finish_time.max() > b.finish_time.max()  # a slower step, a later finish


def test_sustainable_rate_reads_the_grid_with_both_rules():
    rows = []
    for rate, nl, ok in ((1.0, 0.01, True), (2.0, 0.02, True), (3.0, 0.05, False), (4.0, 0.3, False)):
        rows.append({"system": "paged", "rate": rate, "nl_measured_s": nl, "keeps_up_measured": ok})
    got = O.sustainable(pd.DataFrame(rows), threshold_s=0.1, which="measured").iloc[0]
    assert got.sustainable_rate == 2.0 and got.resolution == pytest.approx(0.5)  # 3.0 keeps latency but not up
    none = O.sustainable(pd.DataFrame(rows).assign(nl_measured_s=1.0), 0.1, "measured").iloc[0]
    assert math.isnan(none.sustainable_rate)


# ------------------------------------------------------------------------------------------ vLLM-CPU joins
from pagedattn.repro import vllm_cpu  # noqa: E402


@pytest.fixture
def no_vllm(monkeypatch, tmp_path):
    """No vLLM venv anywhere: neither ``$VLLM_VENV`` nor the repository's ``.venv-vllm``."""
    monkeypatch.delenv("VLLM_VENV", raising=False)
    monkeypatch.setattr(vllm_cpu, "DEFAULT_VENV", tmp_path / "absent")
    return tmp_path


def fake_venv(root, installed=True):
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").touch()
    if installed:
        (root / ".installed").touch()
    return root


def test_vllm_is_skipped_without_its_venv(no_vllm):
    auto = O.Params.make(False)
    assert auto.vllm is None and O._vllm_python(auto) is None
    assert "not found" in O.vllm_note(auto, None) and "make vllm-venv" in O.vllm_note(auto, None)
    with pytest.raises(FileNotFoundError):
        O._vllm_python(O.Params.make(False, vllm=True))


def test_vllm_joins_where_its_venv_is_and_never_in_quick_mode(no_vllm, monkeypatch):
    venv = fake_venv(no_vllm / "v")
    monkeypatch.setenv("VLLM_VENV", str(venv))
    assert O._vllm_python(O.Params.make(False)) == venv / "bin" / "python"
    assert O._vllm_python(O.Params.make(True)) is None  # quick mode (CI) never starts vLLM
    assert O._vllm_python(O.Params.make(False, url="http://example:8000")) is None  # the endpoint is what's measured
    assert O._vllm_python(O.Params.make(False, vllm=False)) is None
    half = fake_venv(no_vllm / "half", installed=False)  # an install that did not finish
    assert vllm_cpu.find_python(half) is None


def test_vllm_server_command_carries_the_settings():
    p = O.Params.make(False, threads=1)
    s = O.Server.vllm("/venv/bin/python", "/ckpt", p)
    cmd = s.cmd
    arg = dict(zip(cmd, cmd[1:]))
    assert cmd[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"] and arg["--model"] == "/ckpt"
    assert {"--skip-tokenizer-init", "--no-enable-prefix-caching", "--no-enable-chunked-prefill"} <= set(cmd)
    assert arg["--dtype"] == "float32" and arg["--host"] == "127.0.0.1" and s.url.endswith(arg["--port"])
    assert int(arg["--max-model-len"]) == p.real.max_model_len and int(arg["--max-num-seqs"]) == O.MAX_NUM_SEQS
    # the same token-slot budget in whole blocks of vLLM-CPU's multiple of 32, plus its null block
    block, blocks = int(arg["--block-size"]), int(arg["--num-gpu-blocks-override"])
    assert block == 32 and (blocks - 1) * block <= p.real.num_slots < blocks * block
    assert s.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and s.env["OMP_NUM_THREADS"] == "1"  # unpinned, as ours
    assert s.env["VLLM_CPU_KVCACHE_SPACE"] and vllm_cpu.environment(2)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert "PYTHONPATH" not in s.env and s.startup_s >= 120
    other = vllm_cpu.server_command("py", "m", 1, served_model_name="x", max_model_len=8, num_slots=100,
                                    block_size=48, max_num_seqs=1, max_num_batched_tokens=8)
    assert other[other.index("--block-size") + 1] == "64"  # rounded up to a multiple of 32


def test_vllm_has_a_curve_and_a_rate_but_no_prediction_and_no_ratio():
    rows = []
    for system in ("paged", "orca_oracle", O.VLLM):
        for rate, nl in ((1.0, 0.01), (2.0, 0.02), (3.0, 0.5)):
            pred = float("nan") if system == O.VLLM else nl * 1.1
            rows.append({"system": system, "rate": rate, "nl_measured_s": nl, "keeps_up_measured": True,
                         "nl_predicted_s": pred, "keeps_up_predicted": system != O.VLLM,
                         "nl_error_pct": 10.0 if system != O.VLLM else float("nan")})
    cur = pd.DataFrame(rows)
    sus = pd.concat([O.sustainable(cur, 0.1, w) for w in ("measured", "predicted")], ignore_index=True)
    assert set(sus[sus.which == "predicted"].system) == {"paged", "orca_oracle"}
    cl = {c.name: c for c in O.claims(cur, sus)}
    v = cl[f"online.sustainable_rate.{O.VLLM}.measured"]
    assert v.ours == 2.0 and v.kind == "tracking" and "no ratio" in v.note
    assert not any(O.VLLM in name for name in cl if "ratio" in name)
    assert "over 6 (system, rate) points" in cl["online.prediction_error_pct.median"].note


FAKE_SERVER = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # as vLLM's engine core
print(child.pid, flush=True)

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def _stopped(pid: int) -> bool:
    """Gone, or a zombie waiting to be reaped (Linux's /proc)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_a_server_and_its_children_are_stopped_on_exit():
    """vLLM's server starts child processes (engine core, worker): leaving the context stops the whole group."""
    port = O._free_port()
    with O.Server([sys.executable, "-c", FAKE_SERVER, str(port)], dict(os.environ), port, startup_s=30) as s:
        s.log.seek(0)
        child = int(s.log.readline())
        assert not _stopped(child)  # alive while the server is
    deadline = time.monotonic() + 5
    while not _stopped(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _stopped(child)
