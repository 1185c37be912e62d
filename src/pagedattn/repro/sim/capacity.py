"""A system's sustainable request rate (paper §6.2, Figs. 12, 14, 16, 17): the measure, its capacity rule and its
search.

The paper compares serving systems by the request rate each sustains: the highest Poisson arrival rate at which
normalized latency (§6.1: mean end-to-end latency over output length) stays low. On a *finite* trace that measure
alone overstates capacity: above capacity the queue grows only for as long as the trace lasts, so its latency stays
bounded and a rate the system cannot keep up with can still pass a latency threshold. So a rate counts here only if
it passes two rules, both fixed before any claim was recomputed with them:

- **latency**: normalized latency at or below the experiment's threshold (``NL_THRESHOLD_S`` for the paper-scale
  replays);
- **capacity**: over the run's steady window (from the arrival of the request at a fifth of the trace to the last
  arrival, ``steady_window``), the number of requests in the system (arrived, not finished) does not grow: its
  least-squares slope over the window is at most ``CAPACITY_MARGIN`` (2 %) of the window's arrival rate
  (``queue_growth``). Above capacity the slope is the arrival rate minus the service rate, so a rate more than 2 %
  above what the system can serve fails; below capacity the count is stationary and its slope near zero. A slope
  fitted over the whole window is used rather than completions counted between its two ends, whose difference from
  arrivals is dominated by the requests in flight at each end. The throughput at a rate (``Load.completion_rate``)
  is the same kind of slope, of the cumulative completions.
- **offline throughput**: no rate above the system's offline throughput (every request queued at t = 0, its steady
  service rate) counts. A system cannot serve more requests per second in the long run than it does saturated; the
  search's range ends there, and a system that keeps up at that rate is reported at it
  (``bound_by="offline throughput"``).

Two conditions make a replay able to judge these rules, both also fixed in advance:

- the nominal rate is the rate the steady window receives: ``workloads.poisson_arrivals`` scales its seeded Poisson
  sample so that the window's arrivals per second equal the rate exactly (a seeded sample of 1,000 arrivals has
  7 % more arrivals per second in its window than its nominal rate, one of 150 has 18 % fewer);
- the trace is long enough that its own mix of request lengths cannot fake a growth of the count: a finite sample
  whose later requests happen to be longer shows a rising count with no queue at all (by Little's law, the count
  follows the arrival rate times the latency of the requests just arrived). ``Load.trend_se`` estimates that noise
  directly: the standard deviation of the count's slope over ``TREND_PERMUTATIONS`` replays of the window with the
  requests' latencies shuffled among them (a seeded permutation; the arrivals kept), relative to the arrival rate.
  A search whose reported or failing probe has ``trend_se`` above half the margin says so (``RateSearch.judged``:
  the margin is then less than two standard errors of the noise), and its experiment must use a longer trace.

The search (``sustainable_rate``) bisects geometrically until the highest passing rate and the lowest failing rate
are within ``RESOLUTION`` (2 %) of each other, and reports that resolution, the rule that bound it, and the
completion rate measured at the reported rate, so that a reader can check that no reported rate exceeds what the
system served.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Callable, Sequence

import numpy as np
import pandas as pd

from pagedattn.repro.workloads.traces import RAMP_UP_FRACTION, steady_window

#: Normalized latency (s/token) above which a rate is not sustainable at paper scale. The paper's curves sit near
#: 0.03-0.05 s/token at low load and turn up sharply past capacity; 0.2 s/token is well past the knee and well below
#: the explosion.
NL_THRESHOLD_S = 0.2
#: The capacity rule's margin (module docstring), fixed in advance.
CAPACITY_MARGIN = 0.02
#: The search's resolution: the reported rate and the lowest rate found to fail differ by at most this fraction.
RESOLUTION = 0.02
#: Shuffles of the requests' latencies behind ``Load.trend_se`` (module docstring); a replay judges the capacity rule
#: only if that noise is at most ``MAX_TREND_SE`` of the arrival rate (half the margin).
TREND_PERMUTATIONS = 32
MAX_TREND_SE = CAPACITY_MARGIN / 2


def normalized_latency(requests: pd.DataFrame) -> float:
    """Normalized latency (§6.1): the mean over requests of end-to-end latency / output length, in s/token. A run
    that refused a request (a non-null ``error``: one that can never fit, which the scheduler fails at once) has
    none and raises: its refused rows finish when refused, with no tokens, and would count as served at once."""
    if "error" in requests and requests["error"].notna().any():
        refused = requests[requests["error"].notna()]
        first = f"request {refused['request_id'].iloc[0]!r}: " if "request_id" in refused else ""
        raise ValueError(f"{len(refused)} of {len(requests)} requests were refused, so the run has no normalized "
                         f"latency ({first}{refused['error'].iloc[0]})")
    return float(((requests["finish_time"] - requests["arrival_time"]) / requests["output_len"]).mean())




def _counts(arrival, finish, start: float, end: float, points: int = 256):
    """Times evenly spaced over ``[start, end)`` and, at each, the requests arrived and the requests finished."""
    t = np.linspace(start, end, points, endpoint=False)
    return t, np.searchsorted(np.sort(arrival), t, "right"), np.searchsorted(np.sort(finish), t, "right")


def _slope(t, y) -> float:
    return float(np.polyfit(t - t[0], y, 1)[0])


def _trend_se(arrival, finish, start: float, end: float, points: int = 256) -> float:
    """The standard deviation (requests/s) of the count's slope over ``[start, end)`` when the requests' latencies
    are shuffled among them (``TREND_PERMUTATIONS`` seeded permutations, arrivals kept): the slope the trace's mix of
    request lengths produces by chance, with no queue (module docstring). ``queue_growth`` of each shuffled run, with
    the arrivals counted once."""
    arrival = np.asarray(arrival, dtype=float)
    latency = np.asarray(finish, dtype=float) - arrival
    t = np.linspace(start, end, points, endpoint=False)
    arrived = np.searchsorted(np.sort(arrival), t, "right")
    rng = np.random.default_rng(0)
    return float(np.std([_slope(t, arrived - np.searchsorted(np.sort(arrival + rng.permutation(latency)), t, "right"))
                         for _ in range(TREND_PERMUTATIONS)]))


def queue_growth(arrival, finish, start: float, end: float, points: int = 256) -> float:
    """The least-squares slope (requests/s) of the number of requests in the system (arrived, not finished) over
    ``[start, end)``, sampled at ``points`` evenly spaced times. Over capacity it is the arrival rate minus the
    service rate; under capacity the count is stationary and the slope near zero. A slope over the whole window is
    far less noisy than the difference of its two ends."""
    t, arrived, finished = _counts(arrival, finish, start, end, points)
    return _slope(t, arrived - finished)


@dataclass(frozen=True)
class Load:
    """What a run served over its steady window: arrivals and completions per second, and normalized latency."""

    arrival_rate: float  # requests arriving in the window / its length
    completion_rate: float  # the least-squares slope of cumulative completions over the window (the throughput)
    normalized_latency_s: float
    queue_growth: float = 0.0  # requests/s: the slope of the number of requests in the system over the window
    in_system: float = 0.0  # the mean number of requests in the system over the window
    trend_se: float = 0.0  # the noise of ``queue_growth`` from the trace's length mix, relative to the arrival rate

    @classmethod
    def of(cls, requests: pd.DataFrame) -> "Load":
        """The load of a run's per-request frame (``arrival_time``, ``finish_time``, ``output_len``). An offline
        run (no arrival period) has arrival rate inf, and as completion rate its steady service rate: completions
        per second between the completions at a fifth and at four fifths of the run, while the queue still holds
        requests (the ramp-up and the drain of the last batch, which a finite run's whole-run throughput counts,
        are left out)."""
        arrival = requests["arrival_time"].to_numpy(dtype=float)
        finish = requests["finish_time"].to_numpy(dtype=float)
        start, end = steady_window(arrival)
        nl = normalized_latency(requests)
        if math.isinf(end):
            f = np.sort(finish)
            i0, i1 = int(RAMP_UP_FRACTION * len(f)), int((1 - RAMP_UP_FRACTION) * len(f))
            return cls(math.inf, (i1 - i0) / float(f[i1] - f[i0]) if f[i1] > f[i0] else math.inf, nl)
        rate = int(((arrival >= start) & (arrival < end)).sum()) / (end - start)
        t, cum_arrived, cum_finished = _counts(arrival, finish, start, end)
        return cls(rate, _slope(t, cum_finished), nl, _slope(t, cum_arrived - cum_finished),
                   float((cum_arrived - cum_finished).mean()), _trend_se(arrival, finish, start, end) / rate)

    @property
    def judged(self) -> bool:
        """Whether the run is long enough to judge the capacity rule (``trend_se`` at most ``MAX_TREND_SE``)."""
        return self.trend_se <= MAX_TREND_SE

    def keeps_up(self, margin: float = CAPACITY_MARGIN) -> bool:
        """The capacity rule: the number of requests in the system does not grow over the steady window by more
        than ``margin`` of the arrival rate (completions keep up with arrivals). An offline run (no arrival period)
        has nothing to keep up with: it passes."""
        return math.isinf(self.arrival_rate) or self.queue_growth <= margin * self.arrival_rate

    def verdict(self, threshold_s: float, margin: float = CAPACITY_MARGIN) -> str:
        """``"ok"``, or the rule(s) that fail: ``"latency"``, ``"capacity"`` or ``"latency+capacity"``."""
        failed = [name for name, ok in (("latency", self.normalized_latency_s <= threshold_s),
                                        ("capacity", self.keeps_up(margin))) if not ok]
        return "+".join(failed) or "ok"


@dataclass(frozen=True)
class RateSearch:
    """The outcome of ``sustainable_rate``: ``rate`` passes both rules; ``failed_at`` (the lowest rate found to fail,
    ``inf`` if none did) is within ``resolution`` of it; ``bound_by`` names the rule that failed there (or
    ``"upper bound"`` / ``"lower bound"`` when the search hit an end of its range, ``"offline throughput"`` when the
    system keeps up at its offline throughput, the highest rate that counts); ``completion_rate`` is the throughput
    measured at ``rate`` (requests/s over the steady window); ``trend_se`` is the larger ``Load.trend_se`` of the
    probes at ``rate`` and at ``failed_at``."""

    rate: float
    failed_at: float
    resolution: float
    bound_by: str
    completion_rate: float
    normalized_latency_s: float
    probes: int
    offline_rate: float = math.nan  # requests/s with every request queued at t = 0 (``offline=True``), else NaN
    trend_se: float = 0.0
    # the trace-length rule (``length_agreed_search``; left at these defaults by a search that did not apply it):
    search_requests: int = 0  # the trace length the rate was judged at
    rate_at_half_length: float = math.nan  # the rate on half as many requests
    length_agreed: bool | None = None  # whether the two agreed within their resolution (``lengths_agree``)
    length_reason: str = ""  # why not, where they never did
    # the knee measure (``knee_rate``; NaN where the search did not take it)
    knee_rate: float = math.nan  # the highest rate whose normalized latency stays within KNEE_FACTOR x the unloaded
    knee_threshold_s: float = math.nan  # that threshold: KNEE_FACTOR x the normalized latency at the range's low end
    knee_bound: str = ""  # what stopped the knee's search (``bound``)

    @property
    def judged(self) -> bool:
        """Whether the replays around the answer were long enough to judge the capacity rule (module docstring)."""
        return self.trend_se <= MAX_TREND_SE

    def row(self) -> dict:
        """Columns for a results table: ``sustainable_rate``, ``resolution``, ``bound_by``, ``throughput_at_rate``,
        ``nl_at_rate_s``, ``failed_at``, ``probes``, ``offline_rate``, ``trend_se``, ``judged``,
        ``bound`` (``bound``: what stopped the search), the trace-length rule's ``search_requests``,
        ``rate_at_half_length``, ``length_agreed``, ``length_reason``, ``at_bound``, ``at_upper_bound``, and the
        knee measure's ``knee_rate``, ``knee_threshold_s`` and ``knee_bound`` where the search took it."""
        d = asdict(self)
        if math.isnan(self.knee_rate):
            for k in ("knee_rate", "knee_threshold_s", "knee_bound"):
                del d[k]
        return {"sustainable_rate": d.pop("rate"), "resolution": d.pop("resolution"), "bound_by": d.pop("bound_by"),
                "throughput_at_rate": d.pop("completion_rate"), "nl_at_rate_s": d.pop("normalized_latency_s"),
                **d, "judged": self.judged, "bound": bound(self.bound_by), "at_bound": self.bound_by in ("upper bound", "lower bound"),
                "at_upper_bound": self.bound_by == "upper bound"}


