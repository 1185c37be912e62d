"""The engine core: one step of iteration-level batching, for the real engine and the simulator alike (paper §4.1,
Fig. 4; §4.5).

A step is three calls, as in vLLM V1's ``EngineCore``: the ``Scheduler`` plans it (``schedule``: the groups to run,
the block swaps and copy-on-write copies, the preempted and the refused requests); an ``Executor`` carries it out
(``execute``: the block moves and a forward pass that picks each running sequence's next token); the scheduler
applies the result (``update_from_output``: tokens, stops, beam forks, freed blocks, request times). Two executors
exist: ``executor.ModelExecutor`` runs a torch model through the paged KV cache on a real clock, and
``repro.sim.SimExecutor`` charges a step-time model on a simulated clock and takes each sequence's next token from
the trace. The scheduler and the KV manager are the same objects in both, so a replay at the paper's scale makes
the decisions the real engine makes.

Every step leaves one ``StepMetrics`` record (kept when ``record_steps``): what ran, the queues, the memory and the
step's duration, measured on the engine's clock or charged by the simulator's cost model.

**Runs of steady decode steps** (the one fast path, used by the simulator): after a step, the scheduler can tell how
many next steps are sure to be plain decode steps of the running sequences, with no admission, finish, preemption,
swap or copy (``Scheduler.steady_decode_steps``), when the executor knows how long each sequence still runs
(``Executor.steps_left``; a model executor cannot know, and answers 0). The core then takes those steps without
planning each: every step but the last is charged its duration (``Executor.steady_step``) and takes its slots; the
tokens are appended at once (``Scheduler.advance``); the last step is planned (``Scheduler.schedule_steady``) and
finished as any other. An arrival ends a run that began with nobody waiting. The results equal step-by-step
stepping, record for record (``tests/test_sim_golden.py``, ``tests/test_engine_vs_sim.py``).

This module imports no torch: it serves the simulator at paper scale on a laptop.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, MutableSequence, NamedTuple, Protocol
from typing import Sequence as Sequence_

from pagedattn.memory.interface import KVManager, num_copied
from pagedattn.scheduler import ModelOutput, Scheduler, SchedulerOutputs
from pagedattn.sequence import Sequence, SequenceGroup

if TYPE_CHECKING:
    from pagedattn.memory.accounting import KVStats


#: what ``EngineCore.step`` returns for a step within a run: no plan, nothing finished
_IN_A_RUN: tuple[None, tuple] = (None, ())


class StepMetrics(NamedTuple):
    """One engine step. Queue lengths and memory are as the step ran (after scheduling, before its tokens were
    applied). ``slots_filled`` counts the context tokens of the sequences computed (K/V read from the cache);
    ``blocks_used`` is the device pool's used blocks (slots, for a contiguous manager); ``memory_bound``: a request
    that has arrived waits although the scheduler would admit it but for memory; ``memory``: Fig. 2's breakdown of
    the device slots (``KVManager.stats``), where the core was asked to record it (the simulator).

    A named tuple, not a dataclass: a replay at paper scale writes one per step, and in the compiled simulator a
    dataclass's generated ``__init__`` still runs as interpreted Python, one attribute store at a time
    (``benchmarks/sim_speed.py``)."""

    step: int
    kind: str  # "prefill" | "decode"
    time: float  # the clock at the step's start
    step_time: float  # the step's duration: measured on the engine's clock, or the simulator's charge
    forward_time: float  # of which in the model forward (the simulator: the whole step)
    batch_size: int  # sequences computed (a prefill computes one per group: forks share the prompt)
    num_groups: int  # requests scheduled
    num_prefill_tokens: int
    num_batched_tokens: int
    blocks_used: int
    slots_filled: int
    num_preempted: int
    num_blocks_swapped: int
    num_blocks_copied: int
    num_running: int  # groups in the scheduler's queues
    num_waiting: int
    num_swapped: int
    memory_bound: bool
    memory: KVStats | None = None

    @property
    def overhead_time(self) -> float:
        """Time outside the model forward: scheduling, block tables, block moves, sampling."""
        return self.step_time - self.forward_time


class Executor(Protocol):
    """What carries out a scheduler's plan: a model on a device (``executor.ModelExecutor``) or a step-time model
    (``repro.sim.SimExecutor``)."""

    fill_token: int  # the token a run of steady decode steps appends (the simulator's dummy token)

    def execute(self, plan: SchedulerOutputs) -> ModelOutput | None:
        """Perform the plan's block moves and, when groups run, one forward pass; return each running sequence's
        next token (and beam search's decisions) with the step's end time and duration. None when the plan is
        empty."""
        ...

    def steps_left(self, seqs: list[Sequence]) -> int:
        """Steps that none of ``seqs`` can finish before the last of (each takes its output's last token then at
        the earliest); 0 where unknown (a model's tokens decide)."""
        ...

    def steady_step(self, num_seqs: int, context_tokens: int) -> float:
        """Charge one steady decode step of ``num_seqs`` sequences over ``context_tokens`` context tokens; returns
        its duration (called only where ``steps_left`` was positive)."""
        ...


class EngineCore:
    """``schedule`` -> ``execute`` -> ``update_from_output``, over one scheduler and one executor (``kv``: the
    scheduler's KV manager).

    ``clock`` reads the time a step starts (the engine's ``time.perf_counter``; the simulator's clock, which its
    executor moves). ``record_steps``: append each step's ``StepMetrics`` to ``steps`` (a list, or the container
    given: the engine's bounded ring), with the memory breakdown when ``final_len`` is given (``{seq_id: final KV length}``, the
    simulator's; ``KVManager.stats``). ``fast_forward``: take runs of steady decode steps (see the module
    docstring), at most ``max_steps`` steps in all."""

    def __init__(self, scheduler: Scheduler, executor: Executor, kv: KVManager, clock: Callable[[], float],
                 record_steps: bool = True, steps: MutableSequence[StepMetrics] | None = None,
                 final_len: dict[int, int] | None = None, fast_forward: bool = False,
                 max_steps: int | None = None) -> None:
        self.scheduler, self.executor, self.clock = scheduler, executor, clock
        self._steady_step_time = executor.steady_step  # (bound once: a run calls it every step)
        self.kv = kv  # the scheduler's (its allocator view), read here for the records too
        self.record_steps, self.final_len = record_steps, final_len
        self.steps: MutableSequence[StepMetrics] = [] if steps is None else steps
        self.num_steps = 0  # steps run since the start (``steps`` keeps the last ones)
        self.num_steady_steps = 0  # of which taken within runs of steady decode steps, unplanned
        self.fast_forward, self.max_steps = fast_forward, max_steps
        self._run_left = self._run_done = self._run_context = 0  # steps left and taken in a run, its context
        self._run_seqs: list[Sequence] = []  # the run's sequences, in the scheduler's order
        self._run_closed_queue = False  # the run began with nobody waiting: an arrival ends it

    def add(self, group: SequenceGroup) -> None:
        self.scheduler.add(group)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> tuple[SchedulerOutputs | None, Sequence_[SequenceGroup]]:
        """One step: returns its plan (None for a step within a run) and the groups that finished. An empty plan
        (``is_empty()``) ran nothing: no request could run, or those left were refused (the plan's ``ignored``,
        which the scheduler has finished). Raises when requests are left that nothing will ever run."""
        sched = self.scheduler
        run_left = self._run_left
        if run_left:
            if self._run_closed_queue and sched.waiting:  # an arrival, maybe admitted now: the run ends
                run_left = self._run_left = 0
            elif run_left > 1:  # a step of the run: a decode step of the running sequences as they stand
                return self._steady_step()
        if self._run_done:  # the run's tokens so far, before its last step (or after its end)
            if not self.record_steps:  # their slots at once (recording, each step took its own)
                self.kv.advance(self._run_seqs, self._run_done)
            sched.advance(self._run_done, self.executor.fill_token, self._run_seqs)
            self._run_done = 0
        start = self.clock()
        if run_left:  # the run's last step: its slots, then its plan
            self._run_left = 0
            self.kv.advance(self._run_seqs, 1)
            plan = sched.schedule_steady()
        else:
            plan = sched.schedule(start)
        output = self.executor.execute(plan)
        if output is None:
            if not (plan.preempted or plan.ignored) and sched.has_unfinished():
                raise RuntimeError("the scheduler made no progress with requests left (a request can never fit?)")
            return plan, ()
        if self.record_steps:
            self._record(plan, start, output)
        finished = sched.update_from_output(plan, output)
        self.num_steps += 1
        if self.fast_forward and sched.running and not sched.swapped:  # (``steady_decode_steps``' cheapest checks)
            self._start_run()
        return plan, finished

    def _steady_step(self) -> tuple[None, Sequence_[SequenceGroup]]:
        """A step within a run: charged, its slots taken when recording, not planned (see the module docstring).
        Its record is ``_record``'s for a decode step of the run's sequences, written out here: a paper-scale
        replay takes most of its steps this way."""
        n, context = len(self._run_seqs), self._run_context
        if self.record_steps:
            start = self.clock()
            dt = self._steady_step_time(n, context)
            kv, sched = self.kv, self.scheduler
            kv.advance(self._run_seqs, 1)  # its slots now, for its memory record
            running = len(sched.running)
            self.steps.append(StepMetrics(
                self.num_steps, "decode", start, dt, dt, n, running, 0, n, kv.num_used_gpu_blocks, context, 0, 0, 0,
                running, len(sched.waiting), len(sched.swapped), self._memory_bound(start),
                kv.stats(self.final_len) if self.final_len is not None else None))
        else:
            self._steady_step_time(n, context)
        self._run_context = context + n
        self._run_left -= 1
        self._run_done += 1
        self.num_steps += 1
        self.num_steady_steps += 1
        return _IN_A_RUN

    def _start_run(self) -> None:
        seqs = self.scheduler.running_seqs()
        limit = self.executor.steps_left(seqs)
        if self.max_steps is not None:
            limit = min(limit, self.max_steps - self.num_steps)
        self._run_left = self.scheduler.steady_decode_steps(limit, seqs)
        if self._run_left:
            self._run_seqs = seqs
            self._run_context = sum(len(s.token_ids) for s in seqs)
            self._run_closed_queue = not self.scheduler.waiting

    # ------------------------------------------------------------------------------------------ records
    def _memory_bound(self, now: float) -> bool:
        sched = self.scheduler
        waiting = sched.waiting
        return bool(waiting) and waiting[0].metrics.arrival_time <= now and \
            len(sched.running) < sched.config.max_num_seqs

    def _record(self, plan: SchedulerOutputs, start: float, output: ModelOutput) -> None:
        sched, kv = self.scheduler, self.kv
        prefill = plan.is_prefill
        tokens = plan.num_batched_tokens if prefill else output.num_seqs  # (a decode step: one per sequence)
        duration = output.duration if output.duration is not None else self.clock() - start
        self.steps.append(StepMetrics(
            self.num_steps, "prefill" if prefill else "decode", start, duration,
            duration if output.forward_time is None else output.forward_time, output.num_seqs,
            len(plan.scheduled_groups), tokens if prefill else 0, tokens, kv.num_used_gpu_blocks,
            output.context_tokens, len(plan.preempted), len(plan.blocks_to_swap_in) + len(plan.blocks_to_swap_out),
            num_copied(plan.blocks_to_copy) if plan.blocks_to_copy else 0, len(sched.running), len(sched.waiting),
            len(sched.swapped), self._memory_bound(start),
            kv.stats(self.final_len) if self.final_len is not None else None))

