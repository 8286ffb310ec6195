"""Engine configuration: one frozen dataclass, validated once, errors naming the field."""

from __future__ import annotations

from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the default SmolLM2-135M-Instruct
    dtype: str = "float32"
    device: str = "cpu"
    attention_backend: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: as many as kv_cache_memory_gb holds
    kv_cache_memory_gb: float = 1.0
    max_model_len: int | None = None  # None: the model's own context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    prefill_chunk_size: int = 512
    enable_prefix_caching: bool = True
    policy: str = "fcfs"
    batching: str = "continuous"
    seed: int = 0  # seeds the draw of per-request seeds for requests that set none
    num_threads: int | None = None  # torch intra-op threads on CPU; None keeps torch's choice

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose from {', '.join(DTYPES)}")
        if self.device == "cpu" and self.dtype == "float16":
            raise ValueError("dtype='float16' is for GPUs; on the CPU use float32 or bfloat16")
        if not self.device.startswith(("cpu", "cuda")):
            raise ValueError(f"device={self.device!r}: choose cpu or cuda[:N]")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size}: must be a positive power of two")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks}: must be positive")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb={self.kv_cache_memory_gb}: must be positive")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len={self.max_model_len}: must be > 1")
