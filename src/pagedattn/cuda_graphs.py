"""CUDA graphs for decode steps, one per batch-size bucket, as vLLM's v0 model runner captures them (issue 54).

A decode step of a small model on a GPU is bound by the host: the H200 profile of issue 54 counted about 1,460 kernel
launches per step and the GPU busy 34 % of the time. A CUDA graph records a step's launches once and replays them as
one. vLLM v0 (``vllm/worker/model_runner.py``: ``_BATCH_SIZES_TO_CAPTURE``, ``_get_graph_batch_size``,
``GPUModelRunnerBase.capture_model``, ``CUDAGraphRunner``; read, not copied) captures decode steps only, one graph per
batch size of 1, 2, 4 and every multiple of 8 up to ``max_num_seqs``, pads a batch up to the next captured size, and
runs everything else eagerly; ``enforce_eager=True`` turns graphs off. So does :class:`DecodeGraphs`:

- **Buckets** (:func:`batch_sizes_to_capture`, :func:`graph_batch_size`): 1, 2, 4, 8, 16, 24, ... up to
  ``max_num_seqs`` rounded up to a bucket. A decode batch of ``n`` sequences runs in the smallest bucket ``>= n``.
  Prefill steps, and decode steps that do not fit (:meth:`DecodeGraphs.fits`), run eagerly.
- **Static input buffers** (:class:`DecodeBuffers`), sized for the largest bucket and shared by every bucket's graph
  (vLLM slices one ``input_tokens`` buffer per batch size the same way): input ids, positions, slot mapping, context
  lengths, and block tables at a fixed width, the blocks of ``max_model_len`` tokens (vLLM's
  ``get_max_block_per_batch``, from ``max_seq_len_to_capture``).
- **Padding**: rows ``n .. bucket - 1`` get slot :data:`PAD_SLOT_ID` (-1: every backend's KV-cache write skips a
  negative slot, as vLLM's ``_PAD_SLOT_ID``) and context length 0 (the attention kernels read no key for it and
  return zeros; vLLM pads with length 1 over block 0). Their block-table rows are never read and their outputs are
  dropped, so a padded row writes no cache slot and reads none.
- **Capture** (:meth:`DecodeGraphs.capture`): at start-up, largest bucket first, into one shared memory pool, as
  vLLM does; each after :data:`NUM_WARMUP_ITERS` eager runs (Triton compiles its kernels there, outside the capture).
  The buffers hold only padding while capturing, so capture touches no cache slot (a bucket not captured yet is
  captured on first use, also safely mid-run).
- **Replay** (:meth:`DecodeGraphs.forward`): copy the step's inputs into the buffers' first ``n`` rows and padding
  after them, replay, return the first ``n`` rows of the bucket's hidden states; the LM head runs eagerly on them
  (vLLM's ``compute_logits`` also runs outside the graph).

**Fixed at capture**, and the same at every replay of a bucket:
- the tensors: the static buffers, the KV caches bound to the model when it was captured (the runner's own), the
  model's weights (a weight replaced by another tensor afterwards is not seen), the graph's intermediates;
- every host-side decision of the forward pass. The Triton attention's launch plan (``plan_paged_attention``:
  split-KV or not, the partition size and the number of partitions) depends only on the batch (the bucket) and the
  block table's width (its ``max_context_len`` default: the blocks of ``max_model_len``), never on the step's context
  lengths: each bucket is planned for ``max_model_len``, as vLLM's old runner planned for
  ``max_context_len_to_capture``. Partitions past a sequence's context are empty and the reduce kernel reads only
  the sequence's own ones;
- the metadata's Python ints: a graph's ``AttentionMetadata`` has no ``context_lens_list`` / ``query_start_loc``
  (:class:`NotKnownAtCapture` raises when read), so a decode path that read them, or branched on them, fails loudly
  (in the CPU tests too) rather than replaying the values of the capture.

Graphs are taken only where they can be (:func:`use_cuda_graphs`): on a CUDA device with the compiled Triton backend.
The torch reference plans a decode step from its context lengths on the host (``plan_decode``), which a graph cannot
replay, and a CPU has no graphs. ``DecodeGraphs(..., capture=False)`` runs the same padded static-buffer path
eagerly: the tests' way to check on a CPU everything but the capture itself.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from pagedattn.kernels import KernelBackend
from pagedattn.model.attention import AttentionMetadata

__all__ = ["BATCH_SIZE_ALIGNMENT", "PAD_SLOT_ID", "NUM_WARMUP_ITERS", "graph_batch_size", "batch_sizes_to_capture",
           "use_cuda_graphs", "DecodeBuffers", "DecodeGraphs", "NotKnownAtCapture"]

#: buckets above 4 are multiples of this (vLLM's ``_BATCH_SIZE_ALIGNMENT``)
BATCH_SIZE_ALIGNMENT = 8
#: the slot of a padded row: the KV-cache write skips it (vLLM's ``_PAD_SLOT_ID``)
PAD_SLOT_ID = -1
#: eager runs of a bucket before its capture (vLLM's ``_NUM_WARMUP_ITERS``)
NUM_WARMUP_ITERS = 2


def graph_batch_size(batch_size: int) -> int:
    """The bucket a decode batch of ``batch_size`` sequences is padded to: 1, 2, 4, then the next multiple of
    ``BATCH_SIZE_ALIGNMENT`` (vLLM's ``_get_graph_batch_size``)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if batch_size <= 2:
        return batch_size
    if batch_size <= 4:
        return 4
    return -(-batch_size // BATCH_SIZE_ALIGNMENT) * BATCH_SIZE_ALIGNMENT


def batch_sizes_to_capture(max_num_seqs: int) -> list[int]:
    """The buckets captured for a scheduler of ``max_num_seqs``: 1, 2, 4 and the multiples of 8, up to
    ``graph_batch_size(max_num_seqs)`` (vLLM's ``_BATCH_SIZES_TO_CAPTURE`` cut at ``_get_max_graph_batch_size``), so
    every decode batch the scheduler can form has a bucket."""
    top = graph_batch_size(max_num_seqs)
    return [b for b in (1, 2, 4) if b <= top] + list(range(BATCH_SIZE_ALIGNMENT, top + 1, BATCH_SIZE_ALIGNMENT))


def use_cuda_graphs(device: torch.device, backend: KernelBackend, enforce_eager: bool) -> bool:
    """Whether the engine captures decode steps: unless ``enforce_eager``, on a CUDA device with the compiled Triton
    backend (whose decode launches depend on shapes only; the torch backend plans on the host)."""
    return not enforce_eager and device.type == "cuda" and backend.name == "triton" and not backend.interpreted


class NotKnownAtCapture(list):
    """A graph's stand-in for ``AttentionMetadata.context_lens_list`` / ``query_start_loc``: per-step Python ints
    that a captured step cannot see. Reading it raises."""

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a captured decode step read the step's Python-int metadata (context_lens_list / "
                           "query_start_loc): a CUDA graph replays the values of its capture; use the tensors")

    __len__ = __iter__ = __getitem__ = __contains__ = __reversed__ = _refuse  # type: ignore[assignment]


@dataclass
class DecodeBuffers:
    """The static inputs of every bucket's graph: rows ``[:bucket]`` of tensors sized for the largest bucket."""

    input_ids: Tensor     # long [B]
    positions: Tensor     # long [B]
    slot_mapping: Tensor  # long [B]
    block_tables: Tensor  # int32 [B, max_blocks]
    context_lens: Tensor  # int32 [B]

    @classmethod
    def allocate(cls, max_batch_size: int, max_blocks: int, device: torch.device) -> "DecodeBuffers":
        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(zeros(max_batch_size), zeros(max_batch_size),
                   torch.full((max_batch_size,), PAD_SLOT_ID, dtype=torch.long, device=device),
                   zeros(max_batch_size, max_blocks, dtype=torch.int32), zeros(max_batch_size, dtype=torch.int32))

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    def _padded(self) -> tuple[tuple[Tensor, int], ...]:
        """Each per-row buffer with the value of a padded row: token 0 at position 0, slot ``PAD_SLOT_ID``, context
        length 0 (block tables are never read for a padded row)."""
        return ((self.input_ids, 0), (self.positions, 0), (self.slot_mapping, PAD_SLOT_ID), (self.context_lens, 0))

    def load(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, bucket: int) -> None:
        """Rows ``[:n]``: the step's ``n`` decode tokens (block tables zero past their width); rows ``[n:bucket]``:
        padding."""
        n, width = input_ids.shape[0], meta.block_tables.shape[1]
        for (buf, pad), src in zip(self._padded(), (input_ids, positions, meta.slot_mapping, meta.context_lens)):
            buf[:n].copy_(src)
            buf[n:bucket].fill_(pad)
        self.block_tables[:n, :width].copy_(meta.block_tables)
        self.block_tables[:n, width:].zero_()

    def pad(self, bucket: int) -> None:
        """Every row of ``bucket`` padding (what a capture runs on)."""
        for buf, pad in self._padded():
            buf[:bucket].fill_(pad)

    def metadata(self, bucket: int) -> AttentionMetadata:
        """The decode metadata over rows ``[:bucket]``: tensors only."""
        return AttentionMetadata(is_prefill=False, slot_mapping=self.slot_mapping[:bucket],
                                 block_tables=self.block_tables[:bucket], context_lens=self.context_lens[:bucket],
                                 query_start_loc=NotKnownAtCapture(), context_lens_list=NotKnownAtCapture())


class DecodeGraphs:
    """The decode steps of one model runner as CUDA graphs, one per bucket (see the module docstring).

    ``model(input_ids, positions, meta) -> hidden`` is the runner's model, bound to the runner's KV caches;
    ``max_blocks`` the block-table width of ``max_model_len``. ``capture=False`` (tests, on a CPU) runs the same
    padded static-buffer path eagerly and never captures."""

    def __init__(self, model: nn.Module, max_num_seqs: int, max_blocks: int, device: torch.device,
                 capture: bool = True) -> None:
        self.model, self.device, self.capture_graphs = model, device, capture
        self.batch_sizes = batch_sizes_to_capture(max_num_seqs)
        with torch.inference_mode():  # written under inference mode only (the runner's forward)
            self.buffers = DecodeBuffers.allocate(self.batch_sizes[-1], max_blocks, device)
        self.graphs: dict[int, Any] = {}  # bucket -> torch.cuda.CUDAGraph
        self.outputs: dict[int, Tensor] = {}  # bucket -> its graph's hidden states [bucket, hidden]
        self.pool: Any = None  # the memory pool all graphs share (vLLM's ``graph_memory_pool``)

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def fits(self, meta: AttentionMetadata) -> bool:
        """Whether a step runs in a graph: a decode step of at most the largest bucket's sequences, whose block
        tables fit the buffers' width."""
        return (not meta.is_prefill and 0 < meta.block_tables.shape[0] <= self.max_batch_size
                and meta.block_tables.shape[1] <= self.buffers.max_blocks)

    def _run(self, bucket: int) -> Tensor:
        """The model over the buffers' rows ``[:bucket]`` (what a graph records)."""
        b = self.buffers
        return self.model(b.input_ids[:bucket], b.positions[:bucket], b.metadata(bucket))

    @torch.inference_mode()
    def capture(self, bucket: int) -> None:
        """Warm up and capture ``bucket``'s graph over padding only (no cache slot is read or written)."""
        self.buffers.pad(bucket)
        for _ in range(NUM_WARMUP_ITERS):
            self._run(bucket)
        torch.cuda.synchronize(self.device)
        graph, out = self._record(lambda: self._run(bucket))
        torch.cuda.synchronize(self.device)
        self.pool = graph.pool()
        self.graphs[bucket], self.outputs[bucket] = graph, out

    def _record(self, fn: Callable[[], Tensor]) -> tuple[Any, Tensor]:
        """Capture ``fn``'s launches into a CUDA graph in the shared pool; returns the graph and ``fn``'s output,
        which each replay rewrites in place."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        return graph, out

    def capture_all(self) -> None:
        """Capture every bucket, largest first (vLLM: it may reduce the memory the shared pool needs)."""
        for bucket in reversed(self.batch_sizes):
            if bucket not in self.graphs:
                self.capture(bucket)

    def forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata) -> Tensor:
        """The hidden states of a decode step that :meth:`fits`: its ``n`` rows, padded to the bucket, run through
        the bucket's graph (or eagerly with ``capture=False``); returns rows ``[:n]``."""
        n = input_ids.shape[0]
        bucket = graph_batch_size(n)
        if self.capture_graphs and bucket not in self.graphs:
            self.capture(bucket)
        self.buffers.load(input_ids, positions, meta, bucket)
        if not self.capture_graphs:
            return self._run(bucket)[:n]
        self.graphs[bucket].replay()
        return self.outputs[bucket][:n]
