"""Several linear layers over the same input as one matmul (the q/k/v projections of an attention layer).

A decode step (§4.1) multiplies a few rows by every weight matrix, so on a CPU each ``nn.Linear`` call costs about
as much in fixed overhead as in arithmetic; one matmul over the concatenated weights replaces three. The fused
weight is built on first use and the layers' own weights become views of it, so the model keeps its parameter names
(transformers' state dict still loads), uses no extra memory, and stays exact: each output column is the same dot
product as before. If a weight is replaced or changed in place afterwards (``.to()``, ``load_state_dict``), the next
call sees it (by data pointer and version counter) and fuses again.

Measured on the 2-core VM (one thread, fp32; the benchmark's tiny Llama): a Llama attention layer with fused q/k/v
and one RoPE call over q and k took 0.30 ms against 0.38 ms at batch 8, 1.72 ms against 1.85 ms at batch 64, with
identical outputs. Fusing the MLP's gate and up projections gained nothing and is not done.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pagedattn.cpuinfo import bf16_in_hardware, intel_cpu


#: oneDNN's fp32 matmul (torch's ``mkldnn._linear_pointwise``, vLLM-CPU's path for unquantized layers) for inputs of
#: at least this many rows; fewer go to torch's ``F.linear`` (MKL's sgemm). Measured on the 2-core VM (fp32, every
#: linear layer of the benchmark's tiny Llama once, [in, out]-stored weights, median of 15; 2026-12-05): one thread,
#: 1 row 1.08 ms against 0.54 ms (oneDNN's per-call cost), 8 rows 1.38 against 1.55, 64 rows 3.45 against 6.56, 256
#: rows 10.9 against 24.2, 2,048 rows 113 against 210; two threads, 8 rows 0.87 against 1.38, 64 rows 2.74 against
#: 4.87. The two round differently (a few fp32 ulps; each is an fp32 dot product summed in its own order).
#: On an Intel CPU MKL is the faster one, so oneDNN is not used there (a 2-core Intel Xeon with AMX, the same layers,
#: median of 15, 2026-12-05): one thread, 8 rows 0.23 ms oneDNN against 0.13 MKL, 64 rows 0.69 against 0.55, 256
#: rows 2.33 against 2.10; two threads, 8 rows 0.17 against 0.07, 64 rows 0.45 against 0.37, 256 rows 1.33 against
#: 1.20; from 512 rows on either won by up to 20 % from one size to the next. A batch-64 generate of 64 tokens on
#: one thread took 0.66 s of CPU with MKL against 0.78 with oneDNN there.
ONEDNN_MIN_ROWS = 8
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise") and not intel_cpu()


#: bf16 linear layers through oneDNN with the weight reordered once into its blocked layout (:class:`PackedWeight`),
#: on a CPU that multiplies bf16 in hardware. torch's own bf16 matmul is oneDNN too, but it takes the plain weight and
#: reorders it on every call; vLLM-CPU packs its unquantized weights once at load for the same reason (its
#: ``dispatch_cpu_unquantized_gemm``, ``vllm/model_executor/layers/utils.py``). Measured on the 2-core Intel Xeon
#: with AMX (two threads, min of 5 x 1,000 calls, 2026-12-05): [64, 256] x [256, 688] 35 us against 42 for
#: ``F.linear``, [64, 688] x [688, 256] 29 against 39, the [64, 256] x [256, 8192] LM head 216 against 272; 1-300 rows
#: all faster, and every output equal to ``F.linear``'s bit for bit (whatever the weight's memory order).
_PACKED_BF16 = (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                and hasattr(torch.ops.mkldnn, "_linear_pointwise") and bf16_in_hardware())


class PackedWeight:
    """A bf16 weight's copy in oneDNN's blocked layout, made on first use and again when the weight is replaced or
    changed in place (by data pointer and version counter, as :class:`FusedLinear`). It is a second copy of the
    weight: vLLM-CPU drops the plain one, but here the parameter stays for ``state_dict`` and ``.to()``."""

    __slots__ = ("key", "tensor")

    def __init__(self) -> None:
        self.key: tuple = ()
        self.tensor: Tensor | None = None

    def get(self, weight: Tensor) -> Tensor:
        key = (weight.data_ptr(), 0 if weight.is_inference() else weight._version, weight.shape)
        if key != self.key or self.tensor is None:
            self.tensor, self.key = torch.ops.mkldnn._reorder_linear_weight(weight.detach()), key
        return self.tensor

    def __reduce__(self):  # a copy or a pickle starts empty (oneDNN's layout does not pickle; a copy repacks)
        return PackedWeight, ()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, packed: PackedWeight | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, the same values, at inference (oneDNN's op has no backward) on a CPU:

    - bf16 with ``packed`` on a CPU with bf16 hardware: oneDNN with the weight reordered once (``_PACKED_BF16``);
    - fp32 inputs of ``ONEDNN_MIN_ROWS`` rows or more on a CPU not Intel's: oneDNN, with a weight stored ``[out,
      in]`` or ``[in, out]``; a weight that is a strided slice of another (a layer of a :class:`FusedLinear` called
      alone) stays on ``F.linear``, as oneDNN ran such a layer hundreds of times slower."""
    if (packed is not None and _PACKED_BF16 and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and x.device.type == "cpu" and not torch.is_grad_enabled()):
        return torch.ops.mkldnn._linear_pointwise(x, packed.get(weight), bias, "none", [], "")
    if (_ONEDNN and x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] >= ONEDNN_MIN_ROWS
            and x.device.type == "cpu" and weight.dtype == torch.float32 and not torch.is_grad_enabled()
            and (weight.is_contiguous() or weight.t().is_contiguous())):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same names) whose forward is :func:`linear`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.packed = PackedWeight()

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class FusedLinear:
    """``FusedLinear(a, b, c)(x) == torch.cat([a(x), b(x), c(x)], -1)`` in one :func:`linear` call.

    Not a module: the layers stay registered where they are. On a CPU the fused weight is stored ``[in, out]``
    (see :func:`pagedattn.model.loader.store_linear_weights_transposed`), elsewhere ``[out, in]``.
    """

    def __init__(self, *linears: nn.Linear) -> None:
        if len({m.in_features for m in linears}) != 1 or len({m.bias is None for m in linears}) != 1:
            raise ValueError("FusedLinear needs layers with one input size, all with or all without a bias")
        self.linears = linears
        self.weight: Tensor | None = None
        self.bias: Tensor | None = None
        self._key: tuple = ()
        self.packed = PackedWeight()

    def _source_key(self) -> tuple:
        return tuple((p.data_ptr(), p._version) for m in self.linears
                     for p in (m.weight, m.bias) if p is not None)

    def _fuse(self) -> None:
        """Concatenate the weights (and biases) and make each layer's parameters views of the result."""
        with torch.inference_mode(False), torch.no_grad():  # ordinary tensors, also when first called at inference
            ws = [m.weight for m in self.linears]
            if ws[0].device.type == "cpu":
                weight = torch.cat([w.t() for w in ws], 1).contiguous().t()  # [out, in] view of [in, out] memory
            else:
                weight = torch.cat(ws, 0)
            bias = None if self.linears[0].bias is None else torch.cat([m.bias for m in self.linears])
            start = 0
            for m in self.linears:
                end = start + m.out_features
                m.weight.data = weight[start:end]
                if bias is not None:
                    m.bias.data = bias[start:end]
                start = end
        self.weight, self.bias, self._key = weight, bias, self._source_key()

    def __call__(self, x: Tensor) -> Tensor:
        if self._source_key() != self._key:
            self._fuse()
        assert self.weight is not None  # (set by _fuse)
        return linear(x, self.weight, self.bias, self.packed)
