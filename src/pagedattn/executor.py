"""The model runner: owns the KV cache tensors, performs the scheduler's block moves, runs the forward pass.

Per step (paper §4.5 and §5), ``execute``: first the block swaps (``swap_out`` device -> CPU, ``swap_in`` CPU ->
device) and the copy-on-write copies (§4.4) that the scheduler decided, each as one batched tensor op with the mapping
as a tensor; then one forward pass over the flat batch of the step's new tokens; then the LM head on each sequence's
last token. The runner is the only code that touches the cache tensors.

The caches are built from the KV manager's layout (``KVManager.cache_layout()``, given at construction), so the same
runner serves the paged ``BlockManager`` (block size 16) and Orca's ``ContiguousKVManager`` (block size 1, one slot per
"block"). Per layer: a K and a V tensor of ``[num_blocks, block_size, num_kv_heads, head_dim]`` on the device and, for
swapping, the same on the CPU. The runner holds no KV manager (the scheduler owns it): where each token's K/V goes
(the slot mapping) and which blocks hold a sequence's context (its block table) come in the scheduler's plan
(``SchedulerOutputs.slot_mappings`` / ``block_tables``); the runner only flattens them into tensors.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor, nn

from pagedattn.cuda_graphs import DecodeGraphs
from pagedattn.kernels import KernelBackend
from pagedattn.memory.interface import copy_pairs
from pagedattn.model.attention import AttentionMetadata, PagedAttention
from pagedattn.scheduler import ModelOutput, SchedulerOutputs
from pagedattn.sequence import Sequence, SequenceGroup


@dataclass
class ModelInput:
    """A step's flat batch; ``rows`` lists, for each logits row to sample, its sequence and group."""

    input_ids: Tensor
    positions: Tensor
    meta: AttentionMetadata
    logits_indices: Tensor | None  # rows of the hidden states that feed the LM head (None: all of them)
    rows: list[tuple[Sequence, SequenceGroup]]
    logits_rows: list[int]  # for each entry of ``rows``, its row in the logits (forks share their prompt's row)


@dataclass
class StepResult:
    """What one executed step hands to the output processor: its input and one logits row per entry of
    ``inp.rows``."""

    inp: ModelInput
    logits: Tensor
    forward_time: float  # seconds in the model forward (the rest of the step is overhead)


