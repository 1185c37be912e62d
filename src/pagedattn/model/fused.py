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


class FusedLinear:
    """``FusedLinear(a, b, c)(x) == torch.cat([a(x), b(x), c(x)], -1)`` in one ``F.linear`` call.

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
        return F.linear(x, self.weight, self.bias)
