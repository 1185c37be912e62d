"""Requests as the scheduler sees them: ``Sequence``, ``SequenceGroup`` (the n samples or beams of one request,
paper §4.4), ``SamplingParams`` and the ``RequestOutput`` returned to users. Names follow vLLM's API.

No torch here: the simulated executor (``sim.py``) uses the same classes as the real engine.
"""
from __future__ import annotations

import logging
import math
import operator
from dataclasses import dataclass, field
from numbers import Real
from typing import Literal, cast


Status = Literal["waiting", "running", "swapped", "finished"]
FinishReason = Literal["stop", "length", "abort", "error"]


def as_int(value) -> int | None:
    """``value`` as an ``int`` when it is an integer scalar (Python, NumPy, or a 0-d torch integer tensor), else None
    (bools, floats such as 1.5, strings, sequences)."""
    if type(value) is int:  # the common case first (a simulated replay builds thousands of requests' parameters)
        return value
    if isinstance(value, bool) or getattr(value, "ndim", 0) != 0 or "bool" in str(getattr(value, "dtype", "")):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _integer(name: str, value, minimum: int) -> int:
    """``value`` as an ``int``, at least ``minimum``, or a ValueError naming the parameter."""
    v = as_int(value)
    if v is None or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return v


def _finite(name: str, value) -> float:
    """``value`` as a finite ``float``: NaN, infinity, bools and non-numbers are refused."""
    if (type(value) is float or type(value) is int) and math.isfinite(value):  # before the slower ABC check
        return float(value)
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def as_token_ids(prompt) -> list[int]:
    """A prompt of token ids as a list of ints: any sequence (list, tuple, 1-d array or tensor) of integer
    scalars. Anything else (None, a bare int, nested lists, floats, bools, a string) is a ValueError."""
    if isinstance(prompt, (str, bytes, dict, set)) or not hasattr(prompt, "__len__") \
            or getattr(prompt, "ndim", 1) != 1:
        raise ValueError(f"a prompt must be a string or a sequence of integer token ids, got "
                         f"{type(prompt).__name__}")
    ids = [as_int(t) for t in prompt]
    if None in ids:
        bad = next(t for t, i in zip(prompt, ids) if i is None)
        raise ValueError(f"a prompt must be a string or a sequence of integer token ids; {bad!r} "
                         f"({type(bad).__name__}) is not an integer")
    return cast(list[int], ids)  # no None left


#: the most top log-probabilities a request may ask for per token (vLLM's default ``max_logprobs``)
MAX_LOGPROBS = 20
#: the smallest positive temperature (vLLM's ``_MAX_TEMP``): a smaller one is raised to it, with a warning, since
#: logits divided by 1e-40 overflow to infinity and sampling returns token 0 every time
MIN_TEMPERATURE = 1e-2

log = logging.getLogger(__name__)


def _in_range(name: str, value, low: float, high: float, low_open: bool = False) -> float:
    """``value`` as a finite float in ``[low, high]`` (``(low, high]`` when ``low_open``), or a ValueError."""
    v = _finite(name, value)
    if v < low or v > high or (low_open and v == low):
        raise ValueError(f"{name} must be in {'(' if low_open else '['}{low}, {high}], got {value!r}")
    return v


