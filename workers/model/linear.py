"""Linear layers whose weights are prepacked for oneDNN on the CPU.

A decode step is a chain of skinny matmuls (one row per running sequence) that must stream
every weight from memory once. `F.linear` hands them to a GEMM laid out for large batches,
which reads the weights at about a third of this machine's memory bandwidth; oneDNN's kernels
over a weight reordered once, at load, into its own blocked layout read them 1.5 to 2 times
faster at 1 to 16 rows, and are a little faster at prefill's 512 (bf16: 4.5 against 4.9 ms for
a 3072x576 weight). vLLM's CPU backend prepacks its weights for oneDNN for the same reason.

Packing replaces the dense weight: the layer keeps only the packed copy (a tied lm_head's
packed copy comes on top of the embedding it shares). It is CPU-only and optional: without
oneDNN, or with TANDEM_CPU_KERNELS=0, layers stay plain `nn.Linear` and the engine says so.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.cpu_kernels import switched_off

log = logging.getLogger(__name__)


class PackedLinear(nn.Linear):
    """`nn.Linear` that, once packed (`pack_linears`), multiplies by a oneDNN-packed copy of its
    weight."""

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed, self.bias, "none", [], ""
        )


def packing_available(device: torch.device) -> str | None:
    """None when weights can be packed on this device, else why not."""
    if device.type != "cpu":
        return f"weights are packed for the CPU only (device {device})"
    if switched_off():
        return "TANDEM_CPU_KERNELS=0"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    for op in ("_linear_pointwise", "_reorder_linear_weight"):
        if not hasattr(torch.ops.mkldnn, op):
            return f"this torch build lacks mkldnn.{op}"
    return None


def pack_linears(model: nn.Module, device: torch.device) -> int:
    """Pack every PackedLinear of `model` in place; returns how many were packed. A model
    that cannot be packed keeps plain linears, and the reason is logged (on the CPU, as a
    warning: decode steps run about twice as slow without it)."""
    why_not = packing_available(device)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear) and m.packed is None]
    if why_not is not None:
        if device.type == "cpu":
            log.warning("linear weights not packed for oneDNN (%s): slower decode steps", why_not)
        return 0
    # One layer at a time, the dense copy dropped as its packed one lands: the load never holds
    # both for the whole model. The first layer tells whether this dtype and build can pack.
    with torch.no_grad():
        for i, m in enumerate(layers):
            try:
                packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach())
            except Exception as e:
                if i:  # some layers are packed already: a half-packed model is not served
                    raise
                log.warning("linear weights not packed for oneDNN (%s): slower decode steps", e)
                return 0
            m.packed = packed
            m.weight = None  # the dense copy goes, unless shared (a tied lm_head's embedding)
    return len(layers)
