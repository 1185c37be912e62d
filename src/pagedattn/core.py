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

The simulator's one fast path, runs of steady decode steps taken without planning each, is not here: it is the
research tier's (``repro.sim.runs.RunCore``, a core whose step is chosen once), over extension protocols that only
the simulator uses.

This module imports no torch: it serves the simulator at paper scale on a laptop.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, MutableSequence, NamedTuple, Protocol
from typing import Sequence as Sequence_

from pagedattn.memory.interface import num_copied
from pagedattn.scheduler import ModelOutput, Scheduler, SchedulerOutputs
from pagedattn.sequence import SequenceGroup

if TYPE_CHECKING:
    from pagedattn.memory.accounting import KVStats


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

    def execute(self, plan: SchedulerOutputs) -> ModelOutput | None:
        """Perform the plan's block moves and, when groups run, one forward pass; return each running sequence's
        next token (and beam search's decisions) with the step's end time and duration. None when the plan is
        empty."""
        ...


class EngineCore:
    """``schedule`` -> ``execute`` -> ``update_from_output``, over one scheduler and one executor; the scheduler owns
    the KV manager (the records read its memory through it).

    ``clock`` reads the time a step starts (the engine's ``time.perf_counter``; the simulator's clock, which its
    executor moves). ``record_steps``: append each step's ``StepMetrics`` to ``steps`` (a list, or the container
    given: the engine's bounded ring), with the memory breakdown when ``final_len`` is given (``{seq_id: final KV
    length}``, the simulator's; ``KVManager.stats``)."""

    def __init__(self, scheduler: Scheduler, executor: Executor, clock: Callable[[], float],
                 record_steps: bool = True, steps: MutableSequence[StepMetrics] | None = None,
                 final_len: dict[int, int] | None = None) -> None:
        self.scheduler, self.executor, self.clock = scheduler, executor, clock
        self.record_steps, self.final_len = record_steps, final_len
        self.steps: MutableSequence[StepMetrics] = [] if steps is None else steps
        self.num_steps = 0  # steps run since the start (``steps`` keeps the last ones)

    def add(self, group: SequenceGroup) -> None:
        self.scheduler.add(group)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> tuple[SchedulerOutputs | None, Sequence_[SequenceGroup]]:
        """One step: returns its plan and the groups that finished. An empty plan (``is_empty()``) ran nothing: no
        request could run, or those left were refused (the plan's ``ignored``, which the scheduler has finished).
        Raises when requests are left that nothing will ever run. (The plan is None only for the simulator's steps
        within a run, ``repro.sim.runs.RunCore``.)"""
        start = self.clock()
        return self._carry_out(self.scheduler.schedule(start), start)

    def _carry_out(self, plan: SchedulerOutputs, start: float) -> tuple[SchedulerOutputs, Sequence_[SequenceGroup]]:
        """A planned step from ``start`` on: ``execute``, its record, ``update_from_output``."""
        sched = self.scheduler
        output = self.executor.execute(plan)
        if output is None:
            if not (plan.preempted or plan.ignored) and sched.has_unfinished():
                raise RuntimeError("the scheduler made no progress with requests left (a request can never fit?)")
            return plan, ()
        if self.record_steps:
            self._record(plan, start, output)
        finished = sched.update_from_output(plan, output)
        self.num_steps += 1
        return plan, finished

    # ------------------------------------------------------------------------------------------ records
    def _memory_bound(self, now: float) -> bool:
        sched = self.scheduler
        waiting = sched.waiting
        return bool(waiting) and waiting[0].metrics.arrival_time <= now and \
            len(sched.running) < sched.config.max_num_seqs

    def _record(self, plan: SchedulerOutputs, start: float, output: ModelOutput) -> None:
        sched = self.scheduler
        prefill = plan.is_prefill
        tokens = plan.num_batched_tokens if prefill else output.num_seqs  # (a decode step: one per sequence)
        duration = output.duration if output.duration is not None else self.clock() - start
        self.steps.append(StepMetrics(
            self.num_steps, "prefill" if prefill else "decode", start, duration,
            duration if output.forward_time is None else output.forward_time, output.num_seqs,
            len(plan.scheduled_groups), tokens if prefill else 0, tokens, sched.num_used_blocks(),
            output.context_tokens, len(plan.preempted), len(plan.blocks_to_swap_in) + len(plan.blocks_to_swap_out),
            num_copied(plan.blocks_to_copy) if plan.blocks_to_copy else 0, len(sched.running), len(sched.waiting),
            len(sched.swapped), self._memory_bound(start),
            sched.kv_stats(self.final_len) if self.final_len is not None else None))

