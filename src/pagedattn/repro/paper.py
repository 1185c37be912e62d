"""The paper's published numbers, in one place (Kwon et al., SOSP 2023, arXiv:2309.06180).

Notebooks, experiments and ``results/SUMMARY.md`` import these values; none of them retypes a paper number.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pagedattn.config import ModelSpec
from pagedattn.memory.systems import LABELS

# §3 / Fig. 2: share of KV memory (percent) while each system is memory-bound (OPT-13B, ShareGPT, A100-40GB).
FIG2_SHARES = {
    #               token states, reserved, internal frag, external frag & other
    "orca_max":    {"token_states": 20.4, "reserved": 13.3, "internal": 57.3, "external": 8.9},
    "orca_pow2":   {"token_states": 26.8, "reserved": 17.9, "internal": 13.6, "external": 41.6},
    "orca_oracle": {"token_states": 38.2, "reserved": 25.2, "internal": 0.0, "external": 36.6},
    "paged":       {"token_states": 96.3, "reserved": None, "internal": None, "external": None, "waste": 3.7},
}

# §3 and the study note (§9.1, exercise 1): KV cache per token (KB: 1024 B) of OPT-13B, LLaMA-2-70B (GQA-8) and the
# note's 7B model; one 2048-token OPT-13B request holds 1.6 GB (800 KB x 2048 = 1600 MB).
KV_KB_PER_TOKEN = {"OPT-13B": 800, "LLaMA-2-70B": 320, "LLaMA-7B": 512}
KV_GB_2048_TOKENS_OPT13B = 1.6

# §4.2, Fig. 6 (the note's §9.2 and exercise 1): at block size 16, a 40-token request fills its blocks 16 + 16 + 8,
# and 1000 tokens need 63 blocks, the last one half full.
BLOCK_FILLS_40_TOKENS = [16, 16, 8]
BLOCKS_FOR_1000_TOKENS = 63

# §4.4, Fig. 8 (the note's exercise 4): four samples share a block (reference count 4); when one writes to it,
# copy-on-write leaves it with 3.
COW_REF_COUNTS = (4, 3)

# Table 1: KV token slots per setup, and the maximum sequence length.
KV_SLOTS = {"OPT-13B": 15_700, "OPT-66B": 9_700, "OPT-175B": 60_100}
KV_GB = {"OPT-13B": 12, "OPT-66B": 21, "OPT-175B": 264}
#: Table 1: parameter size (GB) and the GPUs of each setup (count, GB of memory each).
PARAM_GB = {"OPT-13B": 26, "OPT-66B": 132, "OPT-175B": 346}
GPUS = {"OPT-13B": (1, 40), "OPT-66B": (4, 40), "OPT-175B": (8, 80)}
MAX_SEQ_LEN = 2048

# Fig. 11: trace means (tokens) after vLLM's benchmark filters.
TRACE_MEANS = {"sharegpt": {"input": 161.31, "output": 337.99}, "alpaca": {"input": 19.31, "output": 58.45}}

# Fig. 13: mean batched requests (OPT-13B). ShareGPT at 2 req/s, Alpaca at 30 req/s.
FIG13_MEAN_BATCH = {
    "sharegpt": {"rate": 2.0, "orca_max": 7.00, "orca_pow2": 9.81, "orca_oracle": 13.62, "paged": 30.42},
    "alpaca": {"rate": 30.0, "orca_max": 7.00, "orca_pow2": 43.24, "orca_oracle": 72.75, "paged": 132.44},
}

# Figs. 12-13: sustainable request-rate ratios on ShareGPT (ranges over the three model sizes).
FIG12_RATE_RATIO = {"paged_vs_orca_oracle": (1.7, 2.7), "paged_vs_orca_max": (2.7, 8.0), "paged_vs_ft": (None, 22.0)}
HEADLINE_THROUGHPUT_GAIN = (2.0, 4.0)

# Fig. 14: throughput gain over Orca (Oracle), OPT-13B on Alpaca.
FIG14_GAIN = {"n1": 1.3, "beam_w6": 2.3}

# Fig. 15: memory saved by sharing (percent).
FIG15_SAVING = {
    "alpaca": {"parallel": {2: 6.09, 4: 8.53, 6: 9.79}, "beam": {2: 37.56, 4: 53.13, 6: 55.16}},
    "sharegpt": {"parallel": (16.2, 30.5), "beam": (44.3, 66.3)},
}

# Fig. 16: shared-prefix speedup over Orca (Oracle), translation few-shot.
FIG16_PREFIX = {"one_shot": {"prefix_len": 80, "speedup": 1.67}, "five_shot": {"prefix_len": 341, "speedup": 3.58}}

# Fig. 18: kernel overhead and block-size findings.
FIG18A_PAGED_OVER_CONTIGUOUS = (1.20, 1.26)
FIG18B_BEST_BLOCK_SIZES = {"sharegpt": [16, 32, 64, 128], "alpaca": [16, 32]}
DEFAULT_BLOCK_SIZE = 16

# Fig. 19: recomputation's latency is at most this share of swapping's at small block sizes; the two are comparable
# for block sizes 16-64 (Fig. 19b).
FIG19_RECOMPUTE_OVER_SWAP_MAX = 0.20
FIG19_COMPARABLE_BLOCK_SIZES = (16, 64)

# Fig. 17 (§6.5, chatbot on multi-round ShareGPT, OPT-13B): ours sustains 2x the rate of the three Orca variants,
# which perform alike.
FIG17_RATE_RATIO = 2.0

# The paper's models (Table 1) and the study note's examples, as KV shapes (moved from the core's config.py, issue 49).
OPT_13B = ModelSpec("OPT-13B", num_layers=40, num_kv_heads=40, head_dim=128, max_model_len=2048)
OPT_175B = ModelSpec("OPT-175B", num_layers=96, num_kv_heads=96, head_dim=128, max_model_len=2048)
LLAMA_7B = ModelSpec("LLaMA-7B", num_layers=32, num_kv_heads=32, head_dim=128, max_model_len=2048)
LLAMA2_70B = ModelSpec("LLaMA-2-70B", num_layers=80, num_kv_heads=8, head_dim=128, max_model_len=4096)


def paper_slots(spec: ModelSpec = OPT_13B, kv_gb: float = 12.0) -> int:
    """Token slots in the paper's KV budget (Table 1: OPT-13B, 12 GB -> 15.7K slots)."""
    return spec.token_slots(kv_gb * 1024**3)