def sustainable_rate(replay: Callable[[float], pd.DataFrame], lo: float, hi: float,
                     threshold_s: float = NL_THRESHOLD_S, resolution: float = RESOLUTION,
                     margin: float = CAPACITY_MARGIN, max_extensions: int = 3, offline: bool = True,
                     bracket: tuple[float, float] | None = None) -> RateSearch:
    """The highest rate in ``[lo, hi]`` that passes the latency and capacity rules (module docstring), by geometric
    bisection down to ``resolution``. ``replay(rate)`` returns the run's per-request frame. If ``lo`` fails, the
    range is extended down by 4x at a time, up to ``max_extensions`` times; if ``hi`` passes, it is reported with
    ``bound_by="upper bound"`` (a lower bound on the sustainable rate, with no resolution).

    ``offline``: first replay with every request at t = 0 (``replay(inf)``): its throughput is the offline rule's
    limit (module docstring), so the range ends there, and a system that passes at it is reported at it with
    ``bound_by="offline throughput"`` (and resolution 0: no higher rate counts). The search starts from the bracket
    ``[offline / 2, offline]`` inside ``[lo, hi]`` (a rate the system cannot serve fails the capacity rule, so the
    answer is rarely far from it), moving it down by 4x while its lower end fails. Only the probes differ from a search
    over the whole range: the rules and the resolution are the same.

    ``bracket``: another first bracket (``length_agreed_search`` passes a shorter trace's ``rate`` and
    ``failed_at``), clipped to the range (ignored where nothing of it is left); it moves by its own width, doubled at
    each move, while its lower end fails or its upper end passes. Again only the probes differ."""
    probes: dict[float, Load] = {}
    if not offline:
        return _search(probes, replay, lo, hi, threshold_s, resolution, margin, max_extensions)
    cap = Load.of(replay(math.inf)).completion_rate
    if not math.isfinite(cap):
        found = _search(probes, replay, lo, hi, threshold_s, resolution, margin, max_extensions)
    else:
        hi = min(hi, cap)
        a, b, step = max(lo, cap / 2), hi, 4.0
        if bracket is not None and max(lo, bracket[0]) < min(hi, bracket[1]):
            a, b, step = max(lo, bracket[0]), min(hi, bracket[1]), None
        found = _search(probes, replay, a, b, threshold_s, resolution, margin, max_extensions, outer=(lo, hi),
                        step=step) \
            if a < b else _search(probes, replay, lo, hi, threshold_s, resolution, margin, max_extensions)
        if found.bound_by == "upper bound" and found.rate == cap:
            found = replace(found, bound_by="offline throughput", resolution=0.0)
    return replace(found, offline_rate=cap, probes=found.probes + 1)


