"""The vLLM benchmark driver's plumbing (benchmarks/engine_vs_vllm.py) against the fake peer: no vLLM needed."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
engine_vs_vllm = pytest.importorskip("engine_vs_vllm")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "vllm.json"
    summary = engine_vs_vllm.main(["--fake-peer", "--batch-sizes", "4", "2", "--dtypes", "float32", "--threads", "1",
                                   "--output-len", "3", "--rounds", "3", "--prompt-len", "4", "32",
                                   "--out", str(out)])
    return summary, json.loads(out.read_text()), out


def test_json_layout(run):
    summary, written, path = run
    assert written["benchmark"] == "engine_vs_vllm" and written["complete"] and written["peer"] == "fake (test)"
    assert written["load_average_1min"]["before"] is not None and written["load_average_1min"]["after"] is not None
    (r,) = written["runs"]
    assert (r["dtype"], r["threads"]) == ("float32", 1) and r["vllm"]["ready"]
    assert r["ours_path"]["model_dtype"] == "torch.float32"
    assert [b["batch_size"] for b in r["batches"]] == [4, 2]
    for b in r["batches"]:
        assert b["generated_tokens"] == b["batch_size"] * 3 == b["tokens_received"]["ours"] == \
            b["tokens_received"]["vllm"]
        assert len(b["rounds"]) == 3 and b["speedup_wall"]["n"] == 3
        assert 0 <= b["tokens_equal"] <= 1
    assert set(written["headline"]) >= {"speedup_wall.float32.t1.b4", "speedup_cpu.float32.t1.b2",
                                        "tokens_equal.float32"}
    assert written["targets"]["speedup_wall.bfloat16.t1.b64"]["met"] is None  # not run: no verdict
    rows = engine_vs_vllm.table(str(path)).splitlines()
    assert len(rows) == 4 and rows[2].startswith("| float32 | 1 | 4 |")


def test_interleaving_alternates_who_goes_first(run):
    order = run[1]["order"]
    assert len(order) == 2 * 3 * 2
    pairs = [tuple(order[i:i + 2]) for i in range(0, len(order), 2)]
    assert pairs[:3] == [("ours", "vllm"), ("vllm", "ours"), ("ours", "vllm")]


def test_peer_cpu_counts_its_children(run):
    """The fake peer burns its CPU in a child process: the driver's count of the peer's tree includes it."""
    for b in run[1]["runs"][0]["batches"]:
        for r in b["rounds"]:
            assert r["vllm"]["cpu"] >= r["vllm"]["child_cpu_s"] - 0.02 > 0  # /proc counts in 10 ms ticks
            assert r["ours"]["cpu"] > 0 and r["ours"]["wall"] > 0
