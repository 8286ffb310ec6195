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

With `quantization: int8`, weights go to Tandem's int8 kernel instead (`quantize_linears`,
csrc/linear_int8_cpu.cpp): half bf16's bytes per decode step. With `quantization: gguf`, a
GGUF's Q8_0, Q4_0 and Q4_1 weights go to the same kernel's block formats as they are stored
(`serve_stored`): about half and a quarter of bf16's bytes. With `quantization: fp8` (CUDA,
compute capability 8.9 or newer), weights are quantized at load to fp8 e4m3 per output channel
and multiplied by `torch._scaled_mm` against activations quantized per row
(`quantize_linears_fp8`).

Packing replaces the dense weight: the layer keeps only the packed copy (a tied lm_head's
packed copy comes on top of the embedding it shares). It is CPU-only and optional: without
oneDNN, or with TANDEM_CPU_KERNELS=0, layers stay plain `nn.Linear` and the engine says so.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.cpu_kernels import cpu_kernels, switched_off

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Int8Weight:
    """A linear weight in int8 per output channel, packed for `linear_int8`: w ~ q * scale."""

    packed: torch.Tensor  # uint8 [N/32, K/4, 32, 4], q + 128
    scales: torch.Tensor  # fp32 [N]
    group: int  # activation inputs per scale (`int8_group`)
    portable: bool  # the plain C++ path, not AVX512-VNNI

    def matmul(self, kernels, rows: torch.Tensor, float_out: bool) -> torch.Tensor:
        return kernels.linear_int8(
            rows, self.packed, self.scales, self.group, float_out, self.portable
        )


@dataclass(frozen=True)
class BlockWeight:
    """A GGUF weight served as stored, packed for `linear_blocks`: w = d * q (Q8_0),
    d * (q - 8) (Q4_0) or d * q + m (Q4_1), d and m per output and 32 inputs."""

    packed: torch.Tensor  # uint8: [N/32, K/4, 32, 4] (Q8_0, q + 128) or [N/32, K/8, 32, 4]
    d: torch.Tensor  # fp16 [N/32, K/32, 32]
    m: torch.Tensor  # fp16 as d (Q4_1), or empty (Q8_0, Q4_0)
    four_bit: bool
    types: tuple[str, ...]  # the GGUF types it came in (q, k and v may differ)
    portable: bool
    bias: torch.Tensor | None = None  # the layer's own (Qwen2's q, k and v), added after

    def matmul(self, kernels, rows: torch.Tensor, float_out: bool) -> torch.Tensor:
        out = kernels.linear_blocks(
            rows, self.packed, self.d, self.m, self.four_bit, float_out, self.portable
        )
        return out if self.bias is None else out + self.bias.to(out.dtype)