assert math.isclose(OPT_13B.kv_bytes_per_token, 800 * 1024)


# ------------------------------------------------------------------------------------------------------ registry
@dataclass(frozen=True)
class PaperNumber:
    """One number the paper states, and the one claim that judges it (issue 61: one paper number, one claim).

    ``value`` is a number, a ``(lo, hi)`` range, a list (a set of block sizes) or words (a qualitative finding);
    ``printed`` is how the paper prints it; ``where`` is the section, figure or table that states it. ``owner`` is the
    notebook whose ``claim`` judges it in the paper's setup; ``cross_checks`` are other notebooks' claims that measure
    the same number another way, each recorded (never judged) with the relative ``agree`` within which it must match
    the owner's value, or ``why`` it differs (``tests/test_registry.py`` holds the committed results to it).
    ``not_measured`` says why no notebook judges the number, for an entry without an owner.
    """

    paper_id: str
    figure: str
    quantity: str
    value: Any
    printed: str
    where: str
    owner: str | None = None
    claim: str | None = None
    cross_checks: tuple[CrossCheck, ...] = ()
    not_measured: str = ""

    def __post_init__(self):
        if (self.owner is None) == (not self.not_measured):
            raise ValueError(f"{self.paper_id}: an entry has an owner and claim, or says why it is not measured")
        if (self.owner is None) != (self.claim is None):
            raise ValueError(f"{self.paper_id}: owner and claim go together")


@dataclass(frozen=True)
class CrossCheck:
    """Another notebook's ``claim`` that measures a registered number again (recorded, not judged): it agrees with
    the owner's value within the relative ``agree``, or ``why`` says why the two differ."""

    notebook: str
    claim: str
    agree: float | None = None
    why: str = ""


def _rng(pair: tuple) -> str:
    return f"{pair[0]:g}-{pair[1]:g}"


