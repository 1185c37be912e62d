"""Iteration-level (continuous) batching with FCFS admission and preemption (paper §4.5).

Every step the scheduler decides which sequence groups run next:
1. while no group is swapped out, admit waiting groups first-come-first-served as long as their prompt blocks fit
   (a *prefill* step: the prompt, or the whole sequence when recomputing a preempted group);
2. otherwise run one *decode* step for every running group; when a group cannot get a slot for its next token,
   the group that arrived last is preempted, all or nothing: its blocks are freed to recompute it later
   ("recompute") or moved to the CPU pool ("swap");
3. swapped groups come back (before any new admission) as soon as their blocks fit again: their distinct blocks
   plus the blocks their next tokens need (none for a sequence with room in its last block). A swapped group that
   could not come back even into an empty pool is refused at once, with an error naming the limit.

The scheduler owns its KV manager (as vLLM V1's scheduler owns its ``KVCacheManager``): it allocates through
``memory.interface.KVAllocator``, the scheduler's view of the ``KVManager`` that ``memory.BlockManager`` (paged) and
``memory.contiguous.ContiguousKVManager`` (Orca) implement, so the same loop serves the real engine and the
simulation. It never touches tensors: what the executor needs of the cache travels in ``SchedulerOutputs`` (the block
moves it decides and, for the real engine, each computed sequence's block table and slots, ``lay_out``). It owns a step's bookkeeping after the forward pass (``update_from_output``:
tokens computed and appended, stop checks, beam forks, freeing, per-request times), for the engine and the simulator
alike, and so ``Sequence.num_computed_tokens``: the cached prefix at admission, 0 when preempted by recomputation,
the whole sequence after each step that computed it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from pagedattn.config import SchedulerConfig
from pagedattn.memory.interface import AllocStatus, BlockCopies, KVLayout, KVManager
from pagedattn.sequence import FinishReason, Sequence, SequenceGroup

if TYPE_CHECKING:
    from pagedattn.memory.accounting import KVStats


@dataclass
class SchedulerOutputs:
    """One step's plan: which groups run, and the block copies the executor performs before the forward pass."""

    prefill_groups: list[SequenceGroup] = field(default_factory=list)
    decode_groups: list[SequenceGroup] = field(default_factory=list)
    blocks_to_swap_in: dict[int, int] = field(default_factory=dict)
    blocks_to_swap_out: dict[int, int] = field(default_factory=dict)
    blocks_to_copy: BlockCopies = field(default_factory=list)
    preempted: list[SequenceGroup] = field(default_factory=list)
    ignored: list[SequenceGroup] = field(default_factory=list)
    # What the executor reads of the KV cache for the step (§4.1), by sequence id, for each sequence the step computes:
    # its block table (the blocks of its context) and the slots of the tokens it computes; filled by ``lay_out``
    # (the scheduler does where it lays out its plans: the real engine; the simulator reads none)
    block_tables: dict[int, list[int]] = field(default_factory=dict)
    slot_mappings: dict[int, list[int]] = field(default_factory=dict)

    @property
    def is_prefill(self) -> bool:
        return bool(self.prefill_groups)

    @property
    def scheduled_groups(self) -> list[SequenceGroup]:
        return self.prefill_groups or self.decode_groups

    @property
    def num_batched_tokens(self) -> int:
        if self.prefill_groups:  # tokens to compute: a cached prefix is not recomputed
            return sum(s.get_len() - s.num_computed_tokens for s in (g.get_seqs("running")[0]
                                                                      for g in self.prefill_groups))
        return sum(len(g.get_seqs("running")) for g in self.decode_groups)

    def is_empty(self) -> bool:
        return not (self.prefill_groups or self.decode_groups or self.blocks_to_swap_out)


def lay_out(out: SchedulerOutputs, kv: KVLayout) -> SchedulerOutputs:
    """Fill the plan's ``block_tables`` and ``slot_mappings`` from the KV manager's layout view, as the step computes
    its sequences: a prefill each group's uncached prompt tokens once (its first running sequence: forks share the
    prompt), a decode each running sequence's last token. Returns ``out``."""
    tables, slots = out.block_tables, out.slot_mappings
    for g in out.prefill_groups:
        s = g.get_seqs("running")[0]
        n = s.get_len()
        slots[s.seq_id] = kv.slot_mapping(s.seq_id, s.num_computed_tokens, n)
        tables[s.seq_id] = kv.block_table(s.seq_id, n)
    for g in out.decode_groups:
        for s in g.get_seqs("running"):
            n = s.get_len()
            slots[s.seq_id] = kv.slot_mapping(s.seq_id, n - 1, n)
            tables[s.seq_id] = kv.block_table(s.seq_id, n)
    return out