def _search(probes: dict, replay, lo: float, hi: float, threshold_s: float, resolution: float, margin: float,
            max_extensions: int, outer: tuple[float, float] | None = None, step: float | None = 4.0) -> RateSearch:
    """``sustainable_rate``'s bisection, remembering each probe's load in ``probes``. With ``outer``, ``[lo, hi]``
    is a first bracket inside the range ``outer``: it moves down while ``lo`` fails and up while ``hi`` passes (by a
    factor ``step`` at a time; ``None``: by the bracket's own width, doubled at each move; never past ``outer``)
    before the range's own rules apply at its ends."""

    def load(rate: float) -> Load:
        if rate not in probes:
            probes[rate] = Load.of(replay(rate))
        return probes[rate]

    def ok(rate: float) -> bool:
        return load(rate).verdict(threshold_s, margin) == "ok"

    if outer is not None:
        o_lo, o_hi = outer
        grow = hi / lo if step is None else step
        while lo > o_lo and not ok(lo):
            lo, hi = max(o_lo, lo / grow), lo
            grow = grow * grow if step is None else step
        while hi < o_hi and ok(hi):
            lo, hi = hi, min(o_hi, hi * grow)
            grow = grow * grow if step is None else step
    extensions = 0
    while not ok(lo):
        if extensions == max_extensions:
            ld = load(lo)
            return RateSearch(0.0, lo, math.inf, "lower bound", ld.completion_rate, ld.normalized_latency_s,
                              len(probes), trend_se=ld.trend_se)
        lo, hi, extensions = lo / 4, lo, extensions + 1
    if ok(hi):
        ld = load(hi)
        return RateSearch(hi, math.inf, math.inf, "upper bound", ld.completion_rate, ld.normalized_latency_s,
                          len(probes), trend_se=ld.trend_se)
    while hi / lo > 1 + resolution:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    ld, failed = load(lo), load(hi)
    return RateSearch(lo, hi, hi / lo - 1, failed.verdict(threshold_s, margin), ld.completion_rate,
                      ld.normalized_latency_s, len(probes),
                      trend_se=max(ld.trend_se, failed.trend_se))