def _entries() -> list[PaperNumber]:
    """The registry's entries, in the paper's order (§3, Figs. 2, 11-19, Table 1), each value read from the constants
    above: nothing is typed twice."""
    out: list[PaperNumber] = []
    add = out.append
    # §3: the KV cache of OPT-13B
    add(PaperNumber("s3.kv_per_token.opt13b", "§3", "KV cache per token, OPT-13B (KB)", KV_KB_PER_TOKEN["OPT-13B"],
                    "800 KB", "§3 (Memory challenges)", "00_tour", "kv_bytes_per_token.opt_13b"))
    add(PaperNumber("s3.kv_2048_tokens.opt13b", "§3", "KV cache of one 2048-token request, OPT-13B (GB)",
                    KV_GB_2048_TOKENS_OPT13B, "1.6 GB", "§3", "00_tour", "kv_bytes_2048_tokens.opt_13b"))
    # Fig. 2: shares of KV memory while memory-bound
    names = {**LABELS, "paged": "vLLM"}  # the systems' labels; the paper's system is vLLM, not "ours"
    parts = {"token_states": "token states", "reserved": "reserved", "internal": "internal fragmentation",
             "external": "external fragmentation and other"}
    for s, shares in FIG2_SHARES.items():
        for part, label in parts.items():
            v = shares.get(part)
            if v is None:
                continue
            pid = f"fig2.{'vllm' if s == 'paged' else s}.{part}"
            cross = ((CrossCheck("12_fig2_running_engines", "token_states_pct_running.paged",
                                  why="a tiny model run by the real engine on a CPU, at its own memory budget and "
                                      "trace, not OPT-13B on the paper's 15.7K slots"),)
                     if s == "paged" else ())
            add(PaperNumber(pid, "Fig. 2", f"{names[s]}: {label} (% of KV memory)", v, f"{v:g} %", "§3, Fig. 2",
                            "01_kv_memory_waste", f"{'token_states' if part == 'token_states' else part}_pct.{s}",
                            cross_checks=cross))
    # Fig. 11: the traces' mean lengths
    for w, means in TRACE_MEANS.items():
        for side, v in means.items():
            pid = f"fig11.{w}.{side}_mean"
            label = f"{'ShareGPT' if w == 'sharegpt' else 'Alpaca'}: mean {side} length (tokens)"
            if w == "sharegpt":
                add(PaperNumber(pid, "Fig. 11", label, v, f"{v:g}", "§6.1, Fig. 11", "08_workloads",
                                f"trace_mean.sharegpt.{side}"))
            else:
                add(PaperNumber(pid, "Fig. 11", label, v, f"{v:g}", "§6.1, Fig. 11",
                                not_measured="no Alpaca data set can be installed: the Alpaca trace is synthetic, "
                                             "drawn to these means by construction"))
    # Fig. 12: sustainable request rates on ShareGPT
    for model, mid in (("OPT-13B", "opt13b"), ("OPT-66B", "opt66b"), ("OPT-175B", "opt175b")):
        for other in ("orca_oracle", "orca_max"):
            rng = FIG12_RATE_RATIO[f"paged_vs_{other}"]
            if model == "OPT-13B":
                owner, claim = "03_throughput", f"rate_ratio.sharegpt.paged_vs_{other}"
                cross = (CrossCheck("10_table1_fig12", f"rate_ratio.OPT-13B.sharegpt.paged_vs_{other}", agree=0.02),)
            else:
                owner, claim, cross = "10_table1_fig12", f"rate_ratio.{model}.sharegpt.paged_vs_{other}", ()
            add(PaperNumber(f"fig12.{mid}.sharegpt.vs_{other}", "Fig. 12",
                            f"{model}, ShareGPT: sustainable rate, vLLM / {names[other]} (x)", rng, f"{_rng(rng)}x",
                            "§6.2 (the range over the three models)", owner, claim, cross_checks=cross))
    add(PaperNumber("fig12.sharegpt.vs_ft", "Fig. 12", "ShareGPT: sustainable rate, vLLM / FasterTransformer (x)",
                    FIG12_RATE_RATIO["paged_vs_ft"][1], "up to 22x", "§6.2",
                    not_measured="FasterTransformer is not run: the static-batching stand-in's ratios are recorded "
                                 "in notebooks 03 and 10, not judged against FasterTransformer's kernels and batching"))
    add(PaperNumber("abstract.throughput_gain", "Abstract", "throughput over FasterTransformer and Orca (x)",
                    HEADLINE_THROUGHPUT_GAIN, f"{_rng(HEADLINE_THROUGHPUT_GAIN)}x", "Abstract, §1",
                    not_measured="a summary of Figs. 12-14, whose rows judge its parts; FasterTransformer is not run"))
    # Fig. 13: mean batched requests at the paper's rates
    for w, row in FIG13_MEAN_BATCH.items():
        for s in ("orca_max", "orca_pow2", "orca_oracle", "paged"):
            v = row[s]
            old = f"mean_batch.{s}" if w == "sharegpt" else f"mean_batch_alpaca.{s}"
            add(PaperNumber(f"fig13.{w}.{'vllm' if s == 'paged' else s}", "Fig. 13",
                            f"{'ShareGPT' if w == 'sharegpt' else 'Alpaca'} at {row['rate']:g} req/s: mean batched "
                            f"requests, {names[s]}", v, f"{v:.2f}", "§6.2, Fig. 13", "03_throughput",
                            f"mean_batch.{w}.{s}",
                            cross_checks=(CrossCheck("01_kv_memory_waste", old, why=FIG13_CROSS_CHECK_WHY),)))
    # Fig. 14: throughput gain over Orca (Oracle), OPT-13B on Alpaca
    add(PaperNumber("fig14.alpaca.n1", "Fig. 14", "gain over Orca (Oracle), one sample per request (x)",
                    FIG14_GAIN["n1"], f"{FIG14_GAIN['n1']:g}x", "§6.3, Fig. 14", "11_fig14_curves",
                    "gain_at_fixed_latency.n1",
                    cross_checks=(CrossCheck("04_sharing", "gain_over_orca_oracle.n1", agree=0.02),)))
    add(PaperNumber("fig14.alpaca.beam_w6", "Fig. 14", "gain over Orca (Oracle), beam width 6 (x)",
                    FIG14_GAIN["beam_w6"], f"{FIG14_GAIN['beam_w6']:g}x", "§6.3, Fig. 14", "11_fig14_curves",
                    "gain_at_fixed_latency.beam_w6",
                    cross_checks=(CrossCheck("04_sharing", "gain_over_orca_oracle.beam_w6",
                                             why="the real engine on a CPU (opt-stdlib, offline requests/s), not the "
                                                 "simulated OPT-13B on an A100 at a fixed latency"),)))
    growth = FIG14_GAIN["beam_w6"] / FIG14_GAIN["n1"]
    add(PaperNumber("fig14.alpaca.beam_growth", "Fig. 14", "growth of the gain from n = 1 to beam width 6 (x)",
                    round(growth, 2), f"{FIG14_GAIN['n1']:g}x -> {FIG14_GAIN['beam_w6']:g}x", "§6.3, Fig. 14",
                    "11_fig14_curves", "gain_grows_with_width.beam"))
    add(PaperNumber("fig14.alpaca.parallel_growth", "Fig. 14", "the gain grows with the number of parallel samples",
                    "grows with n", "grows with n", "§6.3, Fig. 14a", "11_fig14_curves",
                    "gain_grows_with_n.parallel"))
    # Fig. 15: memory saved by sharing
    for method, label in (("parallel", "parallel sampling"), ("beam", "beam search")):
        key = "n" if method == "parallel" else "w"
        for k, v in FIG15_SAVING["alpaca"][method].items():
            add(PaperNumber(f"fig15.alpaca.{method}_{key}{k}", "Fig. 15",
                            f"Alpaca, {label}, {'n' if method == 'parallel' else 'width'} = {k}: memory saved (%)",
                            v, f"{v:g} %", "§6.3, Fig. 15", "04_sharing", f"saving_pct.alpaca.{method}_{key}{k}"))
        lo, hi = FIG15_SAVING["sharegpt"][method]
        for k, v in ((2, lo), (4, (lo, hi)), (6, hi)):
            printed = f"{v:g} % (the range's end)" if k != 4 else f"{lo:g}-{hi:g} % (within the range)"
            add(PaperNumber(f"fig15.sharegpt.{method}_{key}{k}", "Fig. 15",
                            f"ShareGPT, {label}, {'n' if method == 'parallel' else 'width'} = {k}: memory saved (%)",
                            v, printed, "§6.3 (the range over 2-6)", "04_sharing",
                            f"saving_pct.sharegpt.{method}_{key}{k}"))
    # Fig. 16: shared prefix
    for shot, row in FIG16_PREFIX.items():
        add(PaperNumber(f"fig16.{shot}", "Fig. 16",
                        f"{shot.replace('_', '-')} prefix ({row['prefix_len']} tokens): rate over Orca (Oracle) (x)",
                        row["speedup"], f"{row['speedup']:g}x", "§6.4, Fig. 16", "07_shared_prefix",
                        f"prefix_speedup.{shot}"))
    # Fig. 17: chatbot
    for other in ("orca_oracle", "orca_pow2", "orca_max"):
        add(PaperNumber(f"fig17.vs_{other}", "Fig. 17", f"chatbot: sustainable rate, vLLM / {names[other]} (x)",
                        FIG17_RATE_RATIO, f"{FIG17_RATE_RATIO:g}x", "§6.5, Fig. 17", "09_chatbot",
                        f"rate_ratio.chatbot.paged_vs_{other}"))
    add(PaperNumber("fig17.orca_alike", "Fig. 17", "chatbot: the three Orca variants perform alike (Max / Oracle)",
                    1.0, "alike", "§6.5", "09_chatbot", "rate_ratio.chatbot.orca_max_vs_orca_oracle"))
    # Fig. 18: the kernel and the block size
    add(PaperNumber("fig18a.paged_over_contiguous", "Fig. 18a", "attention kernel latency, paged / contiguous (x)",
                    FIG18A_PAGED_OVER_CONTIGUOUS, "20-26 % higher", "§7.1, Fig. 18a", "02_attention_kernel",
                    "paged_over_contiguous_latency.gpu"))
    for w, sizes in FIG18B_BEST_BLOCK_SIZES.items():
        add(PaperNumber(f"fig18b.{w}.best_block_sizes", "Fig. 18b",
                        f"{'ShareGPT' if w == 'sharegpt' else 'Alpaca'}: the best block sizes", sizes,
                        f"{sizes[0]}-{sizes[-1]}", "§7.2, Fig. 18b", "05_block_size", f"best_block_sizes.{w}"))
    # Fig. 19: recomputation against swapping
    add(PaperNumber("fig19.small_blocks", "Fig. 19", "recompute / swap latency at small blocks (block 1)",
                    FIG19_RECOMPUTE_OVER_SWAP_MAX, f"<= {FIG19_RECOMPUTE_OVER_SWAP_MAX:g}", "§7.3, Fig. 19a",
                    "06_preemption", "recompute_over_swap_latency.gpu.block1"))
    for bs in FIG19_COMPARABLE_BLOCK_SIZES:
        add(PaperNumber(f"fig19.comparable.block{bs}", "Fig. 19", f"recompute / swap latency at block {bs}",
                        "comparable", "comparable (16-64)", "§7.3, Fig. 19", "06_preemption",
                        f"recompute_over_swap_latency.gpu.block{bs}"))
    # Table 1: the setups
    for model in ("OPT-13B", "OPT-66B", "OPT-175B"):
        add(PaperNumber(f"table1.{model.lower().replace('-', '')}.param_gb", "Table 1",
                        f"{model}: parameter size (GB)", PARAM_GB[model], f"{PARAM_GB[model]} GB", "Table 1",
                        "10_table1_fig12", f"table1.param_gb.{model}"))
        add(PaperNumber(f"table1.{model.lower().replace('-', '')}.kv_gb", "Table 1",
                        f"{model}: memory for the KV cache (GB)", KV_GB[model], f"{KV_GB[model]} GB", "Table 1",
                        "10_table1_fig12", f"table1.kv_gb_at_utilisation.{model}"))
        add(PaperNumber(f"table1.{model.lower().replace('-', '')}.kv_slots", "Table 1",
                        f"{model}: KV token slots", KV_SLOTS[model], f"{KV_SLOTS[model] / 1000:g}K", "Table 1",
                        "10_table1_fig12", f"table1.slots_from_paper_kv.{model}"))
    return out


#: Why notebook 01's Fig. 13 mean batches (recorded beside its Fig. 2 run) differ from notebook 03's (the owner's).
FIG13_CROSS_CHECK_WHY = ("notebook 01 replays its Fig. 2 traces (another length of the same workloads) at the paper's "
                         "rates, 03 the traces of its Fig. 12 sweep")

#: Every number the paper states, by ``paper_id`` (issue 61): one entry each, one owner each.
REGISTRY: dict[str, PaperNumber] = {e.paper_id: e for e in _entries()}


def owned_claims(notebook: str) -> dict[str, str]:
    """``{claim name: paper_id}`` of the numbers that ``notebook`` judges."""
    return {e.claim: e.paper_id for e in REGISTRY.values() if e.owner == notebook and e.claim}


def cross_check_claims(notebook: str) -> dict[str, tuple[str, CrossCheck]]:
    """``{claim name: (paper_id, cross-check)}`` of the numbers that ``notebook`` records beside their owner."""
    return {x.claim: (e.paper_id, x) for e in REGISTRY.values() for x in e.cross_checks if x.notebook == notebook}