@dataclass
class ModelOutput:
    """What a step's executor decided, for ``Scheduler.update_from_output`` to apply:

    - ``tokens``: a new token for each sequence that was computed (with its group and log-probability);
    - ``rewrites``, ``forks``, ``finished``: beam search's decisions (``beam_search.BeamStep``, §4.4): beams' new
      histories, the K/V forks of surviving parents into dead beams' sequences, the beams of searches that are over;
    - ``stop``: the rule that stops a sequence after its new token (``stop(seq, group)``: a finish reason or None;
      the engine's is ``sampling.check_stop``, the simulator's the trace's output length);
    - ``now``: the clock at the end of the step; ``duration``: the step's, where the executor decides it (the
      simulator's charge; None: the engine core measures it on its clock); ``forward_time``: of which in the
      model forward (None: all of it); ``num_seqs`` and ``context_tokens``: the sequences the step computed and
      the context tokens they read (for the step's record)."""

    tokens: list[tuple[Sequence, SequenceGroup, int, float]] = field(default_factory=list)
    rewrites: list[tuple[Sequence, list[int], float]] = field(default_factory=list)
    forks: list[tuple[Sequence, Sequence]] = field(default_factory=list)
    finished: list[tuple[Sequence, FinishReason]] = field(default_factory=list)
    stop: Callable[[Sequence, SequenceGroup], FinishReason | None] | None = None
    now: float = 0.0
    duration: float | None = None
    forward_time: float | None = None
    num_seqs: int = 0
    context_tokens: int = 0