def ratio_resolution(a: RateSearch | dict, b: RateSearch | dict) -> float:
    """The resolution of the ratio ``a / b`` of two searched rates: each true rate lies in ``[rate, rate x (1 +
    resolution))``, so the true ratio lies within a factor ``(1 + res_a) x (1 + res_b)`` band around it; this returns
    that factor minus one."""
    def res(x):
        return x.resolution if isinstance(x, RateSearch) else float(x["resolution"])
    return (1 + res(a)) * (1 + res(b)) - 1


def describe_ratio(a: dict | pd.Series, b: dict | pd.Series, offline_ratio: float | None = None) -> str:
    """A note for the ratio of two sustainable rates ``a / b`` (two rows of ``RateSearch.row()`` columns): its
    resolution, the rule that bound each search, and, when given, the ratio of the two systems' offline
    throughputs (every request queued at t = 0), the capacity measure the rate ratio is checked against."""
    def bound(x):
        return f"{x['bound_by']} at {float(x['failed_at']):.3g}" if math.isfinite(float(x["failed_at"])) \
            else str(x["bound_by"])
    res = ratio_resolution(a, b)
    note = (f"ratio resolution {100 * res:.1f} %" if math.isfinite(res) else "ratio unresolved (a search hit its "
            "range's end)") + f"; failing rule: {bound(a)} / {bound(b)} req/s"
    if offline_ratio is None and "offline_rate" in a and "offline_rate" in b:
        offline_ratio = float(a["offline_rate"]) / float(b["offline_rate"])
    if offline_ratio is not None and math.isfinite(offline_ratio):
        note += f"; offline throughput ratio {offline_ratio:.2f}"
    if "bound" in a and "bound" in b:
        note += f"; bound: {a['bound']} / {b['bound']}"
    if "knee_rate" in a and "knee_rate" in b:
        note += knee_note(float(a["knee_rate"]), float(b["knee_rate"]))
    if _length_rule_applied(a) and _length_rule_applied(b):
        note += "; n vs 2n: " + " / ".join(
            f"{float(x['rate_at_half_length']):.3g} vs {float(x['sustainable_rate']):.3g} at {int(x['search_requests'])}"
            for x in (a, b)) + "".join(f"; NOT JUDGED: {x['length_reason']}" for x in (a, b)
                                       if not length_judged(x))
    return note + not_judged([(f"{float(x['sustainable_rate']):.3g} req/s", float(x["trend_se"]))
                              for x in (a, b) if "judged" in x and not bool(x["judged"])])


