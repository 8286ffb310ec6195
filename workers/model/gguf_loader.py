"""Reads a GGUF checkpoint: its architecture from the metadata, its tensors dequantized with the
`gguf` package and renamed to HF names. llama.cpp stores Llama's q/k rows permuted for its
interleaved RoPE; they are permuted back here so the decoder can use rotate-half RoPE.
"""

from __future__ import annotations

import re
from pathlib import Path

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


def load_gguf(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from gguf.quants import dequantize

    reader = _reader(path)
    cfg = read_gguf_config(path, reader)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name]
        elif m := _BLOCK.match(t.name):
            layer, kind, suffix = m.groups()
            if kind not in _LAYER_NAMES:
                continue
            name = f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
        else:
            continue
        try:
            array = dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise CheckpointError(f"{path}: tensor {t.name!r} could not be dequantized: {e}") from e
        array = np.asarray(array, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
        if cfg.architecture == "llama" and ".attn_q." in t.name:
            array = _unpermute(array, cfg.num_heads)
        elif cfg.architecture == "llama" and ".attn_k." in t.name:
            array = _unpermute(array, cfg.num_kv_heads)
        tensors[name] = torch.from_numpy(np.array(array, copy=True, order="C"))
    return cfg, tensors
