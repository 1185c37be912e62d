"""The serving engine (paper §4, Fig. 4): ``LLMEngine`` (add_request / step / abort).

One ``step()`` is one iteration of iteration-level batching (§4.5), taken by the engine core (``core.EngineCore``):
the ``Scheduler`` plans it (the groups to run, the block moves: swap, copy-on-write); the ``ModelExecutor`` performs
the moves and one forward pass through the paged KV cache (§4.1) and samples one token per sequence (§4.4 for n > 1
and beams); the scheduler applies them (``update_from_output``: tokens, stops, beam forks, freeing finished
sequences' blocks). The ``OutputProcessor`` then builds the outputs. Prefill and decode steps never mix (vLLM v0).
The simulator runs the same core with a simulated executor (``repro.sim``).

Names and behaviour follow vLLM. The KV manager is a system's (``EngineArgs.kv_manager``, ``memory.systems``: paged by
default, Orca's contiguous reservations and static batching for the baselines), or one passed built. The ``LLM``
facade is in ``pagedattn.llm``; model loading in ``pagedattn.model.loader``.

Bad input is isolated per request: ``add_request`` raises ``ValueError`` naming the limit (empty prompt, prompt over
``max_model_len``, more blocks than the whole pool, unknown token or stop id, ...).
"""
from __future__ import annotations

import itertools
import time
import warnings
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Literal, cast

import torch

from pagedattn import beam_search, kernels
from pagedattn.config import SchedulerConfig
from pagedattn.cpuinfo import bf16_in_hardware
from pagedattn.config import check_block_size
from pagedattn.core import EngineCore, StepMetrics
from pagedattn.cuda_graphs import DecodeGraphs, use_cuda_graphs
from pagedattn.executor import ModelExecutor, ModelRunner
from pagedattn.memory import AllocStatus, KVManager
from pagedattn.memory.systems import SYSTEMS, make_kv_manager
from pagedattn.model.loader import eos_token_ids, load_for_engine
from pagedattn.output_processor import OutputProcessor
from pagedattn.sampling import Sampler, make_generator
from pagedattn.scheduler import Scheduler
from pagedattn.sequence import RequestOutput, SamplingParams, Sequence, SequenceGroup, as_int, as_token_ids


@dataclass
class EngineArgs:
    """Engine configuration (vLLM's names where vLLM has the setting).

    ``kv_manager``: the system (``memory.systems.SYSTEMS``: ``paged``; ``orca_max`` / ``orca_pow2`` /
    ``orca_oracle``; ``static``, FasterTransformer's static batching over Orca (Max)'s reservation), or a KV manager
    passed built to ``LLMEngine``. The KV budget: ``num_slots`` token slots, the same for every system (§6.1 holds
    it fixed), or ``num_gpu_blocks`` blocks of ``block_size`` (default 16) tokens, or as many as ``kv_cache_memory``
    bytes hold (default: 80 % of free GPU memory on CUDA, 256 MiB on the CPU), capped at ``max_num_seqs``
    full-length sequences. ``num_cpu_blocks=None`` gives swap mode as many CPU blocks as device blocks (recompute:
    none). Options that size or configure the KV manager are refused, naming them, when it is passed built."""

    kv_manager: str = "paged"
    block_size: int | None = None
    num_gpu_blocks: int | None = None
    num_slots: int | None = None
    kv_cache_memory: int | None = None
    num_cpu_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    watermark: float = 0.01
    attention_backend: str = "auto"
    device: str | None = None
    dtype: Any = None
    enable_prefix_caching: bool = False
    max_step_metrics: int | None = 10_000  # the last steps kept in ``step_metrics`` (None: all, 0: none)
    # CPU threads (for the whole process): torch's (``torch.set_num_threads``), which the matmuls use, and the C++
    # decode attention's (``kernels.cpu.set_threads``). None leaves both settings; the benchmarks run with 1
    threads: int | None = None
    # vLLM's name: True runs every step eagerly; False (default) replays decode steps as CUDA graphs, one per
    # batch-size bucket (``cuda_graphs``), where they can be taken: a CUDA device with the Triton backend (never on a
    # CPU, where this is ignored)
    enforce_eager: bool = False


#: ``EngineArgs``' options that size or configure a KV manager: refused with one passed built
KV_OPTIONS = ("block_size", "num_gpu_blocks", "num_slots", "kv_cache_memory", "num_cpu_blocks")


