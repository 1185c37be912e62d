"""The simulator's step-time constants measured on an A100 (issue 30, part 3), from Vidur's published profiles.

Source: Vidur (Agrawal et al., "Vidur: A Large-Scale Simulation Framework for LLM Inference", MLSys 2024), repository
``microsoft/vidur``, MIT licence (Copyright (c) Microsoft Corporation). Its ``data/profiling/`` holds per-operator
GPU times measured on an A100-80GB (medians of repeated CUDA-event timings, in ms) and the serving framework's
per-step CPU times. ``data/a100_profile.json`` beside this module holds only the rows used here, transcribed by
``benchmarks/derive_a100_profile.py``, with each file's repository, path and commit:

- ``data/profiling/compute/a100/meta-llama/Llama-2-7b-hf/mlp.csv`` (microsoft/vidur @ bee57da): every non-attention
  operator of one decoder layer (norms, QKV / output projections, RoPE, gated MLP, residual add) by token count;
- the same for ``internlm/internlm-20b`` (hidden size 5120, OPT-13B's), used for the 7B -> 13B transfer;
- ``data/profiling/compute/a100/meta-llama/Llama-2-7b-hf/attention.csv``: a Git LFS pointer in microsoft/vidur
  (blob 6ce0a3b, ``size 10680357``); the rows used come from the copy committed in the fork ``sw5sh/cs378-assignment3``
  @ 7ac2fe9 (10,680,357 bytes, the pointer's size; its sha256 could not be computed here, ``SOURCE_SHA256``),
  FlashAttention backend, block 16;
- ``data/profiling/a100/cpu_overheads.csv`` (microsoft/vidur @ 6d98aa8, deleted in later commits): per-step CPU
  times of the vLLM-derived engine Vidur profiled, by batch size.

What is derived (``derive``), each with its spread over the profiled shapes:

- **bandwidth efficiency** (decode): the bytes one decoder layer reads at a decode step, its linear weights plus the
  K/V of ``batch x context`` tokens, over the measured time of all its operators (attention included), as a
  fraction of the A100-80GB datasheet's 2.039 TB/s. An efficiency is a fraction of the datasheet, so it transfers
  to the paper's A100-40GB (1.555 TB/s, same GA100 chip and memory system: 5 HBM2(e) stacks, 5120-bit bus): the
  simulator multiplies it by ``CostModel.hbm_bytes_per_s`` = 1.555 TB/s;
- **FLOP efficiency** (large prefill): ``2 x params x tokens`` FLOPs of one layer (the simulator's own count, which
  has no attention term) over the measured time of the layer's non-attention operators at 1024-4096 tokens, as a
  fraction of 312 TFLOP/s (fp16 tensor cores, the same on both cards). The simulator's prefill steps are batches of
  prompts of a few hundred tokens, whose attention FLOPs are about 1 % of the linear ones; a single 3072-token prompt
  with its attention measured is reported beside it (``flops_efficiency_with_attention``) and sets the band's floor;
- **per-step overhead** ``a + b x batch``: Vidur's CPU overhead, the sum it charges per step (``schedule``,
  ``sampler_e2e``, ``prepare_inputs_e2e``, ``process_model_outputs`` medians; ``ray_comm_time`` is left out: on one
  GPU the paper's vLLM runs its worker in-process), fitted by least squares over batch 8-128 (the profiled range;
  there is no batch-1 row).

Every source file's sha256 is pinned (``SOURCE_SHA256``), recorded in the table and checked when the table is rebuilt
(the script refuses another file) and loaded (``load_profile``).

Against the assumed constants (``CostModel.assumed()``), on the same card (OPT-13B, A100-40GB): a decode step of
batch 8-64 with 200-500 tokens of context each takes 0.94-1.03x as long under the assumed constants as under the
measured ones (the efficiencies alone: 0.93x, 0.65 against 0.7; the flat 4 ms is above the measured overhead below
batch about 75); a prefill of 512-2048 tokens 1.3x (FLOP efficiency 0.64 against 0.5). Put on the 80 GB card's
2.039 TB/s instead, the measured decode step is 1.26-1.34x faster than the assumed one on the 40 GB card: a
difference of cards, not of constants.
"""
from __future__ import annotations

import hashlib
import json
import math
import statistics
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

PROFILE_PATH = Path(__file__).resolve().parent / "data" / "a100_profile.json"

#: Datasheet peaks (NVIDIA A100 datasheet): HBM bandwidth of the 80 GB (SXM) and 40 GB cards, dense fp16 tensor cores.
A100_80GB_HBM_BYTES_PER_S = 2.039e12
A100_40GB_HBM_BYTES_PER_S = 1.555e12
A100_FP16_FLOPS_PER_S = 312e12

