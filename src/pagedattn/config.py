"""KV-cache arithmetic and the engine's configuration dataclasses.

The paper's §3 motivates paging with the size of the KV cache: OPT-13B stores
``2 (K and V) x 5120 (hidden) x 40 (layers) x 2 B (fp16) = 800 KB`` per token, so one 2048-token request holds
1.6 GB. §4.2 splits that cache into fixed-size blocks; a request needs ``ceil(tokens / block_size)`` of them and
wastes at most one partly filled block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

_DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2, "float8": 1, "fp8": 1}


@dataclass(frozen=True)
class ModelSpec:
    """What the KV cache of a decoder model costs: layers x KV heads x head dim x bytes per element."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    max_model_len: int = 2048

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V that one token occupies across all layers (paper §3)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def kv_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.kv_bytes_per_token

    def token_slots(self, kv_bytes: float) -> int:
        """How many token slots a KV budget of ``kv_bytes`` holds (paper Table 1: 12 GB -> 15.7K for OPT-13B)."""
        return int(kv_bytes // self.kv_bytes_per_token)

    @classmethod
    def from_hf_config(cls, config: Any, dtype: str | None = None, name: str | None = None) -> "ModelSpec":
        """Build a spec from a transformers ``PretrainedConfig`` (OPT, Llama and the like)."""
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        # vars(): transformers' torch_dtype property warns that it is deprecated
        dtype = dtype or str(getattr(config, "dtype", None) or vars(config).get("torch_dtype") or "float16")
        dtype = dtype.replace("torch.", "")
        return cls(name=name or getattr(config, "_name_or_path", "") or config.model_type,
                   num_layers=config.num_hidden_layers, num_kv_heads=kv_heads, head_dim=head_dim,
                   dtype_bytes=_DTYPE_BYTES.get(dtype, 2),
                   max_model_len=getattr(config, "max_position_embeddings", 2048))


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Logical blocks a request of ``num_tokens`` occupies (paper §4.2): ``ceil(num_tokens / block_size)``."""
    check_block_size(block_size)
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // block_size)


def last_block_fill(num_tokens: int, block_size: int) -> float:
    """Fraction of the last block that holds tokens (1.0 when the last block is full; 0 tokens -> 0.0)."""
    if num_tokens == 0:
        return 0.0
    filled = num_tokens - (blocks_needed(num_tokens, block_size) - 1) * block_size
    return filled / block_size


def block_fills(num_tokens: int, block_size: int) -> list[int]:
    """Tokens in each logical block, e.g. 40 tokens at block size 16 -> [16, 16, 8]."""
    n = blocks_needed(num_tokens, block_size)
    return [min(block_size, num_tokens - i * block_size) for i in range(n)]


def check_block_size(block_size: int) -> None:
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")


def format_bytes(n: float) -> str:
    """Binary units, as the paper writes them (800 KB per token, 1.6 GB per 2048-token request)."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f}".rstrip("0").rstrip(".") + f" {unit}"
        n /= 1024
    raise AssertionError


@dataclass
class SchedulerConfig:
    """Iteration-level batching limits (paper §4.5; names follow vLLM)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int = 2048
    preemption_mode: Literal["recompute", "swap"] = "recompute"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
