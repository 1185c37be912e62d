"""``python -m pagedattn.repro.experiments.gpu_check`` (``make gpu``): its dry run on a machine without a GPU lists every step and
exits 0, and its claim filling keeps a summary's other claims."""
from __future__ import annotations

import json

from pagedattn.repro.experiments import gpu_check
from pagedattn.repro.report.results import Claim


def test_dry_run_lists_every_step(capsys, tmp_path):
    assert gpu_check.main(["--dry-run", "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in gpu_check.STEPS:
        assert f". {name}:" in out
    assert "paged_over_contiguous_latency.gpu" in out and "recompute_over_swap_latency.gpu" in out
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


def test_unknown_step_is_refused(capsys):
    import pytest

    with pytest.raises(SystemExit):
        gpu_check.main(["--dry-run", "--only", "kernels,nope"])
    assert "nope" in capsys.readouterr().err


def test_fill_claims_replaces_by_name(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"experiment": "x", "claims": [
        {"name": "a.gpu", "ours": None, "note": "not measured"}, {"name": "b", "ours": 1.0}]}))
    gpu_check.fill_claims(path, [Claim("a.gpu", 1.2, 1.05, "x", "ours <= 1.1", True, "measured")], "cuda: X")
    doc = json.loads(path.read_text())
    assert [c["name"] for c in doc["claims"]] == ["a.gpu", "b"]
    assert doc["claims"][0]["ours"] == 1.05 and doc["claims"][1]["ours"] == 1.0
    assert doc["extra"]["gpu_check"]["hardware"] == "cuda: X"


def test_per_block_size_frame_is_relative_to_block16():
    import pandas as pd

    df = pd.DataFrame([{"batch": 8, "context": 256, "block_size": bs, "paged_ms": ms}
                       for bs, ms in [(8, 2.0), (16, 1.0), (32, 0.9)]] +
                      [{"batch": 32, "context": 256, "block_size": 16, "paged_ms": 5.0}])
    out = gpu_check.kernel_per_block_size(df).set_index("block_size")
    assert list(out.ratio_to_block16) == [2.0, 1.0, 0.9]
    assert abs(out.loc[16, "ms_per_1k_tokens"] - 1.0 / 2.048) < 1e-12


def test_gpu_results_fill_the_null_claims_of_02_and_06():
    """The notebooks keep a GPU run's claims when rerun on a CPU: 02 from the newest GPU benchmark file, 06 from the
    GPU microbenchmark table; without them the claims stay null."""
    import pandas as pd

    from pagedattn.repro.experiments import attention_kernel as ak
    from pagedattn.repro.experiments import preemption as pe

    nulls = [Claim("paged_over_contiguous_latency.gpu", None, None), Claim("bandwidth_fraction.gpu", None, None),
             Claim("paged_over_same_kernel_latency.gpu", None, None)]
    assert ak.with_gpu_claims(nulls, {}) == nulls
    rows = [{"batch": b, "context": c, "block_size": 16, "ratio": 0.5, "ratio_vs_sdpa": 1.25, "ratio_same_code": 1.05,
             "bw_fraction": 0.8} for b in ak.FIG18A_BATCHES for c in (*ak.FIG18A_CONTEXTS, ak.BW_POINT["context"])]
    meta = {"device": "cuda:0", "hardware": "cuda: X", "hardware_slug": "cuda-x", "timestamp": "t",
            "copy_bandwidth_gbps": 3000.0}
    filled = ak.with_gpu_claims(nulls, {"cuda-x": {"meta": meta, "df": pd.DataFrame(rows),
                                                   "path": gpu_check.Path("bench_cuda-x.json")}})
    assert [c.name for c in filled] == [c.name for c in nulls]
    # Fig. 18a against SDPA (issue 54), the same-kernel ratio apart; the file's own ``ratio`` column is not read
    assert abs(filled[0].ours - 1.25) < 1e-12 and filled[0].holds and filled[1].ours == 0.8 and filled[1].holds
    assert abs(filled[2].ours - 1.05) < 1e-12 and filled[2].holds
    assert [c.ours for c in pe.gpu_claims(None)] == [None, None, None]  # blocks 1, 16, 64 (Fig. 19)
    micro = pd.DataFrame({"block_size": [1, 16, 64], "recompute_over_swap": [0.1, 0.1, 1.0], "scale": "GPU",
                          "tokens": 1024})
    assert [(c.ours, c.holds) for c in pe.gpu_claims(micro)] == [(0.1, True), (0.1, False), (1.0, True)]
    no_block1 = pe.gpu_claims(micro[micro.block_size > 1])
    assert no_block1[0].ours is None and "measured no block 1" in no_block1[0].note