def knee_note(a: float, b: float) -> str:
    """A ratio note's knee part: the ratio of two knee rates (``knee_rate``) and both rates; empty where either is
    missing."""
    if not (b > 0 and math.isfinite(a)):
        return ""
    return f"; knee ({KNEE_FACTOR:g}x unloaded NL) ratio {a / b:.2f} ({a:.3g} / {b:.3g} req/s)"


def _length_rule_applied(x) -> bool:
    """Whether a row comes from a search under the trace-length rule (its ``length_agreed`` is a bool, not None/NaN)."""
    return isinstance(x.get("length_agreed"), (bool, np.bool_))


def length_judged(*rows) -> bool:
    """Whether every search behind a claim passed the trace-length rule (``length_agreed_rate``); a row from a search
    that did not apply the rule counts as passed (its own ``judged`` note stands). A claim is judged (``holds`` not
    None) only where this is true."""
    return all(not (x.get("length_agreed") is False or x.get("length_agreed") == False)  # noqa: E712 (numpy bools)
               for x in rows)


def not_judged(short: list[tuple[str, float]]) -> str:
    """The note's warning for searches whose trace was too short to judge the capacity rule (``RateSearch.judged``):
    ``short`` lists ``(where, trend_se)`` for each; empty when there are none."""
    if not short:
        return ""
    return ("; NOT JUDGED: the trace is too short to judge the capacity rule at "
            + " and ".join(f"{where} (length-mix noise {100 * se:.1f} % of the rate)" for where, se in short))