@dataclass
class SamplingParams:
    """How to decode one request (vLLM's names). ``temperature=0`` is greedy; ``top_k=-1`` (or 0) and ``top_p=1``
    disable those filters; ``seed`` makes sampling reproducible per request. ``n`` samples share the prompt's blocks
    (§4.4).

    vLLM's extras, with its meanings: ``min_p`` drops tokens less likely than ``min_p`` times the most likely one;
    ``presence_penalty`` / ``frequency_penalty`` subtract from a token's logit once / per occurrence in the output
    (OpenAI's definition); ``repetition_penalty`` divides a positive (multiplies a negative) logit of every token in
    the prompt or output (CTRL's, as Hugging Face's); ``min_tokens`` forbids the EOS and stop tokens, and ignores stop
    strings, until that many tokens are out; ``stop`` strings end a sequence whose text contains one, the text cut
    before it (or after it, ``include_stop_str_in_output``); ``logprobs`` asks for the top-k log-probabilities of
    each generated token (under the model's raw distribution, as vLLM V1), beside the chosen token's.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    use_beam_search: bool = False
    beam_width: int | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    min_tokens: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        """Reject a bad value with a ``ValueError`` naming the parameter (NaN and infinity included: a NaN
        temperature would otherwise sample token 0 forever)."""
        self.n = _integer("n", self.n, 1)
        self.max_tokens = _integer("max_tokens", self.max_tokens, 1)
        if self.best_of is not None:
            self.best_of = _integer("best_of", self.best_of, self.n)
        self.temperature = _finite("temperature", self.temperature)
        self.top_p = _finite("top_p", self.top_p)
        self.length_penalty = _finite("length_penalty", self.length_penalty)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:  # vLLM's SamplingParams raises it too
            log.warning("temperature %s is less than %s, which would overflow the logits; raised to %s",
                        self.temperature, MIN_TEMPERATURE, MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _integer("top_k", self.top_k, -1)
        if self.top_k == 0:  # vLLM and Hugging Face read 0 as "off" too
            self.top_k = -1
        if self.seed is not None:
            self.seed = _integer("seed", self.seed, 0)
            if self.seed >= 2 ** 64:
                raise ValueError(f"seed must be below 2**64 (a torch generator's seed), got {self.seed}")
        self.min_tokens = _integer("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}")
        self.min_p = _in_range("min_p", self.min_p, 0.0, 1.0)
        self.presence_penalty = _in_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        self.frequency_penalty = _in_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        self.repetition_penalty = _in_range("repetition_penalty", self.repetition_penalty, 0.0, math.inf, low_open=True)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(t, str) and t for t in self.stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be True or False, got "
                             f"{self.include_stop_str_in_output!r}")
        # the sampler's hot path asks this of every row: a plain attribute, set once
        self.processes_logits = self.has_penalties or self.min_tokens > 0
        if self.logprobs is not None:
            self.logprobs = _integer("logprobs", self.logprobs, 0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs must be at most {MAX_LOGPROBS}, got {self.logprobs}")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = [_integer("stop_token_ids", t, 0) for t in self.stop_token_ids]
        for name in ("ignore_eos", "use_beam_search"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.early_stopping not in (True, False, "never") or not isinstance(self.early_stopping, (bool, str)):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.beam_width is not None:
            self.beam_width = _integer("beam_width", self.beam_width, 1)
        if self.use_beam_search:
            width = self.beam_width if self.beam_width is not None else self.best_of or self.n
            if width < 2:
                raise ValueError(f"beam search needs beam_width >= 2, got {width}")
            if self.temperature > 0:
                raise ValueError(f"beam search is deterministic: temperature must be 0, got {self.temperature}")
            if self.top_p < 1 or self.top_k != -1:
                raise ValueError("beam search does not take top_p < 1 or top_k filters")
            if self.n > width:
                raise ValueError(f"beam search returns at most beam_width={width} beams, got n={self.n}")
            if self.min_p > 0 or self.stop or self.logprobs is not None or self.min_tokens or self.has_penalties:
                raise ValueError("beam search does not take min_p, stop, logprobs, min_tokens or penalties")
            self.beam_width = width

    @property
    def num_seqs(self) -> int:
        """Sequences the group starts with (samples, or beams)."""
        if self.use_beam_search:
            return cast(int, self.beam_width)  # set by __post_init__ for beam search
        return self.best_of or self.n

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


class Sequence:
    """One token sequence (prompt + generated tokens) and where it is in its life. The tokens live in one list,
    ``token_ids`` (the prompt, then the output), which grows by one per step and is never rebuilt."""

    def __init__(self, seq_id: int, prompt_token_ids: list[int]) -> None:
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.status: Status = "waiting"
        self.finish_reason: FinishReason | None = None
        self.cumulative_logprob = 0.0
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache (the scheduler keeps it)
        # per output token, {token id: log-probability} of the chosen and top tokens (``SamplingParams.logprobs``)
        self.output_logprobs: list[dict[int, float]] = []
        self.stop_text_len: int | None = None  # a stop string ended it: the characters of its text to keep
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended it

    def get_len(self) -> int:
        return len(self.token_ids)

    def get_prompt_len(self) -> int:
        return self.num_prompt_tokens

    def get_output_len(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        """A copy of the prompt's tokens."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """A copy of the generated tokens."""
        return self.token_ids[self.num_prompt_tokens:]

    @output_token_ids.setter
    def output_token_ids(self, ids: list[int]) -> None:
        """Replace the generated tokens (a beam taking over another beam's history, §4.4)."""
        self.token_ids[self.num_prompt_tokens:] = ids

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    def append_token(self, token_id: int, logprob: float = 0.0) -> None:
        self.token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def extend(self, token_id: int, count: int) -> None:
        """Append ``count`` copies of one token with log-probability 0 (the simulator's dummy tokens of ``count``
        decode steps at once, ``Scheduler.advance``)."""
        self.token_ids += [token_id] * count

    def is_finished(self) -> bool:
        return self.status == "finished"

    def finish(self, reason: FinishReason) -> None:
        self.status = "finished"
        self.finish_reason = reason

    def __repr__(self) -> str:
        return f"Sequence(id={self.seq_id}, len={self.get_len()}, status={self.status})"


