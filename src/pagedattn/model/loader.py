"""Load a paged-attention decoder from a transformers model object or a local checkpoint folder.

``load_model(path_or_hf_model, dtype, device)`` reads ``config.json`` through ``AutoConfig`` and the weights from
``model.safetensors`` / ``pytorch_model.bin`` (sharded or not). Our modules mirror transformers' parameter names,
so loading is a ``load_state_dict`` after the model is built on the meta device (no random initialisation).
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from pagedattn.model.llama import LlamaForCausalLM
from pagedattn.model.opt import OPTForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {"llama": LlamaForCausalLM, "opt": OPTForCausalLM}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "masked_bias", ".attn.bias")


class _NoInit(TorchFunctionMode):
    """Module constructors without their meta parameters' initialisation, in this thread: on the meta device it writes
    nothing, as the checkpoint's tensors then replace every parameter (``load_state_dict(assign=True)``), but its first
    call in a process imports ``torch._dynamo`` (meta ``normal_`` is a Python reference that it wraps), about 1.2 s of
    every ``python -m pagedattn.serve`` start on the 2-core VM (2026-12-07), where nothing else imports it."""

    SKIPPED = frozenset({nn.init.normal_, nn.init.uniform_, nn.init.kaiming_uniform_, nn.init.zeros_, nn.init.ones_,
                         nn.init.constant_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("tensor")
        if func in self.SKIPPED and isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return tensor
        return func(*args, **kwargs)


def _resolve_dtype(dtype, config) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        # vars(): transformers' torch_dtype property warns that it is deprecated
        d = getattr(config, "dtype", None) or vars(config).get("torch_dtype") or torch.float32
        return d if isinstance(d, torch.dtype) else getattr(torch, str(d).replace("torch.", ""))
    return getattr(torch, str(dtype).replace("torch.", ""))


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: safetensors first, then PyTorch ``.bin``; index files for shards."""
    path = Path(path)
    for index, single, safe in (("model.safetensors.index.json", "model.safetensors", True),
                                ("pytorch_model.bin.index.json", "pytorch_model.bin", False)):
        if (path / index).exists():
            files = sorted(set(json.loads((path / index).read_text())["weight_map"].values()))
        elif (path / single).exists():
            files = [single]
        else:
            continue
        state: dict[str, torch.Tensor] = {}
        for f in files:
            if safe:
                from safetensors.torch import load_file

                state.update(load_file(str(path / f)))
            else:
                state.update(torch.load(path / f, map_location="cpu", weights_only=True))
        return state
    raise FileNotFoundError(f"no model.safetensors or pytorch_model.bin (or their index) in {path}")


def load_model(path_or_hf_model, dtype=None, device: str | torch.device = "cpu") -> nn.Module:
    """Our decoder for a transformers ``PreTrainedModel`` or a checkpoint folder, in ``dtype`` on ``device``."""
    from transformers import AutoConfig

    if isinstance(path_or_hf_model, (str, Path)):
        if not (Path(path_or_hf_model) / "config.json").is_file():  # else transformers reads it as a hub repo id
            what = "folder has no config.json" if Path(path_or_hf_model).is_dir() else "folder does not exist"
            raise FileNotFoundError(f"load_model({str(path_or_hf_model)!r}): the checkpoint {what} (nothing is "
                                    "downloaded: pass a local folder saved by save_pretrained, or a transformers model)")
        config = AutoConfig.from_pretrained(str(path_or_hf_model))
        state = read_state_dict(path_or_hf_model)
    else:
        config, state = path_or_hf_model.config, path_or_hf_model.state_dict()
    cls = MODEL_REGISTRY.get(config.model_type)
    if cls is None:
        raise ValueError(f"model type {config.model_type!r} is not supported; known: {sorted(MODEL_REGISTRY)}")
    dtype = _resolve_dtype(dtype, config)
    if not any(k.startswith("model.") for k in state):  # a bare base model (OPTModel / LlamaModel) checkpoint
        state = {f"model.{k}": v for k, v in state.items()}
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED_SUFFIXES)}
    with torch.device("meta"), _NoInit():
        model = cls(config)
    tied = getattr(config, "tie_word_embeddings", True) or "lm_head.weight" not in state
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match {cls.__name__}: missing {missing[:8]}, "
                         f"unexpected {unexpected[:8]}")
    if tied:
        cast(Any, model).tie_weights()  # (our models' own method; nn.Module's __getattr__ hides its type)
    model = model.to(device=device, dtype=dtype).eval()
    if torch.device(device).type == "cpu":
        store_linear_weights_transposed(model)
    return model


