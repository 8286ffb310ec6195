"""GGUF files written for tests, as llama.cpp's converter writes them."""

from __future__ import annotations

import torch

from workers.model.config import ModelConfig

# llama.cpp's names for the HF tensors of one layer (its convert_hf_to_gguf.py), written out
# here rather than taken from the loader, so a wrong mapping there cannot pass.
_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_name(hf: str) -> str:
    if hf in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[hf]
    _, _, layer, *rest = hf.split(".")
    module, suffix = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{_GGUF_LAYER[module]}.{suffix}"


def write_gguf(
    path,
    cfg: ModelConfig,
    tensors: dict[str, torch.Tensor],
    qtype_name: str,
    types: dict[str, str] | None = None,
) -> None:
    """A GGUF of `cfg`'s architecture (llama or qwen2) as llama.cpp writes one: a llama's q/k
    rows permuted for its interleaved RoPE, matrices in `qtype_name` (or, by HF name, in
    `types`), vectors in F32."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), cfg.architecture)
    w.add_vocab_size(cfg.vocab_size)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_layers)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    for name, t in tensors.items():
        a = t.float().numpy()
        for proj, n in ((".q_proj.", cfg.num_heads), (".k_proj.", cfg.num_kv_heads)):
            if proj in name and cfg.architecture == "llama":
                a = a.reshape(n, 2, a.shape[0] // n // 2, *a.shape[1:]).swapaxes(1, 2)
                a = np.ascontiguousarray(a).reshape(t.shape)
        qtype = gguf.GGMLQuantizationType[(types or {}).get(name, qtype_name)]
        if a.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def quant_round_trip(tensors: dict[str, torch.Tensor], qtype_name: str) -> dict:
    """What a GGUF of `tensors` in `qtype_name` holds, dequantized: the loader's expected output."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    out = {}
    for name, t in tensors.items():
        if t.dim() == 2 and qtype != gguf.GGMLQuantizationType.F32:
            a = gguf.quants.dequantize(gguf.quants.quantize(t.float().numpy(), qtype), qtype)
            t = torch.from_numpy(a.reshape(t.shape))
        out[name] = t.float().contiguous()
    return out
