"""The guided tour's recording: a trace of real engine steps as copies of the block manager's state (paper §4.2-§4.4).

``record_trace`` runs an ``LLMEngine`` step by step and, before the first step and after every ``engine.step()``,
snapshots what the block manager holds: each live sequence's block table and token count, the pool's reference
counts, pinned (user-marked prefix) and cached blocks, and the step's copy-on-write count. Nothing is recomputed or
hard-coded: a ``Frame`` is a copy of ``engine.kv``'s state. ``save_trace`` / ``load_trace`` keep the frames as JSON,
so that what a view shows can be checked against what was recorded. Drawing the frames is ``pagedattn.repro.experiments.tour``'s job;
this module imports no plotting library.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class SeqView:
    """One live sequence at one moment: whose it is, its block table and how many tokens it holds."""

    request_id: str
    sample: int  # index of the sequence within its request (parallel sampling)
    seq_id: int
    blocks: list[int]
    num_tokens: int

    @property
    def label(self) -> str:
        """``request·s<sample>``, as the view and the GIF name a sequence."""
        return f"{self.request_id}·s{self.sample}"


@dataclass
class Frame:
    """The block manager's state after one engine step (step -1: after the requests were added, before any step)."""

    step: int
    kind: str  # "start" | "prefill" | "decode" | "idle"
    seqs: list[SeqView]
    ref_counts: list[int]
    pinned: list[int]
    cached: list[int]  # blocks holding a registered prefix hash (used or evictable)
    block_size: int
    num_copies: int = 0  # copy-on-write copies performed in this step
    new_requests: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.ref_counts)

    def owners(self) -> dict[int, set[str]]:
        """Physical block -> the requests whose block tables point at it."""
        out: dict[int, set[str]] = {}
        for s in self.seqs:
            for b in s.blocks:
                out.setdefault(b, set()).add(s.request_id)
        return out

    def table_refs(self) -> list[int]:
        """Reference counts implied by the block tables plus the pinned prefix (must equal ``ref_counts``)."""
        counts = [0] * self.num_blocks
        for s in self.seqs:
            for b in s.blocks:
                counts[b] += 1
        for b in self.pinned:
            counts[b] += 1
        return counts


def frame_from_manager(kv, labels: dict[int, tuple[str, int]], step: int = -1, kind: str = "start",
                       num_copies: int = 0, new_requests=(), finished=()) -> Frame:
    """Copy a ``BlockManager``'s device-side state into a ``Frame``; ``labels`` maps seq id -> (request, sample)
    (sequences without a label are shown under their seq id)."""
    view = kv.block_view()
    seqs = [SeqView(*labels.get(sid, (f"seq{sid}", 0)), sid, blocks, n) for sid, (blocks, n) in view.tables.items()]
    return Frame(step, kind, seqs, view.ref_counts, view.pinned, view.cached, kv.block_size, num_copies,
                 list(new_requests), list(finished))


def snapshot(engine, step: int, kind: str, num_copies: int = 0, new_requests=(), finished=()) -> Frame:
    """Copy the engine's block-manager state into a ``Frame`` (paged ``BlockManager`` only)."""
    labels = {s.seq_id: (g.request_id, i) for g in engine.requests.values() for i, s in enumerate(g.seqs)}
    return frame_from_manager(engine.kv, labels, step, kind, num_copies, new_requests, finished)


def record_trace(engine, arrivals: dict[int, list[tuple]] | None = None, max_steps: int = 500) -> tuple[list[Frame], dict]:
    """Run ``engine`` to completion, recording a ``Frame`` before the first step and after every ``engine.step()``.

    ``arrivals`` maps a step number to the requests added just before that step, each an ``add_request`` argument
    tuple ``(request_id, prompt, sampling_params[, arrival_time, prefix_len])``. Returns the frames and the finished
    outputs by request id."""
    arrivals = dict(arrivals or {})
    outputs: dict = {}
    frames: list[Frame] = []
    step = 0
    new = _add(engine, arrivals.pop(0, []))
    frames.append(snapshot(engine, -1, "start", new_requests=new))
    while (engine.has_unfinished_requests() or arrivals) and step < max_steps:
        new = _add(engine, arrivals.pop(step, [])) if step else []
        n_steps = engine.num_steps
        outs = engine.step() if engine.has_unfinished_requests() else []
        done = [o.request_id for o in outs if o.finished]
        outputs.update({o.request_id: o for o in outs if o.finished})
        m = engine.step_metrics[-1:] if engine.num_steps > n_steps else []
        kind = m[0].kind if m else "idle"
        frames.append(snapshot(engine, step, kind, m[0].num_blocks_copied if m else 0, new, done))
        step += 1
    return frames, outputs


def _add(engine, requests: list[tuple]) -> list[str]:
    for args in requests:
        engine.add_request(*args)
    return [args[0] for args in requests]


def save_trace(frames: list[Frame], path) -> str:
    """Write the frames as JSON (one object per frame, the ``Frame`` fields), so that a reader, or a test driving the
    live view in a browser, can compare what is shown with what was recorded."""
    Path(path).write_text(json.dumps([asdict(f) for f in frames]))
    return str(path)


def load_trace(path) -> list[Frame]:
    """The frames written by ``save_trace``."""
    return [Frame(**{**d, "seqs": [SeqView(**s) for s in d["seqs"]]}) for d in json.loads(Path(path).read_text())]


def copy_on_write_frame(frames: list[Frame]) -> int:
    """Index of the frame where copy-on-write copied the most blocks (the first such frame): the frame the tour's view
    opens on, so that a reader without a kernel sees samples splitting off a shared block (§4.4)."""
    copies = [f.num_copies for f in frames]
    if not any(copies):
        raise ValueError("no frame of this trace has a copy-on-write copy")
    return copies.index(max(copies))
