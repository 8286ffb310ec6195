"""Engine configuration: one frozen dataclass, validated once, errors naming the field. The
scheduler's configuration is derived from it (`EngineConfig.scheduler`), never set apart."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DTYPES = ("float32", "bfloat16", "float16")
POLICIES = ("fcfs", "priority", "shortest-first")
BATCHING = ("continuous", "static")
ATTENTION_BACKENDS = ("auto", "torch", "torch-sdpa", "flash-attn")


def _h(text: str, **more) -> dict:
    return {"help": text, **more}


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    prefill_chunk_size: int = 512  # most prompt tokens one request may compute per step
    policy: str = "fcfs"
    batching: str = "continuous"
    max_model_len: int = 8192
    watermark: float = 0.01  # share of blocks kept free at admission
    # Pace prompt chunks so running sequences keep this mean time per output token (pacing.py)
    target_tpot_ms: float | None = None

    def __post_init__(self) -> None:
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "prefill_chunk_size",
            "max_model_len",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be positive")
        if self.batching not in BATCHING:
            raise ValueError(f"batching={self.batching!r}: choose continuous or static")
        if self.policy not in POLICIES:
            raise ValueError(
                f"policy {self.policy!r} is unknown (choose from {', '.join(POLICIES)})"
            )
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark={self.watermark}: must be in [0, 1)")
        if self.target_tpot_ms is not None:
            t = self.target_tpot_ms
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf:
                raise ValueError(f"target_tpot_ms={t}: must be a positive number of ms")
            if not self.enable_chunked_prefill:
                raise ValueError(
                    "target_tpot_ms paces prompt chunks: it needs enable_chunked_prefill"
                )


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = field(
        default=None,
        metadata=_h("a .gguf file or an HF folder (default: SmolLM2-135M-Instruct)"),
    )
    dtype: str = field(default="float32", metadata=_h("weights and KV cache", choices=DTYPES))
    device: str = field(default="cpu", metadata=_h("cpu or cuda[:N]"))
    attention_backend: str = field(default="auto", metadata=_h("", choices=ATTENTION_BACKENDS))
    block_size: int = field(default=16, metadata=_h("tokens per KV block"))
    num_kv_blocks: int | None = field(
        default=None, metadata=_h("KV blocks (default: as many as --kv-cache-gb holds)")
    )
    kv_cache_gb: float = field(default=1.0, metadata=_h("KV cache memory per worker, GiB"))
    max_model_len: int | None = field(
        default=None, metadata=_h("context length (default: the model's own)")
    )
    max_num_seqs: int = field(default=64, metadata=_h("sequences in one batch"))
    max_num_batched_tokens: int = field(default=2048, metadata=_h("tokens in one step"))
    enable_chunked_prefill: bool = field(
        default=True, metadata=_h("split long prompts into chunks mixed with decodes")
    )
    prefill_chunk_size: int = field(default=512, metadata=_h("most prompt tokens per step"))
    target_tpot_ms: float | None = field(
        default=None,
        metadata=_h(
            "mean time per output token to keep running sequences at: each step's prompt "
            "chunk is sized to the time they can spare (default: off, full chunks)"
        ),
    )
    enable_prefix_caching: bool = field(default=True, metadata=_h("reuse KV of shared prefixes"))
    policy: str = field(default="fcfs", metadata=_h("scheduling order", choices=POLICIES))
    batching: str = field(default="continuous", metadata=_h("", choices=BATCHING))
    seed: int = field(
        default=0, metadata=_h("seeds the draw of per-request seeds for requests that set none")
    )
    num_threads: int | None = field(
        default=None, metadata=_h("torch intra-op threads on CPU (default: torch's choice)")
    )

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose from {', '.join(DTYPES)}")
        if self.device == "cpu" and self.dtype == "float16":
            raise ValueError("dtype='float16' is for GPUs; on the CPU use float32 or bfloat16")
        if not self.device.startswith(("cpu", "cuda")):
            raise ValueError(f"device={self.device!r}: choose cpu or cuda[:N]")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend={self.attention_backend!r}: choose from "
                + ", ".join(ATTENTION_BACKENDS)
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size}: must be a positive power of two")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks}: must be positive")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb={self.kv_cache_gb}: must be positive")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len={self.max_model_len}: must be > 1")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads={self.num_threads}: must be positive")
        self.scheduler(self.max_model_len or 8192)  # its checks name engine fields too

    def context_len(self, model_max: int) -> int:
        """The longest sequence (prompt and output) an engine of this config takes, for a
        model whose own context is `model_max`: max_model_len caps it, never raises it."""
        return min(self.max_model_len or model_max, model_max)

    def scheduler(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's configuration, once the model's context length is known."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            prefill_chunk_size=self.prefill_chunk_size,
            target_tpot_ms=self.target_tpot_ms,
            policy=self.policy,
            batching=self.batching,
            max_model_len=max_model_len,
        )