#: The trace-length rule (issue 50, item 2), fixed before any claim was judged with it: a rate is judged only where
#: the search on ``n`` requests and the search on ``2n`` agree within their resolution; otherwise the trace doubles,
#: at most ``MAX_LENGTH_DOUBLINGS`` times (n, 2n, 4n, 8n, 16n: the cap is 16n), and a rate that never agrees is not
#: judged (``length_agreed`` False, with the reason).
MAX_LENGTH_DOUBLINGS = 4
#: The paper's own reading of a rate (§6.2, Fig. 12: "the normalized latency ... at first increases gradually, then
#: explodes"): the knee, the highest rate whose normalized latency stays at most ``KNEE_FACTOR`` x the unloaded one
#: (normalized latency at the search range's lowest rate). Fixed at 3 before any result was read with it: notebook
#: 07's reading of the curves' flat region is about 3x.
KNEE_FACTOR = 3.0


def bound(bound_by: str) -> str:
    """What stopped a search (issue 50, item 3): ``"latency"`` where the latency threshold failed first above the
    rate (alone or with the capacity rule), ``"capacity"`` where the capacity rule or the offline throughput did,
    ``"range"`` where the search hit an end of its range."""
    if "latency" in bound_by:
        return "latency"
    return "capacity" if bound_by in ("capacity", "offline throughput") else "range"


def _agreement_resolution(x: dict) -> float:
    """A search's resolution for the n-vs-2n check: its own, but never below ``RESOLUTION``: a rate bound by the
    offline throughput has resolution 0 (no higher rate counts), yet a finite trace's offline throughput is itself a
    sample, whose noise the check between n and 2n requests is there to measure."""
    return max(float(x["resolution"]), RESOLUTION)


def lengths_agree(short: dict, long: dict) -> bool:
    """The n-vs-2n check: two searches' rates (``RateSearch.row()``) agree where they differ by at most the
    resolution of their ratio (``ratio_resolution``, each side's resolution at least ``RESOLUTION``). A search that
    hit its range's end agrees with nothing."""
    if "range" in (bound(str(short["bound_by"])), bound(str(long["bound_by"]))):
        return False
    a, b = float(short["sustainable_rate"]), float(long["sustainable_rate"])
    if a <= 0 or b <= 0:
        return False
    res = (1 + _agreement_resolution(short)) * (1 + _agreement_resolution(long)) - 1
    return max(a, b) / min(a, b) - 1 <= res


def knee_rate(replay: Callable[[float], pd.DataFrame], lo: float, hi: float, found: dict,
              resolution: float = RESOLUTION, factor: float = KNEE_FACTOR) -> dict:
    """The knee measure (``KNEE_FACTOR``): the unloaded normalized latency is the run's at ``lo``; the knee is the
    sustainable rate with the threshold ``factor`` x that, searched from ``found``'s bracket (the fixed threshold's
    search on the same trace). Columns ``knee_rate``, ``knee_threshold_s``, ``knee_bound``."""
    unloaded = Load.of(replay(lo)).normalized_latency_s
    start = (float(found["sustainable_rate"]), float(found["failed_at"]))
    bracket = start if start[0] > 0 and math.isfinite(start[1]) else None
    knee = sustainable_rate(replay, lo, hi, factor * unloaded, resolution, bracket=bracket)
    return {"knee_rate": knee.rate, "knee_threshold_s": factor * unloaded, "knee_bound": bound(knee.bound_by)}


