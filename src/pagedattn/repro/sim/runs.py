"""Runs of steady decode steps: the simulator's one fast path, outside the engine core (issue 63).

After a step, the simulator can often tell how many next steps are sure to be plain decode steps of the running
sequences (no admission, finish, preemption, swap or copy; paper §4.5's scheduling has nothing to decide in them):
its executor knows how long each sequence still runs (``RunExecutor.steps_left``, from the trace), the scheduler's
queues say that nothing waiting could be admitted (``steady_decode_steps``) and the KV manager how many rounds of
slots it has without a preemption or copy (``memory.interface.KVDecodeRuns.decode_room``). ``RunCore`` then takes
those steps without planning each: every step but the last is charged its duration (``RunExecutor.steady_step``)
and takes its slots; the tokens are appended at once (``advance``); the last step is planned (``steady_plan``) and
finished as any other. An arrival ends a run that began with nobody waiting. The results equal step-by-step
stepping, record for record (``tests/test_sim_golden.py``, ``tests/test_engine_vs_sim.py``).

``RunCore`` is ``core.EngineCore`` with its step chosen once (the simulator builds one where runs may be taken, a
plain ``EngineCore`` elsewhere); the engine core, the scheduler and the executors know nothing of runs. This module
imports no torch: the compiled simulator (``fastsim``) compiles it with the core.
"""
from __future__ import annotations

from typing import Callable, MutableSequence, Protocol
from typing import Sequence as Sequence_

from pagedattn.core import EngineCore, Executor, StepMetrics
from pagedattn.memory.interface import AllocStatus, KVDecodeRuns
from pagedattn.scheduler import Scheduler, SchedulerOutputs
from pagedattn.sequence import Sequence, SequenceGroup

#: what ``RunCore.step`` returns for a step within a run: no plan, nothing finished
_IN_A_RUN: tuple[None, tuple] = (None, ())


class RunExecutor(Executor, Protocol):
    """The executor of a core that takes runs (``simulator.SimExecutor``): it knows how long each sequence still
    runs, and charges a steady decode step without a plan."""

    fill_token: int  # the token a run appends (the simulator's dummy token)

    def steps_left(self, seqs: list[Sequence]) -> int:
        """Steps that none of ``seqs`` can finish before the last of (each takes its output's last token then at
        the earliest)."""
        ...

    def steady_step(self, num_seqs: int, context_tokens: int) -> float:
        """Charge one steady decode step of ``num_seqs`` sequences over ``context_tokens`` context tokens; returns
        its duration."""
        ...


def running_seqs(sched: Scheduler) -> list[Sequence]:
    """The running sequences, in the order a decode step appends to them (FCFS over the groups)."""
    return [s for g in sched.running for s in g.get_seqs("running")]


def steady_decode_steps(sched: Scheduler, kv: KVDecodeRuns, limit: int, seqs: list[Sequence]) -> int:
    """How many of the next steps (at most ``limit``) are sure to be decode steps of the running sequences ``seqs``
    (``running_seqs``) as they stand, with no admission, swap, preemption or copy, provided that no sequence
    finishes before the last of them and, while none waits, no request arrives (the caller's bounds): the waiting
    queue's head cannot be admitted before memory is freed (its blocks do not fit, and the running sequences'
    growth only takes more) or a sequence finishes (``max_num_seqs``). 0 where that is not sure. ``kv`` is the
    scheduler's KV manager."""
    if limit <= 0 or sched.swapped or sched.pending_copies or not sched.running:
        return 0
    if sched.waiting and not sched.static_batching:
        head = sched.waiting[0]
        status = sched.kv.can_allocate(head)
        if status is AllocStatus.NEVER or status is AllocStatus.OK and \
                len(seqs) + len(head.get_seqs("waiting")) <= sched.config.max_num_seqs:
            return 0
    if any(g.metrics.first_token_time is None for g in sched.running):
        return 0
    return kv.decode_room(seqs, limit)


def advance(seqs: list[Sequence], steps: int, fill_token: int) -> None:
    """``steps`` decode steps at once, as ``steady_decode_steps`` allowed: each running sequence (``seqs``, as given
    to it) gains ``steps`` copies of ``fill_token``, and the K/V of all its tokens but the last is cached; what
    ``steps`` rounds of ``schedule`` and ``update_from_output`` would have done, no sequence finishing, once the
    caller has taken the slots for those steps (``KVDecodeRuns.advance``: all at once, or step by step where each
    step's memory is recorded)."""
    for s in seqs:
        s.extend(fill_token, steps)
        s.num_computed_tokens = len(s.token_ids) - 1