@dataclass
class RequestMetrics:
    """Per-request timing (seconds on the engine's clock)."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    first_scheduled_time: float | None = None  # the start of its first prefill step (vLLM's scheduled_ts)
    # its samples were split and recomputed one by one (``Scheduler._split_samples``): their seeded draws then differ
    # from a run in which they stayed together (one generator serves the request's samples in turn)
    samples_split: bool = False

    @property
    def latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


class SequenceGroup:
    """The sequences of one request: one, or n samples / beams sharing the prompt (§4.4)."""

    def __init__(self, request_id: str, seqs: list[Sequence], sampling_params: SamplingParams,
                 arrival_time: float = 0.0, prompt: str | None = None) -> None:
        self.request_id = request_id
        self.seqs = seqs
        self._solo = seqs[0] if len(seqs) == 1 else None  # the only sequence of a one-sequence group
        self.sampling_params = sampling_params
        self.metrics = RequestMetrics(arrival_time)
        self.prompt = prompt
        self.error: str | None = None
        self.prefix_len = 0  # tokens of the prompt marked as a shared prefix (paper §4.4, Fig. 16)
        # a beam search's state (``beam_search.BeamSearchState``, read through ``beam_search._state``), for beam
        # requests only; typed loosely: beam search imports this module (and torch), not the other way
        self.beam_state: object | None = None
        self.prompt_token_ids: list[int] = seqs[0].prompt_token_ids  # copied once, for the request's outputs
        # the request a sample was split off from (``Scheduler._split_samples``), which its outputs report
        self.parent: SequenceGroup | None = None

    @property
    def root(self) -> SequenceGroup:
        """The request's own group: ``parent`` for a sample split off from it, else this group."""
        return self.parent or self

    @property
    def max_total_len(self) -> int:
        """Prompt + the most tokens the request may generate (what a contiguous reservation must cover)."""
        return self.seqs[0].get_prompt_len() + self.sampling_params.max_tokens

    def get_seqs(self, status: Status | None = None) -> list[Sequence]:
        """The group's sequences, or those in ``status``: a list to read, not to change (it is ``seqs`` itself when
        every sequence is in ``status``, as a running group's usually are, and for a one-sequence group, most
        requests, ``seqs`` or empty: the scheduler asks this of every running group several times per step)."""
        if status is None:
            return self.seqs
        if self._solo is not None:
            return self.seqs if self._solo.status == status else []
        for s in self.seqs:
            if s.status != status:
                return [s for s in self.seqs if s.status == status]
        return self.seqs

    def is_finished(self) -> bool:
        for s in self.seqs:
            if s.status != "finished":
                return False
        return True

    def set_status(self, old: Status, new: Status) -> None:
        for s in self.get_seqs(old):
            s.status = new

    def __repr__(self) -> str:
        return f"SequenceGroup({self.request_id!r}, n={len(self.seqs)})"


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: FinishReason | None
    logprobs: list[dict[int, float]] | None = None  # per token: the chosen and top-k tokens' log-probabilities
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it (vLLM's field)


@dataclass
class RequestOutput:
    """What ``LLM.generate`` / ``LLMEngine.step`` return for a request (vLLM's name)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None

    @property
    def normalized_latency(self) -> float | None:
        """End-to-end latency / output length (s/token), the paper's metric (§6.1)."""
        n = max((len(o.token_ids) for o in self.outputs), default=0)
        lat = self.metrics.latency
        return None if lat is None or n == 0 else lat / n