class StepMetricsRing(deque):
    """``LLMEngine.step_metrics``: the last ``maxlen`` steps' ``core.StepMetrics``, oldest first. A bounded ring, so
    that a server running for days keeps a fixed amount; it also takes slices (``ring[-10:]``) as a list does."""

    def __getitem__(self, key):
        return list(self)[key] if isinstance(key, slice) else super().__getitem__(key)


def make_kv(args: EngineArgs, config, dtype: torch.dtype, device: torch.device, max_model_len: int) -> KVManager:
    """The KV manager of ``args.kv_manager`` (``memory.systems.make_kv_manager``) over the budget of ``args``:
    ``num_slots``, or ``num_gpu_blocks`` blocks, or as many blocks as ``kv_cache_memory`` bytes hold (80 % of free
    GPU memory on CUDA, 256 MiB on the CPU), at most ``max_num_seqs`` full-length sequences."""
    if args.num_slots is not None and args.num_gpu_blocks is not None:
        raise ValueError("give the KV budget once: num_slots or num_gpu_blocks, not both")
    block_size = 16 if args.block_size is None else args.block_size
    check_block_size(block_size)
    slots = args.num_slots
    if slots is None:
        blocks = args.num_gpu_blocks
        if blocks is None:
            num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            elem = torch.empty((), dtype=dtype).element_size()
            block_bytes = 2 * config.num_hidden_layers * num_kv * head_dim * block_size * elem
            budget = args.kv_cache_memory
            if budget is None:
                budget = int(0.8 * torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else 256 << 20
            cap = args.max_num_seqs * -(-max_model_len // block_size)
            blocks = max(1, min(budget // block_bytes, cap))
        slots = blocks * block_size
    cpu = args.num_cpu_blocks
    if cpu is None:
        cpu = slots // block_size if args.preemption_mode == "swap" and args.kv_manager == "paged" else 0
    return make_kv_manager(args.kv_manager, slots, block_size, max_model_len, cpu, args.watermark,
                           enable_prefix_caching=args.enable_prefix_caching)


def tokenize(prompt, tokenizer) -> tuple[str | None, list[int]]:
    """A prompt's text (None for token ids) and token ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids or LLMEngine(tokenizer=...)")
        return prompt, list(tokenizer(prompt)["input_ids"])
    return None, as_token_ids(prompt)


def check_request(token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                  max_num_seqs: int) -> None:
    """Raise ``ValueError``, naming the limit, for a request that the engine could never serve."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    if not token_ids:
        raise ValueError("empty prompt: a request needs at least 1 prompt token")
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
    if params.num_seqs > max_num_seqs:  # its sequences run together (§4.4): it would never start
        kind = "beam_width" if params.use_beam_search else "best_of" if params.best_of else "n"
        raise ValueError(f"{kind}={params.num_seqs} sequences of one request exceed max_num_seqs={max_num_seqs}, "
                         "the most the scheduler runs at once")
    if len(token_ids) > max_model_len:
        raise ValueError(f"prompt of {len(token_ids)} tokens exceeds the model maximum max_model_len={max_model_len}")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (vocab_size={vocab_size})")
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise ValueError(f"stop token id {bad[0]} is outside the vocabulary (vocab_size={vocab_size})")


class LLMEngine:
    """Continuous batching over a paged KV cache (or any system's KV manager): the engine core
    (``core.EngineCore``) with a model executor (``executor.ModelExecutor``). The keyword arguments are
    ``EngineArgs``' fields; ``kv_manager`` is a system's name or a KV manager passed built."""

    def __init__(self, model, tokenizer=None, kv_manager: str | KVManager = "paged", *, block_size: int | None = None,
                 num_gpu_blocks: int | None = None, num_slots: int | None = None, kv_cache_memory: int | None = None,
                 num_cpu_blocks: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                 preemption_mode: Literal["recompute", "swap"] = "recompute", watermark: float = 0.01,
                 attention_backend: str = "auto", device: str | None = None, dtype: Any = None,
                 enable_prefix_caching: bool = False, max_step_metrics: int | None = 10_000,
                 threads: int | None = None, enforce_eager: bool = False) -> None:
        built = None if isinstance(kv_manager, str) else kv_manager
        self.args = args = EngineArgs(
            "paged" if built is not None else cast(str, kv_manager), block_size, num_gpu_blocks, num_slots,
            kv_cache_memory, num_cpu_blocks, max_num_seqs, max_num_batched_tokens, max_model_len, preemption_mode,
            watermark, attention_backend, device, dtype, enable_prefix_caching, max_step_metrics, threads,
            enforce_eager)
        if built is not None:
            given = [f"{k}={getattr(args, k)!r}" for k in KV_OPTIONS if getattr(args, k) is not None
                     and not (k == "block_size" and args.block_size == built.block_size)]
            given += ["enable_prefix_caching=True"] if args.enable_prefix_caching else []
            if given:
                raise ValueError(f"{', '.join(given)} would be ignored: the KV manager was passed built (block size "
                                 f"{built.block_size}); give them to its constructor, or pass kv_manager by name")
        elif args.kv_manager not in SYSTEMS:
            raise ValueError(f"unknown system kv_manager={args.kv_manager!r}; known: {list(SYSTEMS)}")
        if args.threads is not None:
            if args.threads < 1:
                raise ValueError(f"threads={args.threads}: at least one thread")
            torch.set_num_threads(args.threads)
            kernels.cpu.set_threads(args.threads)
        self.model, self.tokenizer = load_for_engine(model, tokenizer, args.dtype,
                                                     torch.device(args.device) if args.device else None)
        param = next(self.model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if self.device.type == "cpu" and self.dtype == torch.bfloat16 and not bf16_in_hardware():
            warnings.warn("bfloat16 on a CPU without AMX or AVX-512 BF16: its matmuls run emulated, many times slower "
                          "than float32 (28x on an AVX2-only VM); dtype=torch.float32 is faster here", stacklevel=2)
        config: Any = self.model.config  # a transformers config
        self.vocab_size = config.vocab_size
        self.max_model_len = min(args.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        self.kv: KVManager = built if built is not None else \
            make_kv(args, config, self.dtype, self.device, self.max_model_len)
        max_tokens = args.max_num_batched_tokens or max(self.max_model_len, 2048)
        self.scheduler = Scheduler(SchedulerConfig(args.max_num_seqs, max_tokens, self.max_model_len,
                                                   args.preemption_mode), self.kv,
                                   static_batching=built is None and SYSTEMS[args.kv_manager].static_batching,
                                   lay_out_plans=True)
        self.scheduler.split_samples = True  # samples that cannot be swapped are recomputed one by one
        self.backend = kernels.get_backend(args.attention_backend)
        self.runner = ModelRunner(self.model, self.kv.cache_layout(), self.backend, self.device, self.dtype)
        if use_cuda_graphs(self.device, self.backend, args.enforce_eager):  # captured at start-up, as vLLM does
            self.runner.graphs = DecodeGraphs(self.model, args.max_num_seqs,
                                              -(-self.max_model_len // self.runner.block_size), self.device)
            self.runner.graphs.capture_all()
        self.sampler = Sampler(eos_token_ids(self.model, self.tokenizer), self.max_model_len, self.tokenizer)
        self.processor = OutputProcessor(self.tokenizer)
        if args.max_step_metrics is not None and (as_int(args.max_step_metrics) is None or args.max_step_metrics < 0):
            raise ValueError(f"max_step_metrics must be None or an integer >= 0, got {args.max_step_metrics!r}")
        self.core = EngineCore(self.scheduler, ModelExecutor(self.runner, self.sampler, self.now), self.now,
                               record_steps=args.max_step_metrics != 0,
                               steps=StepMetricsRing(maxlen=args.max_step_metrics))
        self._seq_ids = itertools.count()

    @classmethod
    def from_engine_args(cls, model, engine_args: EngineArgs, tokenizer=None, kv_manager: KVManager | None = None
                         ) -> "LLMEngine":
        kw = asdict(engine_args)
        name = kw.pop("kv_manager")
        return cls(model, tokenizer, kv_manager if kv_manager is not None else name, **kw)

    @property
    def step_metrics(self) -> StepMetricsRing:
        """The last ``max_step_metrics`` steps' ``core.StepMetrics``, oldest first."""
        return cast(StepMetricsRing, self.core.steps)

    @property
    def num_steps(self) -> int:
        """Steps run since the start (``step_metrics`` keeps the last ones)."""
        return self.core.num_steps

    @staticmethod
    def now() -> float:
        """The engine's clock (``time.perf_counter``); pass arrival times on it."""
        return time.perf_counter()

    @property
    def requests(self) -> dict[str, SequenceGroup]:
        """The unfinished requests, by id."""
        return self.processor.requests

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Tokens that end a sequence (unless ``ignore_eos``): the model config's and the tokenizer's."""
        return self.sampler.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: frozenset[int]) -> None:
        self.sampler.eos_token_ids = frozenset(ids)

    # -------------------------------------------------------------------------------------- requests
    def add_request(self, request_id: str, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None, prefix_len: int = 0) -> None:
        """Queue a request; raises ``ValueError`` (naming the limit) for a request that can never be served.

        ``prefix_len`` marks the prompt's first tokens as a prefix shared with other requests (the paper's §4.4
        shared prefix, Fig. 16): its full blocks are computed once and kept. With ``enable_prefix_caching`` every
        prompt's cached prefix is found automatically."""
        params = SamplingParams() if sampling_params is None else sampling_params
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, token_ids = tokenize(prompt, self.tokenizer)
        check_request(token_ids, params, self.vocab_size, self.max_model_len, self.args.max_num_seqs)
        self.sampler.check(params)
        if params.use_beam_search:  # its k beams must fit in the pool together, even alone (§4.4)
            beam_search.check_fits(self.kv, len(token_ids), params, self.max_model_len)
        if as_int(prefix_len) is None or prefix_len < 0:
            raise ValueError(f"prefix_len must be an integer >= 0, got {prefix_len!r}")
        seqs = [Sequence(next(self._seq_ids), token_ids) for _ in range(params.num_seqs)]
        group = SequenceGroup(request_id, seqs, params, self.now() if arrival_time is None else arrival_time, text)
        group.prefix_len = max(0, min(int(prefix_len), len(token_ids)))
        if params.use_beam_search:
            beam_search.init_group(group, self.eos_token_ids, self.max_model_len)
        if self.kv.can_allocate(group) is AllocStatus.NEVER:
            raise ValueError(self.kv.never_reason(group))
        self.processor.add(group)
        self.sampler.add(request_id, make_generator(params.seed, self.device))
        self.scheduler.add(group)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests wherever they are (waiting, running or swapped) and free their blocks."""
        ids = {request_id} if isinstance(request_id, str) else set(request_id)
        for g in self.scheduler.abort_many(ids):
            self._forget(g.request_id)

    abort = abort_request

    def _forget(self, request_id: str) -> None:
        self.processor.forget(request_id)
        self.sampler.forget(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------------------------------- step
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One iteration (``core.EngineCore.step``: schedule, execute, update), then the outputs: of the scheduled
        requests (``finished_only``: of those that finished this step) and of the requests refused this step."""
        plan, finished = self.core.step()
        assert plan is not None  # (None only within the simulator's runs of steady decode steps)
        outputs = []
        for g in plan.ignored:  # refused by the scheduler: they can never be served
            outputs.append(self.processor.output(g))
            self._forget(g.request_id)
        for g in finished:
            if g.root.is_finished():  # (a sample split off a request: when its last sample is done)
                self._forget(g.request_id)
        return outputs + self.processor.outputs(plan.scheduled_groups, finished_only)

    def step_metrics_frame(self):
        import pandas as pd

        rows = []
        for m in self.step_metrics:
            row = {f: getattr(m, f) for f in StepMetrics._fields if f != "memory"}
            rows.append({**row, "overhead_time": m.overhead_time})
        return pd.DataFrame(rows)

    # ------------------------------------------------------------------------------------- invariants
    def check_invariants(self) -> None:
        """Assert that the engine's bookkeeping agrees with its KV manager (tests call it after every step):
        the manager's own invariants (§4.2-§4.5); every unfinished request sits in exactly one scheduler queue; a
        waiting sequence holds no blocks; a running (swapped) sequence's blocks are on the device (CPU) and hold
        the K/V of all its tokens but the last sampled one; a finished sequence holds no blocks; at most
        ``max_num_seqs`` sequences run."""
        s = self.scheduler
        self.kv.check_invariants()
        queued = [(g, q) for q in ("waiting", "running", "swapped") for g in getattr(s, q)]
        roots = {id(g.root): g.root for g, _ in queued}  # a request split into samples is queued once per sample
        ids = [g.request_id for g in roots.values()]
        assert len(ids) == len(set(ids)) and set(ids) == set(self.requests), "requests and scheduler queues disagree"
        assert s.num_running_seqs() <= self.args.max_num_seqs, "more running sequences than max_num_seqs"
        for g, status in queued:
            assert self.requests[g.request_id] is g.root and not g.is_finished(), f"{g} is finished but queued"
            for q in g.seqs:
                where = self.kv.location(q.seq_id)
                if q.is_finished():
                    assert where is None, f"finished {q} still holds blocks"
                    continue
                assert q.status == status, f"{q} is {q.status} in the {status} queue"
                if status == "waiting":
                    assert where is None, f"waiting {q} holds blocks"
                else:
                    assert where == ("gpu" if status == "running" else "cpu", q.get_len() - 1), f"{q}: {where}"