class Scheduler:
    """FCFS iteration-level scheduler over a KV manager (paged or contiguous), which it owns: the engine core and the
    executors hold none. ``lay_out_plans``: every plan carries its block tables and slot mappings (``lay_out``; the
    real engine's executor reads them, the simulator's none)."""

    def __init__(self, config: SchedulerConfig, kv_manager: KVManager, static_batching: bool = False,
                 lay_out_plans: bool = False) -> None:
        self.config = config
        self.kv = kv_manager
        self.lay_out_plans = lay_out_plans
        # FasterTransformer-style static batching: a new batch starts only when the previous one has finished.
        self.static_batching = static_batching
        self.waiting: deque[SequenceGroup] = deque()
        self.running: list[SequenceGroup] = []
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = {"recompute": 0, "swap": 0}
        self.pending_copies: BlockCopies = []  # decided between steps (beam search forks), run with the next step
        self._now = 0.0  # the start of the step being planned (a refused request's finish time)
        # parallel samples that cannot be swapped are split and recomputed one by one (``_split_samples``), as the
        # engine serves them; off: they are refused, as the simulator replays (its beams are plain sample groups)
        self.split_samples = False

    # ----------------------------------------------------------------------------------------------- queues
    def add(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_used_blocks(self) -> int:
        """Device blocks in use (slots, for a contiguous manager): the step records'."""
        return self.kv.num_used_gpu_blocks

    def kv_stats(self, final_len: dict[int, int] | None = None) -> KVStats:
        """The device memory's snapshot (``KVInspector.stats``): the simulator's step records'."""
        return self.kv.stats(final_len)

    def num_running_seqs(self) -> int:
        return sum(len(g.get_seqs("running")) for g in self.running)

    def abort(self, request_id: str) -> SequenceGroup | None:
        """Remove a request wherever it is and free its blocks."""
        found = self.abort_many({request_id})
        return found[0] if found else None

    def abort_many(self, request_ids: set[str]) -> list[SequenceGroup]:
        """``abort`` for many requests in one pass over each queue (a client gone with 100,000 prompts queued would
        take 100,000 passes one by one); returns the groups found."""
        found = []
        for queue in (self.waiting, self.running, self.swapped):
            gone = [g for g in queue if g.request_id in request_ids]
            if not gone:
                continue
            kept = [g for g in queue if g.request_id not in request_ids]
            queue.clear()
            queue.extend(kept)
            for g in gone:
                for s in g.seqs:
                    self.kv.free_seq(s)
                    if not s.is_finished():
                        s.finish("abort")
            found += gone
        return found

    def fork(self, parent, child) -> None:
        """Make ``child`` a copy of ``parent`` in the KV manager (a beam taking over a dead beam's sequence, §4.4);
        block copies that this takes run before the next step's forward pass, with its ``blocks_to_copy``."""
        self.pending_copies += self.kv.fork_into(parent.seq_id, child.seq_id)

    # ------------------------------------------------------------------------------------------ after a step
    def update_from_output(self, out: SchedulerOutputs, output: ModelOutput) -> list[SequenceGroup]:
        """A step's bookkeeping once its forward pass (or the simulator's stand-in) has run, for the real engine and
        the simulator alike (§4.3-§4.5): the K/V of every token the step ran is now cached; the new tokens are
        appended, each sequence checked against ``output.stop``; beam search's decisions are applied (§4.4: new
        histories, forks of surviving beams into dead beams' sequences, finished searches); each scheduled request
        gets its first-token time, and its finish time when it is done; the blocks of finished sequences are freed.
        Returns the groups that finished (dropped from ``running``)."""
        now, stop = output.now, output.stop
        for g in out.scheduled_groups:
            if g.metrics.first_token_time is None:
                g.metrics.first_token_time = now
            for s in g.get_seqs("running"):
                s.num_computed_tokens = len(s.token_ids)
        for s, g, token, logprob in output.tokens:
            s.append_token(token, logprob)
            reason = stop(s, g) if stop is not None else None
            if reason is not None:
                s.finish(reason)
        for parent, child in output.forks:
            self.fork(parent, child)
        for s, ids, logprob in output.rewrites:
            s.output_token_ids, s.cumulative_logprob = ids, logprob
        for s, reason in output.finished:
            s.finish(reason)
        done = self._free_finished()
        if done and out.scheduled_groups:
            ran = set(map(id, out.scheduled_groups))
            for g in done:
                if id(g) in ran:
                    g.metrics.finish_time = now
        return done

    def _free_finished(self) -> list[SequenceGroup]:
        """Free the blocks of finished sequences; drop and return the groups that are done."""
        done = []
        for g in self.running:
            finished = 0
            for s in g.seqs:
                if s.status == "finished":
                    self.kv.free_seq(s)
                    finished += 1
            if finished and finished == len(g.seqs):
                done.append(g)
        if done:
            gone = set(map(id, done))
            self.running = [g for g in self.running if id(g) not in gone]
        return done

    # ------------------------------------------------------------------------------------------- scheduling
    def schedule(self, now: float = 0.0) -> SchedulerOutputs:
        """The next step's plan (see the module docstring). Requests that can never be served are refused here,
        finished with their error at ``now`` (the step's start), and listed in the plan's ``ignored``."""
        self._now = now
        out = SchedulerOutputs(blocks_to_copy=self.pending_copies)
        self.pending_copies = []
        while self.swapped and self.kv.swap_in_status(self.swapped[0]) is AllocStatus.NEVER:
            g = self.swapped.popleft()  # it could not come back even into an empty pool: refused now, not left waiting
            if self._can_split(g):  # ... unless its samples can be served one by one
                self._split_samples(g, out)
            else:
                self._refuse(g, self.kv.never_reason(g), out)
        if not self.swapped and not (self.static_batching and self.running):
            self._schedule_prefills(out)
            if out.prefill_groups:
                return lay_out(out, self.kv) if self.lay_out_plans else out
        self._schedule_decodes(out)
        return lay_out(out, self.kv) if self.lay_out_plans else out

    def _schedule_prefills(self, out: SchedulerOutputs) -> None:
        num_tokens = 0
        num_seqs = None  # counted when a group could be admitted (most steps admit none: a scan saved)
        while self.waiting:
            g = self.waiting[0]
            status = self.kv.can_allocate(g)
            if status is AllocStatus.NEVER:
                self.waiting.popleft()
                self._refuse(g, self.kv.never_reason(g), out)
                continue
            if status is AllocStatus.LATER:
                break
            seqs = g.get_seqs("waiting")
            tokens = seqs[0].get_len()
            if out.prefill_groups and num_tokens + tokens > self.config.max_num_batched_tokens:
                break
            if num_seqs is None:
                num_seqs = self.num_running_seqs()
            if num_seqs + len(seqs) > self.config.max_num_seqs:
                break
            self.waiting.popleft()
            cached = self.kv.allocate_group(g)
            for s in seqs:
                s.num_computed_tokens = cached
            g.set_status("waiting", "running")
            if g.metrics.first_scheduled_time is None:  # its queueing time ends (the server's metrics)
                g.metrics.first_scheduled_time = self._now
            self.running.append(g)
            out.prefill_groups.append(g)
            num_tokens += tokens
            num_seqs += len(seqs)

    def _schedule_decodes(self, out: SchedulerOutputs) -> None:
        queue = deque(self.running)  # FCFS priority: earliest arrival first
        running: list[SequenceGroup] = []
        can_append, append = self.kv.can_append_slots, self.kv.append_slots
        while queue:
            g = queue.popleft()
            while not can_append(g):
                if queue:  # preempt the lowest-priority group (the latest arrival) ...
                    self._preempt(queue.pop(), out)
                else:  # ... or this one, when it is the last
                    self._preempt(g, out)
                    break
            else:
                copies = append(g)
                if copies:
                    out.blocks_to_copy += copies
                running.append(g)
        self.running = running
        if not out.preempted:
            self._schedule_swap_ins(out)
        out.decode_groups = list(self.running)

    def _schedule_swap_ins(self, out: SchedulerOutputs) -> None:
        """Swapped groups come back in FCFS order as soon as their blocks fit (§4.5)."""
        if not self.swapped:
            return
        num_seqs = self.num_running_seqs()
        while self.swapped:
            g = self.swapped[0]
            n = len(g.get_seqs("swapped"))
            if num_seqs + n > self.config.max_num_seqs or not self.kv.can_swap_in_group(g):
                break
            self.swapped.popleft()
            _add_moves(out.blocks_to_swap_in, self.kv.swap_in_group(g))
            g.set_status("swapped", "running")
            out.blocks_to_copy += self.kv.append_slots(g)
            self.running.append(g)
            num_seqs += n

    def _preempt(self, g: SequenceGroup, out: SchedulerOutputs) -> None:
        """All-or-nothing preemption of a group (§4.5)."""
        mode = self.config.preemption_mode
        if mode == "recompute" and len(g.get_seqs("running")) > 1:
            mode = "swap"  # forked sequences would lose their sharing if recomputed separately
        if mode == "swap" and not self.kv.can_swap_out(g):
            if self._can_split(g):  # parallel samples: each is recomputed on its own
                self._split_samples(g, out)
                return
            if len(g.get_seqs("running")) > 1:  # beams cannot be preempted: fail this request alone, free its blocks
                self._refuse(g, f"request {g.request_id!r} had to be preempted, but its "
                                f"{len(g.get_seqs('running'))} sequences share blocks and do not fit in the CPU swap "
                                "space (raise num_cpu_blocks)", out)
                return
            mode = "recompute"
        self.num_preemptions[mode] += 1
        if mode == "swap":
            _add_moves(out.blocks_to_swap_out, self.kv.swap_out_group(g))
            g.set_status("running", "swapped")
            self.swapped.append(g)
        else:
            for s in g.get_seqs("running"):
                self.kv.free_seq(s)
                s.num_computed_tokens = 0
            g.set_status("running", "waiting")
            self.waiting.appendleft(g)
        out.preempted.append(g)

    def _can_split(self, g: SequenceGroup) -> bool:
        """Whether ``split_samples`` is on and a group is parallel samples (not beams, §4.4) of which more than one
        is unfinished."""
        return self.split_samples and g.beam_state is None and sum(not s.is_finished() for s in g.seqs) > 1

    def _split_samples(self, g: SequenceGroup, out: SchedulerOutputs) -> None:
        """Preempt a group of parallel samples by recomputation, where the paper's rule would swap it (§4.5) but
        the CPU swap space cannot take it, or where it could never come back in whole: its blocks are freed and each
        unfinished sample becomes a one-sequence group of its own (``parent``: ``g``), queued at the front, to be
        recomputed from its prompt and its own tokens like any preempted single sequence; with prefix caching their
        prompt blocks are shared again. From then on they are scheduled, and preempted, one by one (as vLLM 0.32
        serves each sample), and the request's outputs still gather them (``SequenceGroup.root``)."""
        self.num_preemptions["recompute"] += 1
        g.metrics.samples_split = True
        samples = []
        for s in g.seqs:
            self.kv.free_seq(s)
            if s.is_finished():
                continue
            s.num_computed_tokens = 0
            s.status = "waiting"
            child = SequenceGroup(g.request_id, [s], g.sampling_params, g.metrics.arrival_time, g.prompt)
            child.metrics, child.prefix_len, child.parent = g.metrics, g.prefix_len, g.root
            samples.append(child)
        self.waiting.extendleft(reversed(samples))
        out.preempted.append(g)

    def _refuse(self, g: SequenceGroup, message: str, out: SchedulerOutputs) -> None:
        """Fail one request that can never be served: free its blocks, finish its sequences with an error (a sample
        split off a request fails the request, its other samples included)."""
        if g.parent is not None:
            self.abort_many({g.request_id})
            out.prefill_groups = [x for x in out.prefill_groups if x.request_id != g.request_id]
            g = g.parent
        g.error = message
        for s in g.seqs:
            self.kv.free_seq(s)
            if not s.is_finished():
                s.finish("error")
        g.metrics.finish_time = self._now
        out.ignored.append(g)


def _add_moves(moves: dict[int, int], new: dict[int, int]) -> None:
    """Merge one group's block moves into the step's. The KV manager moves a shared block once (§4.5); a block
    moved twice in one step would leave one copy unwritten, so it is an error here, not a silent overwrite."""
    twice = moves.keys() & new.keys()
    if twice:
        raise RuntimeError(f"blocks {sorted(twice)} moved twice in one step")
    moves.update(new)
