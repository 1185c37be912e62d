"""Hugging Face baselines: ``generate()`` in static batches with its contiguous KV cache, and HF's own continuous
batching (``ContinuousBatchingManager``), on the same model and requests as our engine.

``generate()`` is FasterTransformer-like static batching (§6.1): a batch is left-padded, runs until its longest
request is done, and only then does the next batch start; the KV cache is contiguous, sized for the padded batch.
Each request still counts only its own output length (from the trace) as useful tokens.

Both report ``seconds`` as this process's CPU time (``time.process_time``, all threads, so HF's background batching
thread counts), like the real-engine driver in ``experiments.throughput``, and ``wall_seconds`` beside it.
"""
from __future__ import annotations

import time

import torch


@torch.inference_mode()
def generate_static(hf_model, prompts: list[list[int]], output_lens: list[int], batch_size: int,
                    pad_token_id: int = 0, progress=None) -> dict:
    """Run the requests in order, ``batch_size`` at a time, through ``hf_model.generate`` (greedy, EOS ignored).
    Returns wall seconds, the useful generated tokens and each request's tokens (cut to its own length)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = next(hf_model.parameters()).device
    outputs: list[list[int]] = []
    t0, w0 = time.process_time(), time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        ps, lens = prompts[i:i + batch_size], output_lens[i:i + batch_size]
        width, new = max(map(len, ps)), max(lens)
        ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in ps], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=device)
        out = hf_model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                eos_token_id=None, pad_token_id=pad_token_id)
        outputs += [row[width:width + n].tolist() for row, n in zip(out, lens)]
        if progress is not None:
            progress.update(len(ps))
    return {"seconds": time.process_time() - t0, "wall_seconds": time.perf_counter() - w0,
            "useful_tokens": int(sum(output_lens)), "outputs": outputs}


def continuous_batching(hf_model, prompts: list[list[int]], output_lens: list[int], num_slots: int,
                        max_requests: int, page_size: int = 16, timeout_s: float = 600.0,
                        allow_block_sharing: bool = True, on_start=None) -> dict:
    """HF's continuous batching (``transformers.generation.continuous_batching``) with ``num_slots`` token slots of
    paged KV cache (``num_slots / page_size`` pages), each request generating exactly its own output length.
    (Not under ``inference_mode``: HF's manager updates its tensors from a background thread.)
    ``allow_block_sharing``: HF's prefix cache (a finished request's pages stay held as cached prefixes);
    ``on_start(manager)`` is called once the manager runs, before any request is added (to watch its cache)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gc = GenerationConfig(max_new_tokens=max(output_lens), do_sample=False, eos_token_id=-1, pad_token_id=0)
    cfg = ContinuousBatchingConfig(page_size=page_size, num_blocks=max(1, num_slots // page_size),
                                   max_batch_tokens=2048, max_requests_per_batch=max_requests,
                                   allow_block_sharing=allow_block_sharing)
    t0, w0 = time.process_time(), time.perf_counter()
    results: dict = {}
    with hf_model.continuous_batching_context_manager(generation_config=gc, continuous_batching_config=cfg,
                                                      block=True, timeout=5) as manager:
        if on_start is not None:
            on_start(manager)
        for i, (p, n) in enumerate(zip(prompts, output_lens)):
            manager.add_request(list(p), request_id=f"r{i}", max_new_tokens=int(n), eos_token_id=-1)
        while len(results) < len(prompts):
            if time.perf_counter() - w0 > timeout_s:
                raise TimeoutError(f"HF continuous batching did not finish {len(prompts)} requests in {timeout_s} s")
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                results[r.request_id] = r
            elif r is None and not manager.is_running():
                raise RuntimeError("HF continuous batching stopped before finishing")
    seconds, wall = time.process_time() - t0, time.perf_counter() - w0
    toks = [list(results[f"r{i}"].generated_tokens) for i in range(len(prompts))]
    return {"seconds": seconds, "wall_seconds": wall, "useful_tokens": int(sum(output_lens)), "outputs": toks}