def test_equivalence_judges_fp32_by_identity_and_half_precision_against_hf():
    """fp32: identical tokens or the claim fails; fp16 / bf16: the engine's agreement with HF float64 against HF's own
    (issue 54); a dtype not measured stays null."""
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert gpu_check.first_divergence([[1, 2, 3, 4], [5, 0, 7, 8]], ref) == [None, 1]
    assert gpu_check.agreement([[1, 2, 3, 4], [5, 0, 7, 8]], ref) == (1 + 0.25) / 2
    cl = {c.name: c for c in gpu_check.equivalence_claims("cuda: X", {
        "float32": {"identical": 7, "prompts": 8, "tokens": 4},
        "float16": {"ours_vs_fp64": 0.60, "hf_vs_fp64": 0.65, "prompts": 8, "tokens": 4},
        "bfloat16": {"ours_vs_fp64": 0.40, "hf_vs_fp64": 0.55, "prompts": 8, "tokens": 4}}, "test")}
    assert cl["engine_matches_hf_greedy.gpu.float32"].holds is False
    assert cl["engine_fp64_agreement_minus_hf.gpu.float16"].holds is True
    assert cl["engine_fp64_agreement_minus_hf.gpu.bfloat16"].holds is False
    empty = gpu_check.equivalence_claims("cuda: X", {}, "no run")
    assert [c.ours for c in empty] == [None, None, None] and all("not measured" in c.note for c in empty)


def test_issue54_steps_run_their_code_on_the_cpu(tmp_path):
    """The kernel-vs-SDPA and engine steps on tiny shapes (``Sizes.smoke``), on the CPU: every figure the GPU run
    needs comes out (timings, the roofline without a copy bandwidth stays null, the profiler's launches), with the
    claims named as the GPU run names them. Not a GPU figure: the code path only."""
    ctx = gpu_check.Context(tmp_path, "cpu", "cpu: smoke", "cpu-smoke", sizes=gpu_check.Sizes.smoke())
    k = gpu_check.step_kernel_vs_sdpa(ctx)
    assert k["rows"] == 2 and set(k) >= {"mha", "gqa"}
    import pandas as pd

    df = pd.read_csv(k["file"])
    assert (df.max_abs_diff_vs_sdpa < 1e-4).all() and (df.paged_ms > 0).all()
    e = gpu_check.step_engine(ctx)
    d = e["decode"]
    # a difference of two short wall times: any sign on a loaded CPU, so only its presence is checked here
    assert d["decode_steps"] == 2 and isinstance(d["decode_step_ms"], float) and d["launches_per_decode_step"] == 0
    assert d["roofline_ms"] is None and e["mns4"]["tokens_per_s"] > 0 and e["hf_generate_b2"]["tokens_per_s"] > 0
    names = {c.name: c for c in ctx.claims["gpu_check"]}
    assert {"kernel_over_sdpa.gpu.mha", "kernel_bandwidth_fraction.gpu.gqa", "engine_tokens_per_s.gpu.mns4",
            "decode_step_over_roofline.gpu.b4", "gpu_busy_fraction.gpu.decode_b4",
            "hf_generate_tokens_per_s.gpu.b2", "launches_per_decode_step.gpu.b4"} <= set(names)
    assert names["gpu_busy_fraction.gpu.decode_b4"].ours is None  # no device activity on a CPU: null, not 0