#: The operators of one decoder layer outside attention, as Vidur's ``ExecutionTime`` sums them per block.
LAYER_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
#: The CPU-side columns Vidur charges per step (``ExecutionTime._get_cpu_overhead``), less ``ray_comm_time``.
OVERHEAD_COLUMNS = ("schedule", "sampler_e2e", "prepare_inputs_e2e", "process_model_outputs")
#: Token counts of a "large" prefill (the FLOP efficiency's shapes).
PREFILL_TOKENS = (1024, 2048, 3072, 4096)


#: sha256 of every profile file the table comes from (the bytes ``git show <commit>:<path>`` gives), pinned here and
#: recorded in the table's ``sources``; ``benchmarks/derive_a100_profile.py`` checks each input file against it before
#: it reads a row, and ``load_profile`` checks that the table records these. ``attention.csv`` has none: the fork's
#: copy (10.7 MB) is over the size of file a repository snapshot carries here and was read in 16,000-character pages,
#: so its bytes were never whole on this machine; its rows are transcribed by character offset instead
#: (``ATTENTION_DECODE`` in the script), and the table says so (``sha256_missing``).
SOURCE_SHA256: dict[str, str | None] = {
    "mlp_llama2_7b": "2cfacca979f32e83257753cf6fd815a71af8ba9a7a9d0643b18d9f54e8a37688",
    "mlp_internlm_20b": "efdad580da6ecb50e3716543439a31fc71484de365e0f8cfe9430c5e4d5487c3",
    "cpu_overheads": "79694db647120090f96192625c70d74dc79bd3c7e0bfcb053726413e2a25c548",
    "attention_llama2_7b": None,
}


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def verify_source(key: str, path: str | Path) -> str:
    """The sha256 of ``path`` if it is the profile file ``key`` names (``SOURCE_SHA256``); else ``ValueError``."""
    want = SOURCE_SHA256[key]
    got = file_sha256(path)
    if want is None or got != want:
        raise ValueError(f"{path}: sha256 {got} is not the pinned {key} ({want}): another file, or another commit")
    return got


def check_sources(profile: dict) -> None:
    """Every source of the table records the sha256 pinned in ``SOURCE_SHA256`` (or, where none is pinned, says why
    in ``sha256_missing``), and no source is unpinned; else ``ValueError``."""
    sources = profile.get("sources", {})
    if set(sources) != set(SOURCE_SHA256):
        raise ValueError(f"profile sources {sorted(sources)} are not the pinned ones {sorted(SOURCE_SHA256)}")
    for key, src in sources.items():
        want = SOURCE_SHA256[key]
        if src.get("sha256") != want:
            raise ValueError(f"profile source {key}: sha256 {src.get('sha256')} is not the pinned {want}")
        if want is None and not src.get("sha256_missing"):
            raise ValueError(f"profile source {key} has no sha256 and does not say why (sha256_missing)")


@lru_cache(maxsize=1)
def load_profile(path: Path = PROFILE_PATH) -> dict:
    """The committed table (``data/a100_profile.json``), its sources' checksums checked (``check_sources``)."""
    profile = json.loads(Path(path).read_text())
    check_sources(profile)
    return profile


