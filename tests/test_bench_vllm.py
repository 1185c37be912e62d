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
                                   "2", "--output-len", "3", "--rounds", "3", "--calls", "2", "--prompt-len", "4", "32",
                                   "--sharegpt-requests", "5", "--sharegpt-rounds", "2", "--sharegpt-threads", "1",
                                   "--max-num-seqs", "8", "--out", str(out)])
    return summary, json.loads(out.read_text()), out


def test_json_layout(run):
    summary, written, path = run
    assert written["benchmark"] == "engine_vs_vllm" and written["complete"] and written["peer"] == "fake (test)"
    assert written["load_average_1min"]["before"] is not None and written["load_average_1min"]["after"] is not None
    (r,) = written["runs"]
    assert r["dtype"] == "float32" and r["vllm"]["ready"] and r["vllm_threads"] == 1
    assert r["ours_path"]["model_dtype"] == "torch.float32"
    assert [w["workload"] for w in r["workloads"]] == ["b4", "b2", "sharegpt"]
    for w in r["workloads"][:2]:
        assert w["systems"] == ["ours_t1", "ours_t2", "vllm"] and w["calls_per_round"] == 2
        assert w["generated_tokens_per_call"] == w["requests"] * 3
        assert len(w["rounds_raw"]) == 3 and w["speedup_wall"]["ours_t2"]["n"] == 3
        assert all(len(x["call_walls"]) == 2 for rr in w["rounds_raw"] for x in rr.values())
        assert 0 <= w["tokens_equal"]["ours_t1"] <= 1 and w["ours_threads_tokens_equal"] == 1.0
    share = r["workloads"][2]
    assert share["systems"] == ["ours_t1", "vllm"] and share["requests"] == 5 and share["calls_per_round"] == 1
    assert share["output_len"]["min"] >= 4 and share["generated_tokens_per_call"] == share["output_len"]["total"]
    assert "ours_t1_decode_roofline_multiple" in r["workloads"][0]  # fp32 at the largest batch only
    assert "ours_t1_decode_roofline_multiple" not in r["workloads"][1]
    assert set(written["headline"]) >= {"speedup_wall.float32.t2.b4", "speedup_cpu.float32.t1.b2",
                                        "speedup_wall.float32.t1.sharegpt", "tokens_equal.float32",
                                        "decode_roofline_multiple.float32.t1.b4"}
    assert written["targets"]["equal_cores.speedup_wall.bfloat16.b64"]["met"] is None  # not run: no verdict
    rows = engine_vs_vllm.table(str(path)).splitlines()
    assert len(rows) == 2 + 2 + 2 + 1 and rows[2].startswith("| float32 | b4 (4 requests) | 1")


def test_rounds_rotate_who_goes_first(run):
    order = run[1]["order"]
    assert len(order) == 3 * 3 * 2 + 2 * 2
    assert [tuple(order[i:i + 3]) for i in range(0, 9, 3)] == [("ours_t1", "ours_t2", "vllm"),
                                                               ("ours_t2", "vllm", "ours_t1"),
                                                               ("vllm", "ours_t1", "ours_t2")]


def test_equal_cores_pairs_ours_with_the_cpus_vllm_used(run):
    """The fake peer keeps one CPU busy: the equal-core pairing is ours on one thread."""
    for w in run[1]["runs"][0]["workloads"]:
        assert round(w["cpus_used"]["vllm"]["median"]) == 1
        assert w["equal_cores"]["ours"] == "ours_t1"
        assert w["equal_cores"]["speedup_wall"] == w["speedup_wall"]["ours_t1"]


def test_peer_is_stopped_while_ours_runs_and_its_cpu_counts_its_children(run):
    """The fake peer burns its CPU in a child process: the driver's count of the peer's tree includes it, and the
    tree spends nothing while ours runs (it is stopped)."""
    for w in run[1]["runs"][0]["workloads"]:
        assert w["vllm_cpu_while_ours_runs"] <= 0.02  # /proc counts in 10 ms ticks
        for r in w["rounds_raw"]:
            assert r["vllm"]["cpu"] > 0 and r["ours_t1"]["cpu"] > 0 and r["ours_t1"]["wall"] > 0


def test_preload_names_tcmalloc_and_the_venvs_iomp(tmp_path, monkeypatch):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "lib" / "libiomp5.so").write_bytes(b"")
    libs = tmp_path / "libs"
    libs.mkdir()
    (libs / engine_vs_vllm.TCMALLOC).write_bytes(b"")
    monkeypatch.setattr(engine_vs_vllm, "LIB_DIRS", (str(tmp_path / "none"), str(libs)))
    assert engine_vs_vllm.preload(str(venv / "bin" / "python")) == \
        f"{libs / engine_vs_vllm.TCMALLOC}:{venv / 'lib' / 'libiomp5.so'}"
    (venv / "lib" / "libiomp5.so").unlink()
    with pytest.raises(FileNotFoundError, match="libiomp5"):
        engine_vs_vllm.preload(str(venv / "bin" / "python"))