def test_cuda_graphs_step_runs_its_code_on_the_cpu(tmp_path):
    """``cuda_graphs`` on tiny shapes on the CPU: both engines run the workload and every figure comes out, but no
    graph is taken on a CPU, so its claims stay null (never an eager-vs-eager identity passed off as a GPU one)."""
    ctx = gpu_check.Context(tmp_path, "cpu", "cpu: smoke", "cpu-smoke", sizes=gpu_check.Sizes.smoke())
    out = gpu_check.step_cuda_graphs(ctx)
    assert out["graphs"]["graphs_captured"] is None and out["eager"]["graphs_captured"] is None
    assert out["prompts"] == 3 and out["identical_prompts"] == 3 and out["first_divergence"] == [None] * 3
    assert out["graphs"]["tokens_per_s"] > 0 and out["eager"]["tokens_per_s"] > 0
    names = {c.name: c for c in ctx.claims["gpu_check"]}
    assert names["cuda_graphs_match_eager.gpu.float32"].ours is None
    assert names["cuda_graphs_speedup.gpu.mns2"].ours is None and names["cuda_graphs_speedup.gpu.mns2"].kind == "tracking"


def test_a_failing_step_is_reported_not_skipped(monkeypatch, tmp_path, capsys):
    """On a GPU a step that raises is recorded with its error and the exit status is 1; the other steps run."""
    import torch

    ran = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "steps", lambda: [
        gpu_check.Step("kernels", "boom", [], lambda ctx: (_ for _ in ()).throw(RuntimeError("no kernel"))),
        gpu_check.Step("swap", "ok", [], lambda ctx: ran.append(1) or {"x": 1})])
    import pagedattn.repro.report.results as results

    monkeypatch.setattr(results, "hardware_label", lambda device: "cuda: test")
    assert gpu_check.main(["--only", "kernels,swap", "--results-dir", str(tmp_path)]) == 1
    doc = json.loads((tmp_path / "gpu_check" / "summary.json").read_text())
    assert doc["extra"]["failed"] == {"kernels": "RuntimeError: no kernel"} and ran == [1]
    assert "FAILED" in capsys.readouterr().out


def test_import_run_labels_and_rejudges_a_run_made_elsewhere(tmp_path):
    """``--import-run``: a device machine's files are copied, their claims recomputed and labelled with the GPU, the
    versions, the date and the source; an old-format equivalence step (same dtype only) becomes tracking counts and
    null float64 claims, never a guessed number."""
    import pandas as pd

    run, res = tmp_path / "run", tmp_path / "results"
    (run / "06_preemption").mkdir(parents=True)
    (res / "06_preemption").mkdir(parents=True)
    (res / "06_preemption" / "summary.json").write_text(json.dumps({"experiment": "06", "claims": []}))
    pd.DataFrame({"block_size": [16, 64], "recompute_over_swap": [0.4, 0.9], "scale": "GPU", "tokens": 1024}).to_csv(
        run / "06_preemption" / "micro_cuda-x.csv", index=False)
    (run / "gpu_check_summary.a.json").write_text(json.dumps({
        "hardware": "cuda: X", "date": "2026-01-02",
        "extra": {"torch": "t1", "triton": "tr1", "transformers": "tf1", "steps": {"engine_vs_hf": {
            "llama.float16": {"identical": 3, "prompts": 4, "first_divergence": [2]},
            "opt.float16": {"identical": 4, "prompts": 4, "first_divergence": []}}}}}))
    claims = {c.name: c for c in gpu_check.import_run(run, res, source="commit abc")}
    assert (res / "06_preemption" / "micro_cuda-x.csv").exists()
    assert claims["recompute_over_swap_latency.gpu.block16"].ours == 0.4
    assert claims["engine_identical_to_hf_greedy.gpu.float16"].ours == 7 / 8
    assert claims["engine_identical_to_hf_greedy.gpu.float16"].kind == "tracking"
    assert claims["engine_fp64_agreement_minus_hf.gpu.float16"].ours is None
    assert claims["engine_matches_hf_greedy.gpu.float32"].ours is None  # no fp64.json given
    label = json.loads((res / "06_preemption" / "summary.json").read_text())["extra"]["gpu_check"]
    assert (label["date"], label["torch"], label["triton"]) == ("2026-01-02", "t1", "tr1")
    assert label["source"] == "commit abc"
    assert json.loads((res / "gpu_check" / "summary.json").read_text())["date"] == "2026-01-02"
