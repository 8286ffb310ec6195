"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) that runs on flattened token rows
against a paged KV cache. Weights take HF names; q/k/v and gate/up are fused at load time
because one larger matmul beats three small ones on CPU and GPU alike.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.attention.base import AttentionBackend, AttentionMetadata
from workers.model.config import CheckpointError, ModelConfig
from workers.model.linear import PackedLinear
from workers.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = PackedLinear(
            cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias
        )
        self.o_proj = PackedLinear(cfg.q_size, cfg.hidden_size, bias=False)
        self.gate_up_proj = PackedLinear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = PackedLinear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5
        self.ops = None  # the fused CPU kernels, once LlamaForCausalLM.use_cpu_kernels sets them

    def _qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as `[T, heads, head_dim]` views of the fused projection's columns."""
        cfg = self.cfg
        q, k, v = self.qkv_proj(h).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        return (
            q.view(-1, cfg.num_heads, cfg.head_dim),
            k.view(-1, cfg.num_kv_heads, cfg.head_dim),
            v.view(-1, cfg.num_kv_heads, cfg.head_dim),
        )

    def forward(self, x, positions, rope, backend, k_cache, v_cache, meta):
        cfg = self.cfg
        q, k, v = self._qkv(self.input_layernorm(x))
        q, k = rope(positions, q, k)
        attn = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        x = x + self.o_proj(attn.reshape(-1, cfg.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)

    def forward_fused(self, delta, residual, positions, rope, backend, k_cache, v_cache, meta):
        """The same layer on fused CPU kernels (`self.ops`), in the residual-stream form:
        `residual += delta` is folded into the first norm (delta is None on the first layer),
        and this layer's MLP output is returned as the next delta, unadded."""
        cfg, ops = self.cfg, self.ops
        if delta is None:
            h = ops.rms_norm(residual, self.input_layernorm.weight, self.input_layernorm.eps)
        else:
            h = ops.add_rms_norm(
                delta, residual, self.input_layernorm.weight, self.input_layernorm.eps
            )
        q, k, v = self._qkv(h)
        ops.rotary_inplace(q, positions, rope.cos, rope.sin)
        ops.rotary_inplace(k, positions, rope.cos, rope.sin)
        attn = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        o = self.o_proj(attn.reshape(-1, cfg.q_size))
        norm = self.post_attention_layernorm
        h = ops.add_rms_norm(o, residual, norm.weight, norm.eps)
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(h))), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = PackedLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.ops = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        meta: AttentionMetadata,
        layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, one row per input token. `layer_done(i)` is
        called once layer i has written this step's KV."""
        x = self.embed_tokens(input_ids)
        if self.ops is not None:
            delta = None
            for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
                delta, x = layer.forward_fused(
                    delta, x, positions, self.rope, backend, k_cache, v_cache, meta
                )
                if layer_done is not None:
                    layer_done(i)
            return self.ops.add_rms_norm(delta, x, self.norm.weight, self.norm.eps)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, positions, self.rope, backend, k_cache, v_cache, meta)
            if layer_done is not None:
                layer_done(i)
        return self.norm(x)

    def use_cpu_kernels(self, ops) -> None:
        """Run the layers' small ops on the fused kernels of `workers.model.cpu_kernels`
        (None: back to torch ops)."""
        self.ops = ops
        for layer in self.layers:
            layer.ops = ops

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden, float_out=True)

    def load_hf_weights(self, weights: dict[str, torch.Tensor], source: str) -> None:
        """Load HF-named tensors (`model.layers.N.self_attn.q_proj.weight`, ...), fusing
        q/k/v and gate/up as it goes."""
        cfg = self.cfg
        w = {k.removeprefix("model."): t for k, t in weights.items()}

        def take(name: str) -> torch.Tensor:
            if name not in w:
                raise CheckpointError(f"{source}: tensor {name!r} is missing")
            return w[name]

        def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if tuple(param.shape) != tuple(value.shape):
                raise CheckpointError(
                    f"{source}: tensor {name!r} has shape {tuple(value.shape)}, "
                    f"expected {tuple(param.shape)} for this config"
                )
            param.data.copy_(value)

        with torch.no_grad():
            put(self.embed_tokens.weight, take("embed_tokens.weight"), "embed_tokens.weight")
            put(self.norm.weight, take("norm.weight"), "norm.weight")
            if not cfg.tie_word_embeddings:
                put(self.lm_head.weight, take("lm_head.weight"), "lm_head.weight")
            for i, layer in enumerate(self.layers):
                p = f"layers.{i}."
                attn, mlp = p + "self_attn.", p + "mlp."
                qkv = torch.cat([take(attn + f"{n}_proj.weight") for n in "qkv"])
                put(layer.qkv_proj.weight, qkv, attn + "qkv_proj.weight")
                if cfg.qkv_bias:
                    bias = torch.cat([take(attn + f"{n}_proj.bias") for n in "qkv"])
                    put(layer.qkv_proj.bias, bias, attn + "qkv_proj.bias")
                put(layer.o_proj.weight, take(attn + "o_proj.weight"), attn + "o_proj.weight")
                gate_up = torch.cat([take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")])
                put(layer.gate_up_proj.weight, gate_up, mlp + "gate_up_proj.weight")
                put(
                    layer.down_proj.weight, take(mlp + "down_proj.weight"), mlp + "down_proj.weight"
                )
                put(layer.input_layernorm.weight, take(p + "input_layernorm.weight"), p + "ln")
                put(
                    layer.post_attention_layernorm.weight,
                    take(p + "post_attention_layernorm.weight"),
                    p + "post_attention_layernorm.weight",
                )
