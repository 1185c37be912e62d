"""The paper's published numbers, in one place (Kwon et al., SOSP 2023, arXiv:2309.06180).

Notebooks, experiments and ``results/SUMMARY.md`` import these values; none of them retypes a paper number.
"""
from __future__ import annotations

import math

from pagedattn.config import ModelSpec

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