def length_agreed_search(replay: Callable[[float, int], pd.DataFrame], n: int, lo: float, hi: float,
                         threshold_s: float = NL_THRESHOLD_S, resolution: float = RESOLUTION,
                         max_doublings: int = MAX_LENGTH_DOUBLINGS, bracket: tuple[float, float] | None = None,
                         knee: bool = False, **kw) -> RateSearch:
    """The one trace-length rule of every notebook's searches (issue 50, item 2; constants above): the sustainable
    rate (``sustainable_rate``) on ``n`` requests and on ``2n``, the longer search starting from the shorter one's
    bracket (so it takes few probes); while the two disagree (``lengths_agree``) or the longer is unjudged
    (``RateSearch.judged``), the trace doubles again, up to ``max_doublings`` doublings. ``replay(rate, n)`` runs
    an ``n``-request trace at ``rate``. Returns the longest search, with ``search_requests`` (the trace length
    judged at), ``rate_at_half_length`` (the rate on half as many requests), ``length_agreed`` and, where it is
    False, ``length_reason``; with ``max_doublings=0`` (one length, the rule not applied: notebook 13's tracking
    searches, issue 64) ``length_agreed`` is None, as for a search that never took the rule; ``probes`` counts
    every search's probes. ``knee``: the knee measure too
    (``knee_rate``), on the trace length the rule ended on (its probes are not counted in ``probes``). A replay is
    deterministic, so the knee's search reuses the last search's replays at the rates both probe (the offline run,
    the rate and the rate that failed: issue 64) instead of running them again."""
    rows: list[dict] = []
    length, doublings, probes = n, 0, 0
    seen: dict[float, pd.DataFrame] = {}  # this length's replays by rate: the knee search repeats three of them

    def once(rate: float) -> pd.DataFrame:
        if rate not in seen:
            seen[rate] = replay(rate, length)
        return seen[rate]

    while True:
        seen.clear()
        found = sustainable_rate(once, lo, hi, threshold_s, resolution, bracket=bracket, **kw)
        probes += found.probes
        rows.append(found.row())
        if found.rate > 0 and math.isfinite(found.failed_at):
            bracket = (found.rate, found.failed_at)
        half = rows[-2]["sustainable_rate"] if len(rows) >= 2 else math.nan
        agreed = len(rows) >= 2 and lengths_agree(rows[-2], rows[-1]) and found.judged
        if agreed or doublings == max_doublings:
            applied = max_doublings > 0  # one length: the rule not applied, no verdict
            reason = ""
            if not agreed and applied:
                before = f"{rows[-2]['bound']}-bound, " if len(rows) >= 2 else ""
                reason = (f"the rates on {length // 2} and {length} requests ({half:.3g} and {found.rate:.3g} req/s, "
                          f"{before}{bound(found.bound_by)}-bound) never agreed within their resolution up to "
                          f"{length} requests" + ("" if found.judged else " (and the longest is unjudged)"))
            found = replace(found, probes=probes, search_requests=length, rate_at_half_length=half,
                            length_agreed=agreed if applied else None, length_reason=reason)
            if knee:
                found = replace(found, **knee_rate(once, lo, hi, found.row(), resolution))
            return found
        length, doublings = 2 * length, doublings + 1


def length_agreed_rate(replay: Callable[[float, int], pd.DataFrame], n: int, lo: float, hi: float,
                       threshold_s: float = NL_THRESHOLD_S, resolution: float = RESOLUTION, knee: bool = True,
                       **kw) -> dict:
    """``length_agreed_search``'s ``RateSearch.row()``, by default with the knee measure (``knee_rate``)."""
    return length_agreed_search(replay, n, lo, hi, threshold_s, resolution, knee=knee, **kw).row()
