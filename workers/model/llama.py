"""A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) that runs on flattened token rows
against a paged KV cache. Weights take HF names; q/k/v and gate/up are fused at load time
because one larger matmul beats three small ones on CPU and GPU alike.

Loading fills the model in place, one checkpoint tensor at a time: the model is built on the
meta device, given empty storage on its own device (`materialize`), then each tensor is copied
into its parameter, or into its rows of a fused one (`load_hf_weights`), and dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.attention.base import AttentionBackend, AttentionMetadata
from workers.model.config import CheckpointError, ModelConfig
from workers.model.linear import PackedLinear
from workers.model.rope import RotaryEmbedding
from workers.model.tensor_parallel import Collectives, Shard


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
        self.ops = None  # fused layer ops, once LlamaForCausalLM.use_fused_ops sets them
        self.comm = Collectives.single()  # joins O's and down's partial sums under tp > 1

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
        x = x + self.comm.all_reduce(self.o_proj(attn.reshape(-1, cfg.q_size)))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.comm.all_reduce(self.down_proj(F.silu(gate) * up))

    def forward_fused(self, delta, residual, positions, rope, backend, k_cache, v_cache, meta):
        """The same layer on fused ops (`self.ops`: the CPU kernels, or Triton's on CUDA), in
        the residual-stream form: `residual += delta` is folded into the first norm (delta is
        None on the first layer), and this layer's MLP output is returned as the next delta,
        unadded. Ops that `writes_kv` put k and v in the cache with the rotary (the backend
        then writes nothing: `meta.kv_written`)."""
        cfg, ops = self.cfg, self.ops
        if delta is None:
            h = ops.rms_norm(residual, self.input_layernorm.weight, self.input_layernorm.eps)
        else:
            h = ops.add_rms_norm(
                delta, residual, self.input_layernorm.weight, self.input_layernorm.eps
            )
        q, k, v = self._qkv(h)
        if meta.kv_written:
            ops.rotary_write_kv(
                q, k, v, positions, rope.cos, rope.sin, k_cache, v_cache, meta.slot_mapping
            )
        else:
            ops.rotary_inplace(q, positions, rope.cos, rope.sin)
            ops.rotary_inplace(k, positions, rope.cos, rope.sin)
        attn = backend.forward(q, k, v, k_cache, v_cache, meta, self.scale)
        o = self.comm.all_reduce(self.o_proj(attn.reshape(-1, cfg.q_size)))
        norm = self.post_attention_layernorm
        h = ops.add_rms_norm(o, residual, norm.weight, norm.eps)
        mlp = self.down_proj(ops.silu_and_mul(self.gate_up_proj(h)))
        return self.comm.all_reduce(mlp), residual


class _Slot(NamedTuple):
    """Where one HF-named checkpoint tensor goes: `rows` rows of `param` from `start` (all of
    `param` when `rows` is None). `take`: under tp > 1, the (dim, start, length) of the
    checkpoint tensor this rank holds, and the tensor's whole size along dim (None: all of
    it)."""

    param: torch.Tensor
    start: int = 0
    rows: int | None = None
    take: tuple[int, int, int, int] | None = None

    def view(self) -> torch.Tensor:
        return self.param if self.rows is None else self.param.narrow(0, self.start, self.rows)

    def part(self, value: torch.Tensor, name: str, source: str) -> torch.Tensor:
        """This rank's part of the checkpoint tensor `value` (a view: a safetensors tensor
        mapped from its file is read only where the part lies), once the whole tensor's
        shape is checked (a CheckpointError naming it)."""
        if self.take is None:
            return value
        dim, start, length, whole = self.take
        want = list(self.view().shape)
        want[dim] = whole
        _check_shape(value, want, name, source)
        return value.narrow(dim, start, length)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, shard: Shard | None = None) -> None:
        """`shard`: this rank's part of a tensor-parallel model (tensor_parallel.py); its
        layers are built for `local_cfg`, its heads and MLP width. `cfg` stays the whole
        model's."""
        super().__init__()
        self.cfg = cfg
        self.shard = shard or Shard.of(cfg, 0, 1)
        self.local_cfg = local = self.shard.local_config(cfg)
        vocab = self.shard.vocab[1]
        self.embed_tokens = nn.Embedding(vocab, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(local) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = PackedLinear(cfg.hidden_size, vocab, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.ops = None
        self.comm = Collectives.single()

    def use_collectives(self, comm: Collectives) -> None:
        """Join the ranks' partial results through `comm` (a tensor-parallel model's)."""
        self.comm = comm
        for layer in self.layers:
            layer.comm = comm

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Each id's embedding row; under tp > 1, from the rank whose vocabulary holds it (the
        others add zeros)."""
        if self.shard.size == 1:
            return self.embed_tokens(input_ids)
        start, count = self.shard.vocab
        local = input_ids - start
        mine = (local >= 0) & (local < count)
        x = self.embed_tokens(local.clamp(0, max(count - 1, 0)))
        return self.comm.all_reduce(x.masked_fill_(~mine.unsqueeze(-1), 0))

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
        x = self.embed(input_ids)
        if self.ops is not None:
            if getattr(self.ops, "writes_kv", False):  # each layer's K/V go in with its rotary
                meta = dataclasses.replace(meta, kv_written=True)
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

    def use_fused_ops(self, ops) -> None:
        """Run the layers' small ops on fused kernels: `workers.model.cpu_kernels`'s on the
        CPU, `workers.model.triton_layer_ops`'s on CUDA (None: back to torch ops)."""
        self.ops = ops
        for layer in self.layers:
            layer.ops = ops

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the whole vocabulary (under tp > 1, every rank's range joined)."""
        logits = self.lm_head(hidden, float_out=True)
        return self.comm.all_gather_columns(logits, self.cfg.vocab_size)

    def materialize(self, device: torch.device, dtype: torch.dtype) -> None:
        """Real storage for a model built on the meta device: every parameter an empty tensor
        on `device` in `dtype` (a tied lm_head keeps sharing the embedding's), the rope tables
        computed there in float32. The parameters hold garbage until `load_hf_weights`."""
        # Module.to_empty would give the tied lm_head a storage of its own (a vocab-sized
        # allocation, and untied); one new parameter per old one keeps the tie.
        owners = [
            (module, name, p)
            for module in self.modules()
            for name, p in module.named_parameters(recurse=False)
        ]
        fresh: dict[int, nn.Parameter] = {}  # by id of the old parameter, alive in `owners`
        for module, name, p in owners:
            if id(p) not in fresh:
                empty = torch.empty(p.shape, dtype=dtype, device=device)
                fresh[id(p)] = nn.Parameter(empty, requires_grad=p.requires_grad)
            setattr(module, name, fresh[id(p)])
        self.rope.materialize(device)

    def _slots(self) -> dict[str, _Slot]:
        """Every tensor the checkpoint must supply, by HF name less `model.`, in the order a
        missing one is reported."""
        cfg, local = self.cfg, self.local_cfg
        split = self.shard.size > 1

        whole = {"q": cfg.q_size, "kv": cfg.kv_size, "mlp": cfg.intermediate_size}
        whole["vocab"] = cfg.vocab_size

        def take(dim: int, part: str) -> tuple[int, int, int, int] | None:
            return (dim, *self.shard.rows(part, cfg), whole[part]) if split else None

        vocab = take(0, "vocab")
        slots = {"embed_tokens.weight": _Slot(self.embed_tokens.weight, take=vocab)}
        slots["norm.weight"] = _Slot(self.norm.weight)
        if not cfg.tie_word_embeddings:
            slots["lm_head.weight"] = _Slot(self.lm_head.weight, take=vocab)
        qkv_rows = {"q": (0, local.q_size, "q"), "k": (local.q_size, local.kv_size, "kv")}
        qkv_rows["v"] = (local.q_size + local.kv_size, local.kv_size, "kv")
        for i, layer in enumerate(self.layers):
            attn, mlp = f"layers.{i}.self_attn.", f"layers.{i}.mlp."
            suffixes = ("weight", "bias") if cfg.qkv_bias else ("weight",)
            for suffix in suffixes:
                fused = getattr(layer.qkv_proj, suffix)
                for n, (start, rows, part) in qkv_rows.items():
                    slots[f"{attn}{n}_proj.{suffix}"] = _Slot(fused, start, rows, take(0, part))
            slots[attn + "o_proj.weight"] = _Slot(layer.o_proj.weight, take=take(1, "q"))
            n, cols = local.intermediate_size, take(0, "mlp")
            slots[mlp + "gate_proj.weight"] = _Slot(layer.gate_up_proj.weight, 0, n, cols)
            slots[mlp + "up_proj.weight"] = _Slot(layer.gate_up_proj.weight, n, n, cols)
            slots[mlp + "down_proj.weight"] = _Slot(layer.down_proj.weight, take=take(1, "mlp"))
            for norm in ("input_layernorm", "post_attention_layernorm"):
                slots[f"layers.{i}.{norm}.weight"] = _Slot(getattr(layer, norm).weight)
        covered = {id(s.param) for s in slots.values()}
        for name, p in self.named_parameters():
            if id(p) not in covered:  # a parameter added to the model but not to this table
                raise CheckpointError(f"parameter {name!r} is filled from no checkpoint tensor")
        return slots

    def linear_sources(self) -> list[tuple[PackedLinear, list[str]]]:
        """Each linear layer with the checkpoint tensors that fill its weight (HF names less
        `model.`), in row order: q, k, v for the fused projection, gate and up for the MLP's;
        a tied lm_head's is the embedding."""
        by_param: dict[int, list[tuple[int, str]]] = {}
        for name, slot in self._slots().items():
            if name.endswith(".weight"):
                by_param.setdefault(id(slot.param), []).append((slot.start, name))
        return [
            (m, [name for _, name in sorted(by_param[id(m.weight)])])
            for m in self.modules()
            if isinstance(m, PackedLinear) and m.weight is not None and id(m.weight) in by_param
        ]

    def load_hf_weights(
        self,
        weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        source: str,
    ) -> None:
        """Fill every parameter from HF-named tensors (`model.layers.N.self_attn.q_proj.weight`,
        ...), a mapping or a stream of (name, tensor) pairs: each is converted to its
        parameter's dtype and device and copied in (q/k/v and gate/up into their rows of the
        fused weights), then dropped, so a stream is held one tensor at a time. Names the model
        does not use are skipped; a missing or misshapen tensor is a CheckpointError naming it.
        A tensor given as None is served from elsewhere (a GGUF weight's stored blocks,
        loader.py): its rows are left unfilled, for the caller to replace the weight.
        """
        slots = self._slots()
        filled: set[str] = set()
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        with torch.no_grad():
            for full_name, value in pairs:
                name = full_name.removeprefix("model.")
                if name in slots:
                    if value is not None:  # None: served from elsewhere (`StoredBlocks`)
                        slot = slots[name]
                        _copy_into(slot.view(), slot.part(value, name, source), name, source)
                    filled.add(name)
                del value  # before the stream reads the next one
        for name in slots:
            if name not in filled:
                raise CheckpointError(f"{source}: tensor {name!r} is missing")


def _check_shape(value: torch.Tensor, want, name: str, source: str) -> None:
    if tuple(value.shape) != tuple(want):
        raise CheckpointError(
            f"{source}: tensor {name!r} has shape {tuple(value.shape)}, "
            f"expected {tuple(want)} for this config"
        )


def _copy_into(dest: torch.Tensor, value: torch.Tensor, name: str, source: str) -> None:
    _check_shape(value, dest.shape, name, source)
    if value.device != dest.device and value.dtype != dest.dtype:
        # Over in the checkpoint's own dtype, converted on arrival: a blocking copy_ across
        # devices converts on the host first, into a host temporary of the destination's size.
        value = value.to(dest.device)
    dest.copy_(value)
