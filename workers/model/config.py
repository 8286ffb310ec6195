"""The architecture of a Llama-family checkpoint, read from HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or malformed. The message names the file."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None for default RoPE; otherwise the HF rope parameters (rope_type "llama3", factor, ...).
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    architecture: str = "llama"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a Hugging Face config dict (transformers 4.x or 5.x field names)."""
        arch = cfg.get("model_type", "llama")
        if arch not in ("llama", "qwen2", "mistral"):
            raise CheckpointError(f"{source}: model_type {arch!r} is not a Llama-family decoder")

        def need(key: str) -> Any:
            if key not in cfg:
                raise CheckpointError(f"{source}: required field {key!r} is missing")
            return cfg[key]

        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        theta, scaling = _rope_from_hf(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", arch == "qwen2")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            architecture=arch,
        )


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """transformers 5.x nests theta in `rope_parameters`; 4.x has `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default"))
        return theta, (None if kind == "default" else dict(params))
    theta = float(cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if not scaling or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return theta, None
    return theta, dict(scaling)
