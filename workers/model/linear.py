"""Linear layers whose weights are prepacked on the CPU, for oneDNN or for Tandem's own bf16
kernel.

A decode step is a chain of skinny matmuls (one row per running sequence) that must stream
every weight from memory once. `F.linear` hands them to a GEMM laid out for large batches,
which reads the weights at about a third of this machine's memory bandwidth; oneDNN's kernels
over a weight reordered once, at load, into its own blocked layout read them 1.5 to 2 times
faster at 1 to 16 rows, and are a little faster at prefill's 512 (bf16: 4.5 against 4.9 ms for
a 3072x576 weight). vLLM's CPU backend prepacks its weights for oneDNN for the same reason.
On a CPU with AVX512-BF16, bf16 weights go to `linear_bf16` (csrc/linear_bf16_cpu.cpp)
instead: about twice oneDNN's speed at a decode step's few rows (one thread, the 49152 x 576
lm_head: 1.8 against 3.5 ms at one row, 2.6 against 4.5 at eight), on par at a prefill's
hundreds, and each row's result independent of the rest of the batch.

Quantized weights take a layer over instead: int8 (int8_linear.py), a GGUF's blocks as stored
(gguf_linear.py), fp8 on CUDA (fp8_linear.py).

Packing replaces the dense weight: the layer keeps only the packed copy (a tied lm_head's
packed copy comes on top of the embedding it shares). It is CPU-only and optional: without
oneDNN, or with TANDEM_CPU_KERNELS=0, layers stay plain `nn.Linear` and the engine says so.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.cpu_kernels import cpu_kernels, switched_off

log = logging.getLogger(__name__)


class PackedLinear(nn.Linear):
    """`nn.Linear` that, once packed (`pack_linears`), multiplies by a oneDNN-packed copy of its
    weight or by the copy Tandem's bf16 kernel takes; once quantized, by its quantized weight
    (int8_linear.py, gguf_linear.py, fp8_linear.py), which multiplies rows itself."""

    packed: torch.Tensor | None = None
    kernels = None  # set when the weight is laid out for a kernel of Tandem's, not for oneDNN
    quantized = None  # a weight with matmul(rows, float_out), set by the quantizers

    def forward(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        """float_out: the result in fp32 (logits); Tandem's kernels then hand back their fp32
        sums, with no bf16 rounding and no cast. The other paths round to bf16 first, so a
        near-tie between two tokens may fall differently on a CPU without AVX512-BF16."""
        if self.quantized is not None or self.kernels is not None:
            rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            if self.quantized is not None:
                out = self.quantized.matmul(rows, float_out)
            else:
                out = self.kernels.linear_bf16(rows, self.packed, float_out)
            return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])
        if self.packed is None:
            out = F.linear(x, self.weight, self.bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.packed, self.bias, "none", [], ""
            )
        return out.float() if float_out else out

    def fits_bf16_kernel(self) -> bool:
        w = self.weight
        return (
            w.dtype == torch.bfloat16
            and self.bias is None
            and not w.shape[0] % 32
            and not w.shape[1] % 2
        )

    def fits_int8_kernel(self) -> bool:
        w = self.weight
        return self.bias is None and not w.shape[0] % 32 and not w.shape[1] % 32


def quantize_layers(model: nn.Module, quantize, what: str) -> int:
    """Each PackedLinear of `model` neither packed nor quantized yet, given the weight
    `quantize(layer)` makes of its dense one (None: it keeps its dtype, for `pack_linears`),
    one layer at a time, so that host memory holds one layer's working copy on top of the
    model; the dense copy goes (unless shared: a tied lm_head's embedding). Logs how many of
    them became `what`, and returns it."""
    layers = [
        m
        for m in model.modules()
        if isinstance(m, PackedLinear) and m.packed is None and m.quantized is None
    ]
    done = 0
    with torch.no_grad():
        for m in layers:
            if (weight := quantize(m)) is None:
                continue
            m.quantized, m.weight = weight, None
            done += 1
    log.info(
        "%d of %d linear layers quantized to %s%s",
        done,
        len(layers),
        what,
        "; the others keep the model's dtype" if done < len(layers) else "",
    )
    return done


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
    layers = [
        m
        for m in model.modules()
        if isinstance(m, PackedLinear) and m.packed is None and m.quantized is None
    ]
    if why_not is not None:
        if device.type == "cpu":
            log.warning("linear weights not packed for oneDNN (%s): slower decode steps", why_not)
        return 0
    kernels = cpu_kernels()
    if kernels is not None and not kernels.linear_bf16_supported():
        kernels = None
    # One layer at a time, the dense copy dropped as its packed one lands: the load never holds
    # both for the whole model. A layer oneDNN cannot pack stays dense, and works as such.
    packed, failure = 0, None
    with torch.no_grad():
        for m in layers:
            if kernels is not None and m.fits_bf16_kernel():
                m.packed, m.kernels = kernels.pack_linear_bf16(m.weight.detach()), kernels
            elif failure is None:
                try:
                    m.packed = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach())
                except Exception as e:
                    failure = e
                    continue
            else:
                continue
            m.weight = None  # the dense copy goes, unless shared (a tied lm_head's embedding)
            packed += 1
    if failure is not None:
        log.warning(
            "%d of %d linear weights not packed for oneDNN (%s): slower decode steps",
            len(layers) - packed,
            len(layers),
            failure,
        )
    return packed