def store_linear_weights_transposed(model: nn.Module) -> None:
    """Keep every ``nn.Linear`` weight ``[out, in]`` in ``[in, out]`` memory order (a transposed view of a contiguous
    ``[in, out]`` tensor), in place; the values, shapes and names do not change.

    ``F.linear(x, w)`` multiplies by ``w.t()``; for a decode step's few rows, the CPU GEMM is much faster when that
    operand is contiguous: measured on the 2-core VM (one thread, fp32), a ``[8, 256] x [256, 8192]`` LM head took
    0.43 ms against 0.98 ms, the other layers 25-40 % less, and a decode step's forward 6-8 % less at batch 8 and 64.
    A weight tied to an embedding (OPT's LM head) keeps its layout: the embedding reads rows of it.
    """
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear) and id(m.weight) not in embedded and m.weight.is_contiguous():
                m.weight.data = m.weight.t().contiguous().t()


def load_for_engine(model, tokenizer=None, dtype=None, device: torch.device | None = None
                    ) -> tuple[nn.Module, object]:
    """The engine's model and tokenizer. One of our paged models is used as it is (moved only when ``dtype`` or
    ``device`` is given); a transformers model or a checkpoint folder is loaded with ``load_model``: a model object
    keeps its dtype, a checkpoint runs in fp32 on the CPU. A folder's tokenizer is loaded when none is given."""
    from pagedattn.model.attention import PagedAttention

    target = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if isinstance(model, nn.Module) and any(isinstance(m, PagedAttention) for m in model.modules()):
        if dtype is not None or device is not None:
            model = model.to(target, _resolve_dtype(dtype, model.config) if dtype is not None
                             else next(model.parameters()).dtype)
        return model, tokenizer
    is_path = isinstance(model, (str, Path))
    if is_path and tokenizer is None:
        tokenizer = _try_tokenizer(str(model))
    if dtype is None:
        dtype = (torch.float32 if target.type == "cpu" else None) if is_path else next(model.parameters()).dtype
    return load_model(model, dtype, target), tokenizer


#: files of which a folder's tokenizer is made (fast, BPE, SentencePiece, WordPiece); the name of one must be there
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "spiece.model",
                   "vocab.txt")


def _try_tokenizer(path: str):
    """The tokenizer saved next to the weights, or ``None`` (token-id prompts only) where there is none. The files are
    looked for first: transformers 5 builds an empty tokenizer (a vocabulary of one token) for a folder that has only
    a model. With it, every id decoded to no text, slowly (the incremental detokenizer decoded up to 8 tokens back per
    sequence and step: about a third of a served step's CPU), and its end-of-text id 0 joined the model's EOS ids, so
    sequences stopped where Hugging Face ``generate`` goes on. Tokenizer files that cannot be read leave token-id
    prompts only too, with a warning that names the folder and the error (text prompts are then refused with "needs a
    tokenizer", which alone would not say why)."""
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # unreadable tokenizer files: token-id prompts only, and the user is told why
        warnings.warn(f"{path}: its tokenizer files could not be read ({type(e).__name__}: {e}); serving it with "
                      "token-id prompts only", stacklevel=3)
        return None


def eos_token_ids(model: nn.Module, tokenizer) -> frozenset[int]:
    """End-of-sequence ids named by the model's config and by the tokenizer."""
    ids: set[int] = set()
    for src in (getattr(model.config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif src:
            ids.update(src)
    return frozenset(ids)