def _block_scales(s: torch.Tensor) -> torch.Tensor:
    """[N, K/32] per-block values into the kernel's [N/32, K/32, 32]."""
    n, groups = s.shape
    return s.view(n // 32, 32, groups).transpose(1, 2).contiguous()


def pack_stored(blocks, kernels, portable: bool) -> BlockWeight | None:
    """One GGUF weight's blocks (gguf_loader.StoredBlocks) packed for the kernel, or None where
    its outputs are not a multiple of 32."""
    n = blocks.q.shape[0]
    if n % 32:
        return None
    pack = kernels.pack_linear_int4 if blocks.four_bit else kernels.pack_linear_int8
    m = _block_scales(blocks.m) if blocks.m is not None else torch.empty(0, dtype=torch.half)
    return BlockWeight(
        pack(blocks.q), _block_scales(blocks.d), m, blocks.four_bit, (blocks.type_name,), portable
    )


def _concat(parts: list[BlockWeight]) -> BlockWeight:
    """Weights of one type stacked along their outputs (q, k and v into one), blocks of 32
    outputs apiece."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return BlockWeight(
        torch.cat([p.packed for p in parts]),
        torch.cat([p.d for p in parts]),
        torch.cat([p.m for p in parts]) if first.m.numel() else first.m,
        first.four_bit,
        tuple(t for p in parts for t in p.types),
        first.portable,
    )


FP8_MAX = 448.0  # e4m3's largest finite value


@dataclass(frozen=True)
class Fp8Weight:
    """A linear weight in fp8 e4m3 per output channel, for `torch._scaled_mm`: w ~ q * scale.
    Each activation row is quantized as it arrives, at its own absmax / 448, so a row's result
    depends on that row alone."""

    q: torch.Tensor  # float8_e4m3fn [N, K]
    scale: torch.Tensor  # fp32 [1, N]
    bias: torch.Tensor | None

    def matmul(self, kernels, rows: torch.Tensor, float_out: bool) -> torch.Tensor:
        x = rows.float()
        step = (x.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_(min=1e-12)
        xq = (x / step).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        out_dtype = torch.float32 if float_out else rows.dtype
        # CUDA's row-wise scaled GEMMs write bf16 (fp32 only through cuBLAS on sm90)
        native = torch.bfloat16 if rows.is_cuda else out_dtype
        out = torch._scaled_mm(xq, self.q.t(), scale_a=step, scale_b=self.scale, out_dtype=native)
        if self.bias is not None:
            out = out + self.bias.to(native)
        return out if native == out_dtype else out.to(out_dtype)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 e4m3 per output channel: (q [N, K] float8_e4m3fn, scale [1, N] fp32), w ~ q * scale,
    the row's largest magnitude at 448. An all-zero row gets scale 1."""
    w = weight.detach().float()
    step = w.abs().amax(dim=1) / FP8_MAX
    scale = torch.where(step > 0, step, torch.ones_like(step))
    q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale[None, :].contiguous()


def fp8_unavailable(device: torch.device) -> str | None:
    """None when linears can be served in fp8 on this device, else why not."""
    if device.type != "cuda":
        return (
            f"quantization='fp8' runs on CUDA GPUs of compute capability 8.9 or newer (device "
            f"{device}); on the CPU, quantization='int8' serves int8 weights"
        )
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return (
            "quantization='fp8' needs torch._scaled_mm and float8_e4m3fn "
            f"(torch {torch.__version__})"
        )
    major, minor = torch.cuda.get_device_capability(device)
    name = torch.cuda.get_device_name(device)
    if (major, minor) < (8, 9):
        return (
            f"quantization='fp8' needs fp8 tensor cores (compute capability 8.9 or newer: Ada, "
            f"Hopper, Blackwell); {name} is {major}.{minor} (quantization='none')"
        )
    # Row-wise scaled GEMMs came to each architecture in its own torch release: one small
    # product says whether this torch has them for this GPU, before a model is quantized.
    try:
        ones = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        scale = torch.ones(16, 1, device=device)
        torch._scaled_mm(ones, ones.t(), scale_a=scale, scale_b=scale.t(), out_dtype=torch.bfloat16)
    except RuntimeError as e:
        return (
            f"quantization='fp8': torch {torch.__version__} has no row-wise fp8 GEMM for {name} "
            f"({major}.{minor}): {str(e).splitlines()[0]}"
        )
    return None


def quantize_linears_fp8(model: nn.Module) -> int:
    """Every linear layer of `model` whose outputs and inputs are multiples of 16 (what fp8
    GEMMs take), quantized to fp8 per output channel in place, one layer at a time; returns
    how many. The rest keep the model's dtype. The caller checks the device
    (`fp8_unavailable`)."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    done = 0
    with torch.no_grad():
        for m in layers:
            n, k = m.weight.shape
            if n % 16 or k % 16:
                continue
            q, scale = quantize_fp8(m.weight)
            m.quantized = Fp8Weight(q, scale, m.bias)
            m.weight = None  # the dense copy goes, unless shared (a tied lm_head's embedding)
            done += 1
    log.info(
        "%d of %d linear layers quantized to fp8 e4m3 per output channel%s",
        done,
        len(layers),
        "; the others keep the model's dtype" if done < len(layers) else "",
    )
    return done


class PackedLinear(nn.Linear):
    """`nn.Linear` that, once packed (`pack_linears`), multiplies by a oneDNN-packed copy of its
    weight, or by the copy one of Tandem's kernels takes (bf16, or int8 once quantized)."""

    packed: torch.Tensor | None = None
    kernels = None  # set when the weight is laid out for a kernel of Tandem's, not for oneDNN
    quantized: Int8Weight | BlockWeight | Fp8Weight | None = None  # set by the quantizers

    def forward(self, x: torch.Tensor, float_out: bool = False) -> torch.Tensor:
        """float_out: the result in fp32 (logits); Tandem's kernels then hand back their fp32
        sums, with no bf16 rounding and no cast. The other paths round to bf16 first, so a
        near-tie between two tokens may fall differently on a CPU without AVX512-BF16."""
        if isinstance(self.quantized, Fp8Weight):
            rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            out = self.quantized.matmul(None, rows, float_out)
            return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])
        if self.kernels is not None:
            rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            if rows.stride(-1) != 1:
                rows = rows.contiguous()
            if self.quantized is not None:
                out = self.quantized.matmul(self.kernels, rows, float_out)
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