def steady_plan(sched: Scheduler) -> SchedulerOutputs:
    """The plan of a step that ``steady_decode_steps`` vouched for (the last of a run, after ``advance``): every
    running group decodes and nothing else happens; what ``schedule`` would plan then, without its checks. The
    caller has taken the step's slots (``KVDecodeRuns.advance``); its ``update_from_output`` follows as usual,
    finishing the sequences that are done."""
    return SchedulerOutputs(decode_groups=list(sched.running))


class RunCore(EngineCore):
    """The engine core of a replay that takes runs of steady decode steps (see the module docstring), at most
    ``max_steps`` steps in all. The scheduler's KV manager implements the runs' extension (``KVDecodeRuns``);
    ``executor`` knows how long each sequence runs (``RunExecutor``)."""

    def __init__(self, scheduler: Scheduler, executor: RunExecutor, clock: Callable[[], float],
                 record_steps: bool = True, steps: MutableSequence[StepMetrics] | None = None,
                 final_len: dict[int, int] | None = None, max_steps: int | None = None) -> None:
        super().__init__(scheduler, executor, clock, record_steps, steps, final_len)
        self.runs_kv: KVDecodeRuns = scheduler.kv  # type: ignore[assignment]  # (both managers implement it)
        self.run_executor = executor
        self._steady_step_time = executor.steady_step  # (bound once: a run calls it every step)
        self.max_steps = max_steps
        self.num_steady_steps = 0  # steps taken within runs of steady decode steps, unplanned
        self._run_left = self._run_done = self._run_context = 0  # steps left and taken in a run, its context
        self._run_seqs: list[Sequence] = []  # the run's sequences, in the scheduler's order
        self._run_closed_queue = False  # the run began with nobody waiting: an arrival ends it

    def step(self) -> tuple[SchedulerOutputs | None, Sequence_[SequenceGroup]]:
        """One step: ``EngineCore.step``'s, or one of a run (None for its plan); a run starts after a step that
        leaves one possible."""
        sched = self.scheduler
        run_left = self._run_left
        if run_left:
            if self._run_closed_queue and sched.waiting:  # an arrival, maybe admitted now: the run ends
                run_left = self._run_left = 0
            elif run_left > 1:  # a step of the run: a decode step of the running sequences as they stand
                return self._steady_step()
        if self._run_done:  # the run's tokens so far, before its last step (or after its end)
            if not self.record_steps:  # their slots at once (recording, each step took its own)
                self.runs_kv.advance(self._run_seqs, self._run_done)
            advance(self._run_seqs, self._run_done, self.run_executor.fill_token)
            self._run_done = 0
        start = self.clock()
        if run_left:  # the run's last step: its slots, then its plan
            self._run_left = 0
            self.runs_kv.advance(self._run_seqs, 1)
            plan = steady_plan(sched)
        else:
            plan = sched.schedule(start)
        ran = self.num_steps
        done = self._carry_out(plan, start)
        if self.num_steps > ran and sched.running and not sched.swapped:  # a step ran (``steady_decode_steps``'
            self._start_run()  # cheapest checks)
        return done

    def _steady_step(self) -> tuple[None, Sequence_[SequenceGroup]]:
        """A step within a run: charged, its slots taken when recording, not planned. Its record is ``_record``'s
        for a decode step of the run's sequences, written out here: a paper-scale replay takes most of its steps
        this way."""
        n, context = len(self._run_seqs), self._run_context
        if self.record_steps:
            start = self.clock()
            dt = self._steady_step_time(n, context)
            sched = self.scheduler
            self.runs_kv.advance(self._run_seqs, 1)  # its slots now, for its memory record
            running = len(sched.running)
            self.steps.append(StepMetrics(
                self.num_steps, "decode", start, dt, dt, n, running, 0, n, sched.num_used_blocks(), context, 0, 0,
                0, running, len(sched.waiting), len(sched.swapped), self._memory_bound(start),
                sched.kv_stats(self.final_len) if self.final_len is not None else None))
        else:
            self._steady_step_time(n, context)
        self._run_context = context + n
        self._run_left -= 1
        self._run_done += 1
        self.num_steps += 1
        self.num_steady_steps += 1
        return _IN_A_RUN

    def _start_run(self) -> None:
        seqs = running_seqs(self.scheduler)
        limit = self.run_executor.steps_left(seqs)
        if self.max_steps is not None:
            limit = min(limit, self.max_steps - self.num_steps)
        self._run_left = steady_decode_steps(self.scheduler, self.runs_kv, limit, seqs)
        if self._run_left:
            self._run_seqs = seqs
            self._run_context = sum(len(s.token_ids) for s in seqs)
            self._run_closed_queue = not self.scheduler.waiting
