"""The serving engine (paper §4, Fig. 4): ``LLMEngine`` (add_request / step / abort) and the ``LLM`` facade.

One ``step()`` is one iteration of iteration-level batching (§4.5): the scheduler picks the groups to run and the
block moves (swap, copy-on-write); the ``ModelRunner`` performs the moves and one forward pass through the paged KV
cache (§4.1); the sampler picks one token per sequence (§4.4 for n > 1); finished sequences free their blocks.
Prefill and decode steps never mix (vLLM v0). Names and behaviour follow vLLM.

Bad input is isolated per request: ``add_request`` raises ``ValueError`` naming the limit (empty prompt, prompt over
``max_model_len``, more blocks than the whole pool, unknown token or stop id, ...); ``LLM.generate`` turns that
into a ``RequestOutput`` with ``error`` and finish reason ``"error"`` while the other requests run normally.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn

from pagedattn import beam_search, kernels
from pagedattn.config import SchedulerConfig
from pagedattn.executor import ModelRunner, cache_layout
from pagedattn.memory.block_manager import AllocStatus, BlockManager
from pagedattn.model.attention import PagedAttention
from pagedattn.model.loader import _resolve_dtype, load_model
from pagedattn.sampling import SamplingRow, check_stop, make_generator, sample
from pagedattn.scheduler import Scheduler
from pagedattn.sequence import (CompletionOutput, RequestOutput, SamplingParams, Sequence, SequenceGroup, as_int,
                                as_token_ids)


@dataclass
class EngineArgs:
    """Engine configuration (vLLM's names). ``num_gpu_blocks=None`` sizes the device pool from ``kv_cache_memory``
    bytes (default: 80 % of free GPU memory on CUDA, 256 MiB on the CPU), capped at ``max_num_seqs`` full-length
    sequences. ``num_cpu_blocks=None`` gives swap mode as many CPU blocks as device blocks (recompute: none)."""

    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory: int | None = None
    num_cpu_blocks: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    preemption_mode: str = "recompute"
    watermark: float = 0.01
    attention_backend: str = "auto"
    device: str | None = None
    dtype: Any = None
    enable_prefix_caching: bool = False


@dataclass
class StepMetrics:
    """One engine step. ``slots_filled`` counts the batch's context tokens (K/V held in the cache); ``blocks_used``
    is the device pool's used blocks (slots / block size for a contiguous manager)."""

    step: int
    kind: str  # "prefill" | "decode"
    batch_size: int  # sequences computed
    num_prefill_tokens: int
    num_batched_tokens: int
    blocks_used: int
    slots_filled: int
    num_preempted: int
    num_blocks_swapped: int
    num_blocks_copied: int
    step_time: float
    forward_time: float
    num_running: int = 0  # groups in the scheduler's queues at the end of the step
    num_waiting: int = 0
    num_swapped: int = 0

    @property
    def overhead_time(self) -> float:
        """Time outside the model forward: scheduling, block tables, block moves, sampling, outputs."""
        return self.step_time - self.forward_time


def _eos_ids(model: nn.Module, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for src in (getattr(model.config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(src)
    return frozenset(ids)


class LLMEngine:
    """Continuous batching over a paged KV cache (or any KV manager with the scheduler's group API)."""

    def __init__(self, model, tokenizer=None, kv_manager=None, **kwargs) -> None:
        args = EngineArgs(**kwargs)
        self.args = args
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if isinstance(model, nn.Module) and any(isinstance(m, PagedAttention) for m in model.modules()):
            if args.dtype is not None or args.device is not None:  # one of ours: move it only when asked
                model = model.to(device, _resolve_dtype(args.dtype, model.config) if args.dtype is not None
                                 else next(model.parameters()).dtype)
            self.model = model
            device = next(self.model.parameters()).device
        else:
            is_path = isinstance(model, (str, Path))
            if is_path and tokenizer is None:
                tokenizer = _try_tokenizer(str(model))
            dtype = args.dtype
            if dtype is None:  # a model object keeps its dtype; a checkpoint runs in fp32 on the CPU
                dtype = (torch.float32 if device.type == "cpu" else None) if is_path else next(model.parameters()).dtype
            self.model = load_model(model, dtype, device)
        self.tokenizer = tokenizer
        self.device = device
        self.dtype = next(self.model.parameters()).dtype
        config = self.model.config
        self.vocab_size = config.vocab_size
        self.max_model_len = min(args.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        self.eos_token_ids = _eos_ids(self.model, tokenizer)
        if kv_manager is None:
            kv_manager = self._make_block_manager(args)
        self.kv = kv_manager
        max_tokens = args.max_num_batched_tokens or max(self.max_model_len, 2048)
        self.scheduler = Scheduler(SchedulerConfig(args.max_num_seqs, max_tokens, self.max_model_len,
                                                   args.preemption_mode), self.kv)
        self.backend = kernels.get_backend(args.attention_backend)
        bs = cache_layout(self.kv)[1]
        if self.backend.name == "triton" and bs & (bs - 1):
            raise ValueError(f"block_size={bs}: the Triton attention kernel needs a power of two "
                             "(attention_backend='torch' takes any block size)")
        self.runner = ModelRunner(self.model, self.kv, self.backend, device, self.dtype)
        self.requests: dict[str, SequenceGroup] = {}  # unfinished requests
        self.generators: dict[str, torch.Generator | None] = {}
        self.step_metrics: list[StepMetrics] = []
        self._seq_ids = itertools.count()
        self._step = 0

    @classmethod
    def from_engine_args(cls, model, engine_args: EngineArgs, tokenizer=None, kv_manager=None) -> "LLMEngine":
        return cls(model, tokenizer, kv_manager, **asdict(engine_args))

    # ----------------------------------------------------------------------------------------- setup
    def _make_block_manager(self, args: EngineArgs) -> BlockManager:
        a = self.model.config
        num_kv = getattr(a, "num_key_value_heads", None) or a.num_attention_heads
        head_dim = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
        elem = torch.empty((), dtype=self.dtype).element_size()
        block_bytes = 2 * a.num_hidden_layers * num_kv * head_dim * args.block_size * elem
        blocks = args.num_gpu_blocks
        if blocks is None:
            budget = args.kv_cache_memory
            if budget is None:
                budget = int(0.8 * torch.cuda.mem_get_info(self.device)[0]) if self.device.type == "cuda" else 256 << 20
            cap = args.max_num_seqs * -(-self.max_model_len // args.block_size)
            blocks = max(1, min(budget // block_bytes, cap))
        cpu = args.num_cpu_blocks
        if cpu is None:
            cpu = blocks if args.preemption_mode == "swap" else 0
        return BlockManager(args.block_size, blocks, cpu, args.watermark, self.max_model_len,
                            args.enable_prefix_caching)

    @staticmethod
    def now() -> float:
        """The engine's clock (``time.perf_counter``); pass arrival times on it."""
        return time.perf_counter()

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
        text, token_ids = self._tokenize(prompt)
        self._validate(token_ids, params)
        if as_int(prefix_len) is None or prefix_len < 0:
            raise ValueError(f"prefix_len must be an integer >= 0, got {prefix_len!r}")
        seqs = [Sequence(next(self._seq_ids), token_ids) for _ in range(params.num_seqs)]
        group = SequenceGroup(request_id, seqs, params, self.now() if arrival_time is None else arrival_time, text)
        group.prefix_len = max(0, min(int(prefix_len), len(token_ids)))
        if params.use_beam_search:
            beam_search.init_group(group, self.eos_token_ids, self.max_model_len)
        if self.kv.can_allocate(group) is AllocStatus.NEVER:
            raise ValueError(self.scheduler._never_message(group))
        self.requests[request_id] = group
        self.generators[request_id] = make_generator(params.seed, self.device)
        self.scheduler.add(group)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids or LLMEngine(tokenizer=...)")
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        return None, as_token_ids(prompt)

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if not token_ids:
            raise ValueError("empty prompt: a request needs at least 1 prompt token")
        if params.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
        if params.num_seqs > self.args.max_num_seqs:  # its sequences run together (§4.4): it would never start
            kind = "beam_width" if params.use_beam_search else "best_of" if params.best_of else "n"
            raise ValueError(f"{kind}={params.num_seqs} sequences of one request exceed max_num_seqs="
                             f"{self.args.max_num_seqs}, the most the scheduler runs at once")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt of {len(token_ids)} tokens exceeds the model maximum "
                             f"max_model_len={self.max_model_len}")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (vocab_size={self.vocab_size})")
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"stop token id {bad[0]} is outside the vocabulary (vocab_size={self.vocab_size})")
        if params.use_beam_search:  # its k beams must fit in the pool together, even alone (§4.4)
            beam_search.check_fits(self.kv, len(token_ids), params, self.max_model_len)

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Stop requests wherever they are (waiting, running or swapped) and free their blocks."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            if self.scheduler.abort(rid) is not None:
                self.requests.pop(rid, None)
                self.generators.pop(rid, None)

    abort = abort_request

    def check_invariants(self) -> None:
        """Assert that the engine's bookkeeping agrees with its KV manager (tests call it after every step):
        the block manager's own invariants (§4.2-§4.5); every unfinished request sits in exactly one scheduler
        queue; a waiting sequence holds no blocks; a running (swapped) sequence has a device (CPU) block table
        holding the K/V of all its tokens but the last sampled one; a finished sequence holds no blocks; at most
        ``max_num_seqs`` sequences run."""
        kv, s = self.kv, self.scheduler
        kv.check_invariants()
        queued = [(g, "waiting") for g in s.waiting] + [(g, "running") for g in s.running] + \
                 [(g, "swapped") for g in s.swapped]
        ids = [g.request_id for g, _ in queued]
        assert len(ids) == len(set(ids)) and set(ids) == set(self.requests), "requests and scheduler queues disagree"
        assert s.num_running_seqs() <= self.args.max_num_seqs, "more running sequences than max_num_seqs"
        if not isinstance(kv, BlockManager):
            return
        for g, status in queued:
            assert self.requests[g.request_id] is g and not g.is_finished(), f"{g} is finished but queued"
            for q in g.seqs:
                if q.is_finished():
                    assert q.seq_id not in kv.tables, f"finished {q} still holds blocks"
                    continue
                assert q.status == status, f"{q} is {q.status} in the {status} queue"
                if status == "waiting":
                    assert q.seq_id not in kv.tables, f"waiting {q} holds blocks"
                else:
                    t = kv.tables[q.seq_id]
                    assert t.device == ("gpu" if status == "running" else "cpu"), f"{q}: table on {t.device}"
                    assert t.num_tokens == q.get_len() - 1, f"{q}: {t.num_tokens} tokens in its table"

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------------------------------- step
    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """One iteration: schedule, move blocks, forward, sample, free. Returns the scheduled requests' outputs
        (``finished_only``: only those that finished this step, the others' outputs are not built)."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        outputs = [self._finish_with_error(g, g.error) for g in out.ignored]
        if out.is_empty():  # nothing ran: a lone group preempted itself or failed (progress), or nothing fits
            return outputs if out.preempted or out.ignored else outputs + self._unstick()
        self.runner.move_blocks(out)
        if not out.scheduled_groups:  # only swap-outs this step (the last running group preempted itself)
            return outputs
        inp = self.runner.prepare_input(out)
        blocks_used = self._blocks_used()
        logits, forward_time = self.runner.forward(inp)
        if len(inp.logits_rows) != logits.shape[0]:  # forks sample from their shared prompt's row
            logits = logits[torch.tensor(inp.logits_rows, device=logits.device)]
        # log-probabilities only rank the samples of n > 1 / best_of requests; greedy n = 1 skips them
        want_logprobs = any(len(g.seqs) > 1 for g in out.scheduled_groups)
        rows = inp.rows
        if any(beam_search.is_beam_group(g) for _, g in rows):  # beam groups pick their tokens together (§4.4)
            beam_search.step_groups(self, logits, rows)
            keep = [i for i, (_, g) in enumerate(rows) if not beam_search.is_beam_group(g)]
            rows, logits = [rows[i] for i in keep], logits[torch.tensor(keep, dtype=torch.long, device=logits.device)]
        tokens, logprobs = sample(logits, [SamplingRow(g.sampling_params, self.generators[g.request_id])
                                           for _, g in rows], want_logprobs) if rows else ([], None)
        now = self.now()
        for (s, g), tok, lp in zip(rows, tokens, logprobs or [0.0] * len(tokens)):
            s.num_computed_tokens = s.get_len()
            s.append_token(tok, lp)
            reason = check_stop(s, g.sampling_params, self.eos_token_ids, self.max_model_len)
            if reason is not None:
                s.finish(reason)
        groups = out.scheduled_groups
        for g in groups:
            if g.metrics.first_token_time is None:
                g.metrics.first_token_time = now
            if g.is_finished():
                g.metrics.finish_time = now
                self.requests.pop(g.request_id, None)
                self.generators.pop(g.request_id, None)
        self.scheduler.free_finished()
        outputs += [self._output(g) for g in groups if not finished_only or g.is_finished()]
        self._record(out, inp, t0, forward_time, blocks_used)
        return outputs

    def _blocks_used(self) -> int:
        kv = self.kv
        return kv.num_used_gpu_blocks if hasattr(kv, "num_used_gpu_blocks") else kv.arena.total - kv.arena.num_free

    def _record(self, out, inp, t0: float, forward_time: float, used: int) -> None:
        n_tokens = int(inp.input_ids.shape[0])
        self.step_metrics.append(StepMetrics(
            self._step, "prefill" if out.is_prefill else "decode", len(inp.meta.context_lens_list),
            n_tokens if out.is_prefill else 0, n_tokens, used, sum(inp.meta.context_lens_list), len(out.preempted),
            len(out.blocks_to_swap_in) + len(out.blocks_to_swap_out), len(out.blocks_to_copy),
            time.perf_counter() - t0, forward_time, len(self.scheduler.running), len(self.scheduler.waiting),
            len(self.scheduler.swapped)))
        self._step += 1

    def _unstick(self) -> list[RequestOutput]:
        """Nothing could be scheduled. The scheduler refuses a request that can never fit (a swapped-out group
        included), so with requests left this is a bug."""
        if self.scheduler.has_unfinished():
            raise RuntimeError("the scheduler made no progress with requests left")
        return []

    def _finish_with_error(self, g: SequenceGroup, message: str | None) -> RequestOutput:
        g.error = message
        for s in g.seqs:
            s.status, s.finish_reason = "finished", "error"
        g.metrics.finish_time = self.now()
        self.requests.pop(g.request_id, None)
        self.generators.pop(g.request_id, None)
        return self._output(g)

    def _output(self, g: SequenceGroup) -> RequestOutput:
        if beam_search.is_beam_group(g):  # the best beams, best first
            return RequestOutput(g.request_id, g.prompt, g.prompt_token_ids, beam_search.outputs(g, self.tokenizer),
                                 g.is_finished(), g.metrics, g.error)
        seqs = g.seqs
        if g.is_finished() and len(seqs) > g.sampling_params.n:  # best_of: keep the n most likely
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: g.sampling_params.n]
        tok = self.tokenizer
        outs = [CompletionOutput(i, tok.decode(s.output_token_ids, skip_special_tokens=True) if tok else None,
                                 list(s.output_token_ids), s.cumulative_logprob, s.finish_reason)
                for i, s in enumerate(seqs)]
        return RequestOutput(g.request_id, g.prompt, g.prompt_token_ids, outs, g.is_finished(), g.metrics, g.error)

    # --------------------------------------------------------------------------------------- metrics
    def step_metrics_frame(self):
        import pandas as pd

        return pd.DataFrame([{**asdict(m), "overhead_time": m.overhead_time} for m in self.step_metrics])


def _try_tokenizer(path: str):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception:  # no tokenizer files next to the weights: token-id prompts only
        return None


def error_output(request_id: str, prompt, message: str) -> RequestOutput:
    """The output of a request rejected before it reached the scheduler."""
    from pagedattn.sequence import RequestMetrics

    now = LLMEngine.now()
    try:
        ids = as_token_ids(prompt)
    except ValueError:
        ids = []
    return RequestOutput(request_id, prompt if isinstance(prompt, str) else None, ids,
                         [CompletionOutput(0, None, [], 0.0, "error")], True, RequestMetrics(now, None, now), message)


def _prompt_list(prompts) -> list:
    """``generate``'s prompts as a list of per-request prompts: one string or one sequence of token ids is a single
    prompt; a list (or tuple, or 2-d array) holds one prompt per request, each checked by ``add_request``."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (bytes, dict, set)) or not hasattr(prompts, "__len__") or getattr(prompts, "ndim", 1) == 0:
        raise ValueError(f"prompts must be a string, a sequence of integer token ids, or a list of those; got "
                         f"{type(prompts).__name__}")
    if len(prompts) and as_int(prompts[0]) is not None:  # one prompt of token ids
        return [prompts]
    return list(prompts)


def _params_from_dict(sp: dict) -> SamplingParams:
    try:
        return SamplingParams(**sp)
    except TypeError as e:  # an unknown key
        raise ValueError(f"sampling_params: {e}") from None


class LLM:
    """Offline batched generation (vLLM's ``LLM``): ``LLM(model).generate(prompts, sampling_params)``."""

    def __init__(self, model, tokenizer=None, **engine_kwargs) -> None:
        self.engine = LLMEngine(model, tokenizer, **engine_kwargs)
        self._counter = itertools.count()

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt (text, or token ids); outputs come back in input order. A prompt that can
        never be served gets an output with ``error`` set and finish reason ``"error"``; the others still run."""
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, (SamplingParams, dict)):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)):
            raise ValueError(f"sampling_params must be a SamplingParams, a dict, or a list of those; got "
                             f"{type(sampling_params).__name__}")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling_params for {len(prompts)} prompts")
        results: list[RequestOutput | None] = [None] * len(prompts)
        index: dict[str, int] = {}
        for i, (prompt, sp) in enumerate(zip(prompts, sampling_params)):
            rid = str(next(self._counter))
            try:
                if isinstance(sp, dict):
                    sp = _params_from_dict(sp)
                self.engine.add_request(rid, prompt, sp)
                index[rid] = i
            except ValueError as e:
                results[i] = error_output(rid, prompt, str(e))
        from tqdm.auto import tqdm

        with tqdm(total=len(prompts), desc="generate", disable=not use_tqdm, initial=len(prompts) - len(index)) as bar:
            while self.engine.has_unfinished_requests():
                for o in self.engine.step(finished_only=True):
                    if o.finished and o.request_id in index:
                        results[index.pop(o.request_id)] = o
                        bar.update(1)
        return results
