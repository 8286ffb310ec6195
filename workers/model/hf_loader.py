"""Reads a Hugging Face checkpoint folder: config.json plus one or more *.safetensors files,
streamed one tensor at a time.

safetensors hands out tensors that are views of a mapping of the whole file, and every page a
read touches stays in the process's resident memory while that mapping lives. Each tensor is
therefore read through a handle of its own, closed once the tensor is taken: the mapping (and
its resident pages) goes with the tensor, and reading a checkpoint never holds more than one.

Tensors are always read to the host, never with safetensors' `device="cuda"`: that path (0.8)
stages each tensor in pinned memory from torch's caching host allocator, which keeps its blocks
page-locked for the life of the process (a block per size class, each rounded up to a power of
two: the largest tensor's alone may take nearly twice its size). The model's own copy
(`load_hf_weights`) moves each tensor over instead.

An FP8 checkpoint (config.json's `quantization_config`: compressed-tensors' 8-bit float
weights, or transformers' `fp8`) holds each linear weight in e4m3 beside its scale, per tensor,
per output channel or per block (`weight_scale`, or `weight_scale_inv` for `fp8`). Each such
weight is dequantized as it is read (e4m3 times its scale, in float32), so every quantization
setting starts from the checkpoint's real values; `quantization: fp8` then quantizes them per
output channel again, which gives back the checkpoint's own e4m3 values wherever its scales
were per channel (or per tensor) at the row's largest magnitude (the scales to the model
dtype's rounding). Static activation scales
(`input_scale`) are not used: activations are scaled per row as they come. Any other
`quant_method` (GPTQ, AWQ, bitsandbytes, ...) is refused, naming it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from workers.model.config import CheckpointError, ModelConfig


def read_hf_config(folder: Path) -> ModelConfig:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: missing (a model folder needs config.json)")
    try:
        raw = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from e
    return ModelConfig.from_hf(raw, source=str(config_path))


# The scales an FP8 checkpoint keeps beside a weight, by the quant_method that names them.
_FP8_SCALES = {"compressed-tensors": "weight_scale", "fp8": "weight_scale_inv"}
_ACTIVATION_SCALES = ("input_scale", "output_scale", "k_scale", "v_scale")


def checkpoint_quantization(folder: Path) -> tuple[str, list[int] | None] | None:
    """config.json's `quantization_config.quant_method` where Tandem reads it (`fp8`, or
    `compressed-tensors` with 8-bit float weights) and its weights' block size if they have
    one, None for a full-width checkpoint. Raises CheckpointError for any other."""
    path = folder / "config.json"
    try:
        qc = json.loads(path.read_text()).get("quantization_config")
    except (OSError, json.JSONDecodeError):
        return None  # read_hf_config reports it
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "fp8":
        return method, qc.get("weight_block_size")
    if method == "compressed-tensors":
        weights = [g.get("weights") or {} for g in (qc.get("config_groups") or {}).values()]
        if weights and all(w.get("type") == "float" and w.get("num_bits") == 8 for w in weights):
            return method, weights[0].get("block_structure")
        raise CheckpointError(
            f"{path}: compressed-tensors weights other than 8-bit float are not supported "
            f"(config_groups: {[{k: w.get(k) for k in ('type', 'num_bits')} for w in weights]})"
        )
    raise CheckpointError(
        f"{path}: quantization_config quant_method {method!r} is not supported (Tandem reads "
        "full-width checkpoints, FP8 ones in compressed-tensors or transformers' fp8 format, and "
        "GGUF files)"
    )


def open_hf_folder(folder: Path) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """The config, and a lazy stream of (HF name, host tensor) in the checkpoint's own dtype
    (an FP8 checkpoint's weights dequantized to float32). Every file's header is read here, so
    a corrupt file fails before any weight is."""
    cfg = read_hf_config(folder)
    method, block = checkpoint_quantization(folder) or (None, None)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weight files found")
    from safetensors import safe_open

    index: list[tuple[Path, str]] = []
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                index += [(f, name) for name in h.keys()]
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from e
    return cfg, _stream(index, method, block)


def _stream(index: list[tuple[Path, str]], method: str | None, block) -> Iterator[tuple]:
    where = {name: f for f, name in index}
    scale_suffix = _FP8_SCALES.get(method)
    for f, name in index:
        if method is not None and name.rsplit(".", 1)[-1] in (scale_suffix, *_ACTIVATION_SCALES):
            continue  # read with its weight
        tensor = _read(f, name)
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            tensor = _dequantize_fp8(name, tensor, where, scale_suffix, block)
        yield name, tensor
        del tensor  # before the next read: the consumer's drop then frees it


def _dequantize_fp8(
    name: str, q: torch.Tensor, where: dict, suffix: str | None, block
) -> torch.Tensor:
    """An fp8 weight times its scale, in float32: the scale one number, one per output row
    ([N] or [N, 1]), or one per block of `block` ([bn, bk]; [ceil(N / bn), ceil(K / bk)])."""
    scale_name = f"{name.removesuffix('.weight')}.{suffix}" if suffix else None
    if scale_name not in where:
        raise CheckpointError(
            f"tensor {name!r} is {q.dtype} with no scale beside it"
            + (f" ({scale_name!r})" if scale_name else " (config.json has no quantization_config)")
        )
    scale = _read(where[scale_name], scale_name).float()
    w = q.float()
    if scale.numel() == 1:
        return w * scale.reshape(())
    if q.dim() == 2 and scale.numel() == q.shape[0]:
        return w * scale.reshape(-1, 1)
    if q.dim() == 2 and scale.dim() == 2:
        bn, bk = block or (-(-q.shape[0] // scale.shape[0]), -(-q.shape[1] // scale.shape[1]))
        if tuple(scale.shape) == (-(-q.shape[0] // bn), -(-q.shape[1] // bk)):
            full = scale.repeat_interleave(bn, 0)[: q.shape[0]].repeat_interleave(bk, 1)
            return w * full[:, : q.shape[1]]
    raise CheckpointError(
        f"tensor {name!r} {tuple(q.shape)}: its scale {scale_name!r} {tuple(scale.shape)} is "
        f"neither one number, one per row, nor one per block of {block or 'its size'}"
    )


def _read(f: Path, name: str) -> torch.Tensor:
    from safetensors import safe_open

    try:
        # A handle per tensor (see the module docstring); opening costs a header parse. The
        # tensor keeps the file's mapping alive past the handle, and ends it when dropped.
        with safe_open(str(f), framework="pt") as h:
            return h.get_tensor(name)
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from e