def linear_params(model: dict) -> int:
    """Weights of one layer's linear maps: Q, K, V and output projections (``n_kv_head`` may be fewer than the query
    heads), and a gated MLP's three (gate, up, down) or a plain MLP's two."""
    h, ffn = model["hidden"], model["ffn"]
    kv = model["n_kv_head"] * (h // model["n_head"])
    return h * h + 2 * h * kv + h * h + (3 if model["gated_mlp"] else 2) * h * ffn


def layer_ms(ops: dict) -> float:
    """Measured ms of one layer's non-attention operators (``LAYER_OPS``) at one token count."""
    return sum(ops[k] for k in LAYER_OPS)


def decode_bandwidth_efficiencies(profile: dict | None = None, hbm: float = A100_80GB_HBM_BYTES_PER_S) -> list[dict]:
    """Per profiled decode shape (``batch`` sequences of ``context`` tokens each) of Llama-2-7B: one layer's bytes
    (linear weights + K/V read) over its measured time (``LAYER_OPS`` at ``batch`` tokens + the attention kernel with
    its reshapes), as a fraction of ``hbm``."""
    p = profile or load_profile()
    m = p["models"]["llama2_7b"]
    weights = linear_params(m) * m["dtype_bytes"]
    kv_per_token = 2 * m["n_kv_head"] * (m["hidden"] // m["n_head"]) * m["dtype_bytes"]
    out = []
    for r in p["attention_decode"]:
        ms = layer_ms(m["ops"][str(r["batch"])]) + r["input_reshape"] + r["decode"] + r["output_reshape"]
        nbytes = weights + r["batch"] * r["context"] * kv_per_token
        out.append({"batch": r["batch"], "context": r["context"], "ms": ms, "bytes": nbytes,
                    "efficiency": nbytes / (ms * 1e-3) / hbm})
    return out


def weight_read_efficiencies(model_key: str, profile: dict | None = None,
                             hbm: float = A100_80GB_HBM_BYTES_PER_S) -> dict[int, float]:
    """Per decode token count (8-128): one layer's linear weights over its non-attention operators' time (no K/V):
    the part of decode that has a profile for both Llama-2-7B and InternLM-20B (the 7B -> 13B transfer)."""
    p = profile or load_profile()
    m = p["models"][model_key]
    weights = linear_params(m) * m["dtype_bytes"]
    return {int(t): weights / (layer_ms(ops) * 1e-3) / hbm for t, ops in m["ops"].items() if int(t) <= 128}


def prefill_flops_efficiencies(model_key: str = "llama2_7b", profile: dict | None = None,
                               peak: float = A100_FP16_FLOPS_PER_S) -> dict[int, float]:
    """Per large prefill (``PREFILL_TOKENS``): ``2 x linear params x tokens`` over the layer's non-attention time."""
    p = profile or load_profile()
    m = p["models"][model_key]
    params = linear_params(m)
    return {t: 2 * params * t / (layer_ms(m["ops"][str(t)]) * 1e-3) / peak for t in PREFILL_TOKENS}


def prefill_flops_efficiency_with_attention(profile: dict | None = None, peak: float = A100_FP16_FLOPS_PER_S) -> dict:
    """Per profiled single-prompt prefill of Llama-2-7B (no cached context): the same FLOPs over the layer's time
    with the measured FlashAttention prefill kernel added (so attention's quadratic cost lowers the efficiency)."""
    p = profile or load_profile()
    m = p["models"]["llama2_7b"]
    params = linear_params(m)
    out = {}
    for r in p["attention_prefill"]:
        ms = layer_ms(m["ops"][str(r["tokens"])]) + r["input_reshape"] + r["prefill"] + r["output_reshape"]
        out[r["tokens"]] = 2 * params * r["tokens"] / (ms * 1e-3) / peak
    return out


@dataclass(frozen=True)
class OverheadFit:
    """Per-step overhead ``intercept_s + per_seq_s x batch`` fitted by least squares, and its error on the points."""

    intercept_s: float
    per_seq_s: float
    max_abs_err_s: float
    rms_err_s: float

    def __call__(self, batch: int) -> float:
        return self.intercept_s + self.per_seq_s * batch


def overhead_points(model: str = "meta-llama/Llama-2-7b-hf", profile: dict | None = None) -> list[tuple[int, float]]:
    """``(batch, seconds)``: the sum of ``OVERHEAD_COLUMNS`` of each profiled batch size (tensor parallel 1)."""
    p = profile or load_profile()
    return [(r["batch_size"], 1e-3 * sum(r[c] for c in OVERHEAD_COLUMNS))
            for r in p["cpu_overheads"] if r["model_name"] == model]


def fit_overhead(points: list[tuple[int, float]]) -> OverheadFit:
    """Ordinary least squares of ``seconds = a + b x batch``."""
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(y for _, y in points) / n
    slope = sum((b - mx) * (y - my) for b, y in points) / sum((b - mx) ** 2 for b, _ in points)
    a = my - slope * mx
    res = [y - (a + slope * b) for b, y in points]
    return OverheadFit(a, slope, max(abs(r) for r in res), (sum(r * r for r in res) / n) ** 0.5)


def derive(profile: dict | None = None) -> dict:
    """The measured constants and their spreads (see the module docstring). Every number is computed here from the
    committed table, so a test can recompute it."""
    p = profile or load_profile()
    decode = [r["efficiency"] for r in decode_bandwidth_efficiencies(p)]
    w7, w20 = weight_read_efficiencies("llama2_7b", p), weight_read_efficiencies("internlm_20b", p)
    f7, f20 = prefill_flops_efficiencies("llama2_7b", p), prefill_flops_efficiencies("internlm_20b", p)
    fatt = prefill_flops_efficiency_with_attention(p)
    fit7 = fit_overhead(overhead_points("meta-llama/Llama-2-7b-hf", p))
    fit_phi = fit_overhead(overhead_points("microsoft/phi-2", p))
    return {
        "bandwidth_efficiency": statistics.median(decode),
        "bandwidth_efficiency_spread": (min(decode), max(decode)),
        # 7B -> 13B: the weight-read part measured on a model of OPT-13B's width, against the 7B's, same token counts
        "weight_read_shift_13b": (min(w20[t] - w7[t] for t in w7), max(w20[t] - w7[t] for t in w7)),
        "flops_efficiency": statistics.median(f7.values()),
        "flops_efficiency_spread": (min(f7.values()), max(f7.values())),
        "flops_efficiency_13b_width_spread": (min(f20.values()), max(f20.values())),
        "flops_efficiency_with_attention": fatt,
        "overhead_fit": fit7,
        "overhead_fit_vocab_51k": fit_phi,  # phi-2: vocabulary 51,200, near OPT's 50,272 (the sampler's share)
    }


@lru_cache(maxsize=1)
def measured() -> dict:
    """``derive()`` on the committed table, computed once."""
    return derive()


def _down(x: float, step: float) -> float:
    return round(math.floor(x / step + 1e-9) * step, 10)


def _up(x: float, step: float) -> float:
    return round(math.ceil(x / step - 1e-9) * step, 10)


def measured_band(d: dict | None = None) -> dict[str, tuple[float, float]]:
    """The sensitivity band over the measured constants (``sensitivity.MEASURED_BAND``), by a rule stated before any
    claim was recomputed: each end is the profiled spread plus the 7B -> 13B transfer, rounded outward (efficiencies
    to 0.01, the intercept to 0.01 ms, the slope to 0.001 ms per sequence).

    - bandwidth: ``[min decode + min shift, max decode + max shift]`` (``weight_read_shift_13b``);
    - FLOPs: from the lowest of the 7B's large prefills, the 13B-width model's and the prefill with attention, to
      the highest of the first two;
    - overhead: the two fits' intercepts (vocabulary 32K and 51K), each moved outward by the larger worst residual;
      the two fits' slopes."""
    d = d or measured()
    (lo, hi), (slo, shi) = d["bandwidth_efficiency_spread"], d["weight_read_shift_13b"]
    flo = min(d["flops_efficiency_spread"][0], d["flops_efficiency_13b_width_spread"][0],
              *d["flops_efficiency_with_attention"].values())
    fhi = max(d["flops_efficiency_spread"][1], d["flops_efficiency_13b_width_spread"][1])
    fits = (d["overhead_fit"], d["overhead_fit_vocab_51k"])
    err = max(f.max_abs_err_s for f in fits)
    return {"bandwidth_efficiency": (_down(lo + slo, 0.01), _up(hi + shi, 0.01)),
            "flops_efficiency": (_down(flo, 0.01), _up(fhi, 0.01)),
            "step_overhead_s": (_down(min(f.intercept_s for f in fits) - err, 1e-5),
                                _up(max(f.intercept_s for f in fits) + err, 1e-5)),
            "step_overhead_per_seq_s": (_down(min(f.per_seq_s for f in fits), 1e-6),
                                        _up(max(f.per_seq_s for f in fits), 1e-6))}


#: The interconnect constants of ``sim.CostModel`` that no measurement here sets (issue 50). A claim whose value rests
#: on them says so in its note (``assumed_note``). The one swap measurement on record, the H200 run of notebook 06's
#: microbenchmark (``shared/gpu/h200-2026-12-04/project_gpu_check/06_preemption``), times this engine's per-block
#: copy path on another card and bus (an H200, PCIe 5.0) with one model: one point, which sets neither the A100's
#: PCIe bandwidth nor its per-copy latency. No run here had more than one GPU, so nothing measured NVLink.
ASSUMED_INTERCONNECT = {
    "swap": "PCIe swap constants assumed, not measured (CostModel: 32 GB/s x 0.8 per direction, 5 us per copy); the "
            "one swap measurement here (notebook 06's microbenchmark on an H200) is another card and bus and sets "
            "neither",
    "nvlink": "NVLink all-reduce constants assumed, not measured (CostModel: 300 GB/s x 0.5, 10 us per all-reduce); "
              "no multi-GPU run here",
}


def assumed_note(kind: str) -> str:
    """The note a claim that rests on an assumed interconnect constant carries (``ASSUMED_INTERCONNECT``)."""
    return ASSUMED_INTERCONNECT[kind]