INT8_KERNEL_ENV = "TANDEM_INT8_KERNEL"  # "portable": the plain C++ path even where VNNI is built


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel: (q [N, K] int8, scale [N] fp32), w ~ q * scale, the
    row's largest magnitude at +-127. An all-zero row (or one too small for a scale) gets
    scale 1, and q 0."""
    w = weight.detach().float()
    step = w.abs().amax(dim=1) / 127
    scale = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int8_group(inputs: int) -> int:
    """Inputs of an activation row that share one int8 scale: 64 where they divide the row,
    else 32. One scale for a whole row cost SmolLM2 3.7% perplexity (outlier channels in the
    MLP's activations); 64 inputs a scale cost 0.5%, no more than 32 did (6,000 tokens)."""
    return 64 if inputs % 64 == 0 else 32


def int8_kernel(kernels, vnni: bool | None = None) -> str:
    """Which int8 path `linear_int8` takes here: "avx512-vnni" or "portable". `vnni`: whether
    the build has the VNNI path, where `kernels` (the built module) is not at hand."""
    if vnni is None:
        vnni = kernels.linear_int8_vnni_supported()
    forced = os.environ.get(INT8_KERNEL_ENV, "") == "portable"
    return "avx512-vnni" if vnni and not forced else "portable"


def int8_unavailable(device: torch.device, quantization: str = "int8") -> str | None:
    """None when linears can be served by the int8 kernels (`quantization` int8 or gguf) on
    this device, else why not."""
    if device.type != "cpu":
        return (
            f"quantization={quantization!r} runs on the CPU only (device {device}); on CUDA, "
            "quantization='fp8' serves fp8 weights"
        )
    if cpu_kernels() is None:
        why = "TANDEM_CPU_KERNELS=0" if switched_off() else "they did not build (see the log)"
        return f"quantization={quantization!r} needs Tandem's CPU kernels: {why}"
    return None


def quantize_linears(model: nn.Module, device: torch.device) -> int:
    """Every PackedLinear of `model` that the int8 kernel takes (outputs and inputs multiples
    of 32, no bias), quantized per output channel and packed in place, one layer at a time
    (host memory holds one layer's fp32 copy on top of the model); returns how many. The rest
    stay for `pack_linears`. Raises ValueError where int8 cannot run (`int8_unavailable`)."""
    why_not = int8_unavailable(device)
    if why_not is not None:
        raise ValueError(why_not)
    kernels = cpu_kernels()
    portable = int8_kernel(kernels) == "portable"
    layers = [m for m in model.modules() if isinstance(m, PackedLinear) and m.packed is None]
    done = 0
    with torch.no_grad():
        for m in layers:
            if not m.fits_int8_kernel():
                continue
            q, scale = quantize_int8(m.weight)
            group = int8_group(q.shape[1])
            m.quantized = Int8Weight(kernels.pack_linear_int8(q), scale, group, portable)
            m.packed, m.kernels = m.quantized.packed, kernels
            m.weight = None  # the dense copy goes, unless shared (a tied lm_head's embedding)
            done += 1
    log.info(
        "%d of %d linear layers quantized to int8 (%s kernel)%s",
        done,
        len(layers),
        int8_kernel(kernels),
        "; the others keep the model's dtype" if done < len(layers) else "",
    )
    return done


def serve_stored(model: nn.Module, stored: dict, device: torch.device) -> int:
    """Every linear layer of `model` whose checkpoint tensors came as stored GGUF blocks
    (`stored`: BlockWeight by HF name less `model.`, from `pack_stored`; all of a layer's
    parts or none, in one width), served by them as they are; returns how many. The rest keep
    the model's dtype, for `pack_linears`, with a log line saying which and why."""
    why_not = int8_unavailable(device, "gguf")
    if why_not is not None:
        raise ValueError(why_not)
    kernels = cpu_kernels()
    done, left = 0, []
    for module, names in model.linear_sources():
        parts = [stored.get(n) for n in names]
        if all(p is None for p in parts):
            left.append(names[0].rsplit(".", 2)[0] if len(names) > 1 else names[0])
            continue
        if any(p is None for p in parts) or len({p.types for p in parts}) > 1:
            # gguf_loader.served_as_stored sends a layer's parts all stored in one type, or
            # all dense
            raise ValueError(f"{', '.join(names)}: only some came as stored blocks, or mixed")
        module.quantized = dataclasses.replace(_concat(parts), bias=module.bias)
        module.packed, module.kernels = module.quantized.packed, kernels
        module.weight = None  # the dense copy goes, unless shared (a tied lm_head's embedding)
        done += 1
    kinds = sorted(
        {
            t
            for m in model.modules()
            if isinstance(getattr(m, "quantized", None), BlockWeight)
            for t in m.quantized.types
        }
    )
    log.info(
        "%d of %d linear layers served as stored in the GGUF (%s; %s kernel)%s",
        done,
        done + len(left),
        ", ".join(kinds) or "none",
        int8_kernel(kernels),
        f"; at the model's dtype (not in Q8_0/Q4_0/Q4_1, or outputs not a multiple of 32): "
        f"{', '.join(left[:4])}{' ...' if len(left) > 4 else ''}"
        if left
        else "",
    )
    return done
