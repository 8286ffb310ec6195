"""Reads a GGUF checkpoint: its architecture from the metadata, its tensors dequantized with the
`gguf` package and renamed to HF names, streamed one at a time. llama.cpp stores Llama's q/k
rows permuted for its interleaved RoPE; they are permuted back here so the decoder can use
rotate-half RoPE.

A tensor's bytes are read from the file a slice of rows at a time (never through the reader's
memory map, whose touched pages would stay resident until the reader goes) and dequantized
into one float32 array: reading holds that array plus a slice's worth, whatever the quant type
(`gguf`'s own whole-tensor dequantize holds about twice the output).

With `stored=True` (quantization: gguf), a linear weight in Q8_0, Q4_0 or Q4_1 comes with its
blocks as stored (`StoredBlocks`: the integer values, and each 32 inputs' scale and minimum),
for Tandem's int8 kernels to serve as they are; a linear weight in any other quantized type is
refused, naming it. Which layers are served so is decided from the tensor table before any
weight is read (`served_as_stored`): every part of a fused layer (q, k, v; gate, up) stored,
in one type, its outputs a multiple of 32. Those weights come without a dense
copy, so a load holds the packed model and one tensor, not the dequantized model; the rest
(and the token embedding, which is looked up) come dense as before.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from workers.model.config import CheckpointError, ModelConfig

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_LINEAR_KINDS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
# Served as stored by quantization: gguf (a tied lm_head is the token embedding): bytes per
# block of 32 values.
STORED_TYPES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
_FULL_WIDTH = {"F32", "F16", "BF16"}
_SERVABLE = set(STORED_TYPES) | _FULL_WIDTH
_SLICE = 1 << 20  # float32 elements dequantized at a time: bounds the transient (4 MiB here)


def _reader(path: Path):
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise CheckpointError(f"{path}: reading GGUF needs the gguf package ({e})") from e
    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def _field(reader, key: str, path: Path, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise CheckpointError(f"{path}: GGUF metadata key {key!r} is missing")
        return default
    return f.contents()


def read_gguf_config(path: Path, reader=None) -> ModelConfig:
    reader = reader or _reader(path)
    arch = _field(reader, "general.architecture", path)
    if arch not in ("llama", "qwen2"):
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported (llama, qwen2)")
    a = arch + "."
    num_heads = int(_field(reader, a + "attention.head_count", path))
    hidden = int(_field(reader, a + "embedding_length", path))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, a + "vocab_size", path, default=-1)
    if vocab == -1:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _field(reader, "tokenizer.ggml.eos_token_id", path, default=-1)
    bos = _field(reader, "tokenizer.ggml.bos_token_id", path, default=-1)
    scaling = None
    if (factor := reader.fields.get(a + "rope.scaling.factor")) is not None:
        scaling = {"rope_type": "linear", "factor": float(factor.contents())}
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, a + "feed_forward_length", path)),
        num_layers=int(_field(reader, a + "block_count", path)),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, a + "attention.head_count_kv", path, default=num_heads)),
        head_dim=int(_field(reader, a + "rope.dimension_count", path, default=hidden // num_heads)),
        rms_norm_eps=float(_field(reader, a + "attention.layer_norm_rms_epsilon", path)),
        rope_theta=float(_field(reader, a + "rope.freq_base", path, default=10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(_field(reader, a + "context_length", path)),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        bos_token_id=None if bos == -1 else int(bos),
        eos_token_ids=() if eos == -1 else (int(eos),),
        architecture=arch,
    )


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if (m := _BLOCK.match(gguf_name)) is None:
        return None
    layer, kind, suffix = m.groups()
    if kind not in _LAYER_NAMES:
        return None
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


@dataclass(frozen=True)
class StoredBlocks:
    """A GGUF linear weight [N, K] as stored, in HF row order: w[n, k] = d[n, k // 32] *
    q[n, k] for Q8_0 (q int8), d * (q - 8) for Q4_0 and d * q + m[n, k // 32] for Q4_1 (q
    uint8 in 0..15); d and m fp16 [N, K / 32], m None but for Q4_1."""

    type_name: str
    q: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def four_bit(self) -> bool:
        return self.type_name != "Q8_0"

    def dequantized(self) -> torch.Tensor:
        """The weight in float32, as gguf's own dequantization gives it (each product exact)."""
        q = self.q.float() - (8 if self.type_name == "Q4_0" else 0)
        w = self.d.float().repeat_interleave(32, 1) * q
        return w if self.m is None else w + self.m.float().repeat_interleave(32, 1)


def _is_linear(gguf_name: str, cfg: ModelConfig) -> bool:
    """Whether a tensor is a linear layer's weight (the token embedding is one when tied)."""
    if gguf_name == "output.weight" or (
        gguf_name == "token_embd.weight" and cfg.tie_word_embeddings
    ):
        return True
    return (m := _BLOCK.match(gguf_name)) is not None and m[2] in _LINEAR_KINDS and m[3] == "weight"


def open_gguf(path: Path, stored: bool = False) -> tuple[ModelConfig, Iterator[tuple]]:
    """The config, and a lazy stream of (HF name, float32 host tensor); with `stored`, a
    linear weight of a layer `served_as_stored` comes as (name, None, StoredBlocks), or, the
    token embedding, as (name, tensor, StoredBlocks). Raises CheckpointError, before any
    tensor is read, when `stored` and a layer's linear weight is in any other quantized type.
    The lm_head (output.weight, or the tied embedding) may be: llama.cpp's quantizer writes it
    in Q6_K beside Q4_0 layers, and it is then dequantized at load (the log says so)."""
    reader = _reader(path)
    cfg = read_gguf_config(path, reader)
    if stored:
        for t in reader.tensors:
            kind = t.tensor_type.name
            if _BLOCK.match(t.name) and _is_linear(t.name, cfg) and kind not in _SERVABLE:
                raise CheckpointError(
                    f"{path}: tensor {t.name!r} is {kind}; quantization='gguf' serves "
                    f"{', '.join(STORED_TYPES)} as stored (and F32, F16, BF16 at full width); "
                    "quantization='none' dequantizes every type at load"
                )
    served = served_as_stored(reader.tensors, cfg) if stored else set()
    return cfg, _stream(path, reader, cfg, served)


# The GGUF tensors that make one linear layer of Tandem's model, by their kind in a block.
_FUSED = {
    "attn_q": "qkv",
    "attn_k": "qkv",
    "attn_v": "qkv",
    "ffn_gate": "gate_up",
    "ffn_up": "gate_up",
}


def served_as_stored(tensors, cfg: ModelConfig) -> set[str]:
    """The GGUF names of the linear weights whose layers can be served as stored: every part
    of the layer in one of STORED_TYPES, the same one, each part's outputs a multiple of 32
    (the kernel's blocks)."""
    layers: dict[str, list] = {}
    for t in tensors:
        if not _is_linear(t.name, cfg):
            continue
        m = _BLOCK.match(t.name)
        layer = f"{m[1]}.{_FUSED.get(m[2], m[2])}" if m else t.name
        layers.setdefault(layer, []).append(t)
    served = set()
    for parts in layers.values():
        kinds = {t.tensor_type.name for t in parts}
        if (
            len(kinds) == 1
            and kinds <= set(STORED_TYPES)
            and all(int(t.shape[-1]) % 32 == 0 for t in parts)
        ):
            served.update(t.name for t in parts)
    return served


def _stream(path: Path, reader, cfg: ModelConfig, served: set[str]):
    with open(path, "rb") as f:
        for t in reader.tensors:
            if (name := _hf_name(t.name)) is None:
                continue
            n_head = None
            if cfg.architecture == "llama" and ".attn_q." in t.name:
                n_head = cfg.num_heads
            elif cfg.architecture == "llama" and ".attn_k." in t.name:
                n_head = cfg.num_kv_heads
            if t.name in served:
                blocks = _read_blocks(f, path, t, n_head)
                looked_up = t.name == "token_embd.weight"  # the embedding, and the tied lm_head
                yield name, blocks.dequantized() if looked_up else None, blocks
                continue
            # Yielded with no local bound to it: the consumer's drop frees it.
            yield name, torch.from_numpy(_dequantize(f, path, t, n_head))


def _read_blocks(f: BinaryIO, path: Path, t, n_head: int | None) -> StoredBlocks:
    """Tensor `t`'s blocks as stored (ggml's layout: each block its fp16 scale, for Q4_1 its
    fp16 minimum, then its values; 4-bit values two to a byte, value j in byte j % 16's low
    nibble for j < 16, high nibble after), rows in HF order."""
    kind = t.tensor_type.name
    block_bytes = STORED_TYPES[kind]
    rows = int(np.prod(t.data.shape[:-1]))
    cols = t.n_elements // rows
    raw = np.empty(t.n_bytes, dtype=np.uint8)
    f.seek(t.data_offset)
    if f.readinto(raw) != raw.nbytes:
        raise CheckpointError(f"{path}: tensor {t.name!r} runs past the end of the file")
    blocks = raw.reshape(rows, cols // 32, block_bytes)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    m = None
    if kind == "Q8_0":
        q = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
    else:
        nibbles = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
        q = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1).reshape(rows, cols)
        if kind == "Q4_1":
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    if n_head is not None:  # rows back in HF order, as _dequantize puts them
        order = _unpermute(np.arange(rows), n_head)
        q, d = q[order], d[order]
        m = None if m is None else m[order]
    return StoredBlocks(kind, _owned(q), _owned(d), None if m is None else _owned(m))


def _owned(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


def _dequantize(f: BinaryIO, path: Path, t, n_head: int | None) -> np.ndarray:
    """Tensor `t` as float32 in HF order (its rows unpermuted over `n_head` heads if given),
    read and dequantized a slice of rows at a time. A row (along ggml's innermost dimension)
    is a whole number of quant blocks, so each slice dequantizes on its own."""
    from gguf.quants import dequantize

    stored = t.data  # the reader's view: its dtype and shape are used, never its pages
    rows = int(np.prod(stored.shape[:-1]))  # 1 for a vector
    row_bytes = t.n_bytes // rows
    out = np.empty((rows, t.n_elements // rows), dtype=np.float32)
    # llama.cpp's stored row r belongs at dest[r] (a vector's elements are permuted as a whole
    # below: a vector is one row here).
    dest = None
    if n_head is not None and rows > 1:
        dest = np.argsort(_unpermute(np.arange(rows), n_head))
    step = max(1, _SLICE // out.shape[1])
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        raw = np.empty((r1 - r0) * row_bytes, dtype=np.uint8)
        f.seek(t.data_offset + r0 * row_bytes)
        if f.readinto(raw) != raw.nbytes:
            raise CheckpointError(f"{path}: tensor {t.name!r} runs past the end of the file")
        piece = raw.view(stored.dtype).reshape(r1 - r0, stored.shape[-1])
        try:
            values = dequantize(piece, t.tensor_type).reshape(r1 - r0, -1)
        except Exception as e:
            raise CheckpointError(f"{path}: tensor {t.name!r} could not be dequantized: {e}") from e
        if dest is None:
            out[r0:r1] = values
        else:
            out[dest[r0:r1]] = values
    out = out.reshape(tuple(reversed(t.shape.tolist())))
    if n_head is not None and rows == 1:
        out = np.ascontiguousarray(_unpermute(out, n_head))
    return out