class ModelRunner:
    """Executes ``SchedulerOutputs`` on a model with a paged KV cache."""

    def __init__(self, model: nn.Module, cache_layout: tuple[int, int, int], backend: KernelBackend,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.model, self.backend, self.device, self.dtype = model, backend, device, dtype
        self.attn_layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
        if not self.attn_layers:
            raise ValueError("the model has no PagedAttention layers")
        a = self.attn_layers[0]
        self.num_blocks, self.block_size, num_cpu_blocks = cache_layout  # (``KVLayout.cache_layout()``)
        if backend.name == "triton" and self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size}: the Triton attention kernel needs a power of two "
                             "(attention_backend='torch' takes any block size)")
        shape = (self.num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        cpu_shape = (num_cpu_blocks, self.block_size, a.num_kv_heads, a.head_dim)
        pin = device.type == "cuda"
        # Zero-filled: masked-out slots must hold finite values (0 * NaN would poison the attention sum).
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.attn_layers]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in self.attn_layers]
        self.k_cpu = [torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin) for _ in self.attn_layers]
        self.v_cpu = [torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin) for _ in self.attn_layers]
        self._bind_caches()
        #: decode steps as CUDA graphs (``cuda_graphs``), set by the engine where it takes them; None: all eager
        self.graphs: DecodeGraphs | None = None

    def _bind_caches(self) -> None:
        """Point every attention layer at its K/V cache and the kernel backend: once, and again only when another
        runner over the same model bound its own caches in between, or ``backend`` was replaced (profiling wraps
        it)."""
        for layer, k, v in zip(self.attn_layers, self.k_caches, self.v_caches):
            layer.k_cache, layer.v_cache, layer.backend = k, v, self.backend

    @property
    def kv_cache_bytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.k_caches + self.v_caches)

    def execute(self, out: SchedulerOutputs) -> StepResult | None:
        """One step's work on the device: the block moves, then, when groups run, the forward pass. Returns None
        when no forward pass ran (nothing scheduled, or only swap-outs)."""
        if out.is_empty():
            return None
        self.move_blocks(out)
        if not out.scheduled_groups:
            return None
        inp = self.prepare_input(out)
        logits, forward_time = self.forward(inp)
        if len(inp.logits_rows) != logits.shape[0]:  # forks sample from their shared prompt's row
            logits = logits[torch.tensor(inp.logits_rows, device=logits.device)]
        return StepResult(inp, logits, forward_time)

    # --------------------------------------------------------------------------------------- block moves
    def move_blocks(self, out: SchedulerOutputs) -> None:
        """Swap-outs, swap-ins, then copy-on-write copies, each batched over blocks (§4.4, §4.5)."""
        ops = self.backend
        if out.blocks_to_swap_out:
            m = torch.tensor(list(out.blocks_to_swap_out.items()), dtype=torch.long)
            for src, dst in zip(self.k_caches + self.v_caches, self.k_cpu + self.v_cpu):
                ops.swap_blocks(src, dst, m)
        if out.blocks_to_swap_in:
            m = torch.tensor(list(out.blocks_to_swap_in.items()), dtype=torch.long)
            for src, dst in zip(self.k_cpu + self.v_cpu, self.k_caches + self.v_caches):
                ops.swap_blocks(src, dst, m)
        if out.blocks_to_copy:
            m = torch.tensor(copy_pairs(out.blocks_to_copy), dtype=torch.long, device=self.device)
            ops.copy_blocks(self.k_caches, self.v_caches, m)

    # ------------------------------------------------------------------------------------------- inputs
    def prepare_input(self, out: SchedulerOutputs) -> ModelInput:
        """Flatten the step's new tokens. A prefill computes every uncached token of a group's sequence (forks
        share it, so one sequence per group is computed); a decode computes each running sequence's last token. Their
        slots and block tables are the plan's (``scheduler.lay_out``)."""
        bs = self.block_size
        plan_slots, plan_tables = out.slot_mappings, out.block_tables
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        ctx_lens: list[int] = []
        rows: list[tuple[Sequence, SequenceGroup]] = []
        logits_rows: list[int] = []
        if out.prefill_groups:
            loc = [0]
            for g in out.prefill_groups:
                seqs = g.get_seqs("running")
                s = seqs[0]
                start, n = s.num_computed_tokens, s.get_len()
                ids += s.token_ids[start:]
                positions += range(start, n)
                slots += plan_slots[s.seq_id]
                tables.append(plan_tables[s.seq_id])
                ctx_lens.append(n)
                loc.append(loc[-1] + n - start)
                logits_rows += [len(ctx_lens) - 1] * len(seqs)
                rows += [(x, g) for x in seqs]
            logits_indices = torch.tensor([i - 1 for i in loc[1:]], device=self.device)
        else:
            loc = []
            for g in out.decode_groups:
                for s in g.get_seqs("running"):
                    n = s.get_len()
                    ids.append(s.last_token_id)
                    positions.append(n - 1)
                    slots += plan_slots[s.seq_id]
                    tables.append(plan_tables[s.seq_id])
                    ctx_lens.append(n)
                    rows.append((s, g))
            logits_indices = None
            logits_rows = list(range(len(rows)))
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32,
                                    device=self.device)
        dev = self.device
        meta = AttentionMetadata(is_prefill=out.is_prefill,
                                 slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
                                 block_tables=block_tables,
                                 context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
                                 query_start_loc=loc, context_lens_list=ctx_lens)
        if not out.is_prefill and self.backend.plan_decode is not None:  # once per step, shared by every layer
            meta.decode_plan = self.backend.plan_decode(block_tables, meta.context_lens, bs, ctx_lens)
        return ModelInput(torch.tensor(ids, dtype=torch.long, device=dev),
                          torch.tensor(positions, dtype=torch.long, device=dev), meta, logits_indices, rows,
                          logits_rows)

    # ------------------------------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, inp: ModelInput) -> tuple[Tensor, float]:
        """Run the model; returns the logits (one row per computed sequence) and the forward time in seconds."""
        first = self.attn_layers[0]
        if first.k_cache is not self.k_caches[0] or first.backend is not self.backend:
            self._bind_caches()
        t0 = time.perf_counter()
        if self.graphs is not None and self.graphs.fits(inp.meta):  # a decode step: replay its bucket's graph
            hidden = self.graphs.forward(inp.input_ids, inp.positions, inp.meta)
        else:
            hidden = self.model(inp.input_ids, inp.positions, inp.meta)
        if inp.logits_indices is not None:
            hidden = hidden[inp.logits_indices]
        logits = cast(Any, self.model).compute_logits(hidden)  # (our models' LM head: model.opt / model.llama)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return logits, time.perf_counter() - t0


class ModelExecutor:
    """The real engine's executor (``core.Executor``): the ``ModelRunner``'s block moves and forward pass through
    the paged KV cache (§4.1), then the ``Sampler``'s tokens (§4.4), on the engine's clock."""

    def __init__(self, runner: ModelRunner, sampler, clock=time.perf_counter) -> None:
        self.runner, self.sampler, self.clock = runner, sampler, clock

    def execute(self, plan: SchedulerOutputs) -> ModelOutput | None:
        if plan.is_empty():
            return None
        result = self.runner.execute(plan)
        if result is None:  # only block moves ran (every running group was swapped out)
            return ModelOutput(now=self.clock(), forward_time=0.0)
        output = self.sampler(plan, result)
        output.forward_time = result.forward_time
        ctx = result.inp.meta.context_lens_list
        output.num_seqs, output.context_tokens = len(ctx), sum(ctx)
        return output
