"""Engine configuration: one frozen dataclass, validated once, errors naming the field. The
scheduler's configuration is derived from it (`EngineConfig.scheduler`), never set apart."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

from workers.engine.orders import Side, order_names
from workers.model.flash_rules import ATTENTION_BACKENDS, FLASH_PAGE_MULTIPLE, flash_refusal
from workers.model.quantization import KV_CACHE_DTYPES, QUANTIZATIONS

DTYPES = ("auto", "float32", "bfloat16", "float16")
POLICIES = order_names(Side.ENGINE)  # the orders an engine serves (orders.py)
BATCHING = ("continuous", "static")
OVERLAP = ("auto", "on", "off")
# What "auto" resolves to on each kind of device: a dtype and block size every backend there
# takes (flash-attn's pages are 256 tokens; the fallbacks take any size). On a GPU older than
# sm80, which has no bf16 arithmetic, the dtype is float16 instead (`EngineConfig.resolve`).
AUTO = {"cuda": ("bfloat16", FLASH_PAGE_MULTIPLE), "cpu": ("float32", 16)}


def described(text: str, **more) -> dict:
    """A config field's metadata: its help text (for the flag and `--help`), and `choices`
    or `aliases` (cluster/config_io.py reads them). Every config tree's fields use it."""
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
    fair_share: bool = True  # order tenants by tokens served for their weight (policy.py)
    aging_per_s: float = 0.0  # priority: what a request gains for each second it waits
    max_wait_s: float | None = None  # a request waiting this long goes first, any policy
    prefill_share: float = 1.0  # most of a step's token budget prompts take beside decodes

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
        if not 0 < self.prefill_share <= 1:
            raise ValueError(f"prefill_share={self.prefill_share}: must be in (0, 1]")
        if self.prefill_share < 1 and not self.enable_chunked_prefill:
            raise ValueError("prefill_share limits prompt chunks: it needs enable_chunked_prefill")
        if self.aging_per_s < 0:
            raise ValueError(f"aging_per_s={self.aging_per_s}: must be >= 0")
        if self.max_wait_s is not None and not self.max_wait_s > 0:
            raise ValueError(f"max_wait_s={self.max_wait_s}: must be positive (or unset)")
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
        metadata=described("a .gguf file or an HF folder (default: SmolLM2-135M-Instruct)"),
    )
    dtype: str = field(
        default="auto",
        metadata=described(
            "weights and KV cache (auto: bfloat16 on CUDA, float32 on CPU)", choices=DTYPES
        ),
    )
    device: str = field(
        default="auto",
        metadata=described("auto, cpu or cuda[:N] (auto: CUDA where a GPU is at hand)"),
    )
    quantization: str = field(
        default="none",
        metadata=described(
            "none: full-width weights (a GGUF is dequantized at load); int8: linear weights in "
            "int8 per output channel, quantized at load, against activations quantized as "
            "they arrive, a scale per 64 inputs; gguf: a GGUF file's Q8_0, Q4_0 and Q4_1 "
            "linear weights served as stored, other quantized types refused (int8 and gguf: "
            "CPU only); fp8: linear weights in fp8 e4m3 per output channel, quantized at load, "
            "against activations quantized per row (CUDA, compute capability 8.9 or newer). "
            "The KV cache keeps dtype",
            choices=QUANTIZATIONS,
        ),
    )
    kv_cache_dtype: str = field(
        default="auto",
        metadata=described(
            "auto: the KV cache in the model's dtype; fp8: in fp8 e4m3, half of bf16's bytes a "
            "token in memory and in the prefill-to-decode transfer (CPU only for now; values "
            "past +-448 saturate)",
            choices=KV_CACHE_DTYPES,
        ),
    )
    attention_backend: str = field(
        default="auto",
        metadata=described(
            "auto: flash-attn on CUDA where installed and the config suits it, else a paged "
            "torch path (Triton on CUDA, Tandem's kernels on CPU)",
            choices=ATTENTION_BACKENDS,
        ),
    )
    block_size: int | None = field(
        default=None, metadata=described("tokens per KV block (default: 256 on CUDA, 16 on CPU)")
    )
    num_kv_blocks: int | None = field(
        default=None, metadata=described("KV blocks (default: as many as --kv-cache-gb holds)")
    )
    kv_cache_gb: float = field(
        default=1.0, metadata=described("KV cache memory per worker, GiB (per rank under tp > 1)")
    )
    max_model_len: int | None = field(
        default=None, metadata=described("context length (default: the model's own)")
    )
    max_num_seqs: int = field(default=64, metadata=described("sequences in one batch"))
    max_num_batched_tokens: int = field(default=2048, metadata=described("tokens in one step"))
    enable_chunked_prefill: bool = field(
        default=True, metadata=described("split long prompts into chunks mixed with decodes")
    )
    prefill_chunk_size: int = field(default=512, metadata=described("most prompt tokens per step"))
    target_tpot_ms: float | None = field(
        default=None,
        metadata=described(
            "mean time per output token to keep running sequences at: each step's prompt "
            "chunk is sized to the time they can spare (default: off, full chunks)"
        ),
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=described("reuse KV of shared prefixes")
    )
    policy: str = field(
        default="fcfs",
        metadata=described(
            "scheduling order: fcfs, priority (lower first), shortest-first (prompt tokens "
            "left), sjf (prompt left plus predicted output left)",
            choices=POLICIES,
        ),
    )
    fair_share: bool = field(
        default=True,
        metadata=described("tenants first by tier, then by tokens served for their weight (VTC)"),
    )
    aging_per_s: float = field(
        default=0.0,
        metadata=described("priority policy: priority a request gains per second waiting"),
    )
    max_wait_s: float | None = field(
        default=None,
        metadata=described(
            "a request waiting this long goes ahead of all that have not, whatever the policy "
            "(default: off; shortest-first and sjf then let none wait past 10 s)"
        ),
    )
    prefill_share: float = field(
        default=1.0,
        metadata=described(
            "decode-first to prefill-first: the most of a step's tokens prompt chunks may "
            "take while decodes run (1: all the decodes leave)"
        ),
    )
    batching: str = field(default="continuous", metadata=described("", choices=BATCHING))
    seed: int = field(
        default=0,
        metadata=described("seeds the draw of per-request seeds for requests that set none"),
    )
    num_threads: int | None = field(
        default=None,
        metadata=described(
            "torch intra-op threads on CPU, per rank under tp > 1 (default: torch's choice; "
            "under tp > 1, the process's CPUs shared out)"
        ),
    )
    tp: int = field(
        default=1,
        metadata=described(
            "tensor-parallel ranks: the model's heads, MLP and vocabulary split over this "
            "many processes (a GPU each on CUDA, from the device's index on); in a cluster, "
            "colocated mode only for now",
            colocated_only=True,
        ),
    )
    cuda_graphs: bool = field(
        default=True,
        metadata=described(
            "replay decode steps from CUDA graphs captured per batch size (CUDA only)"
        ),
    )

    overlap: str = field(
        default="auto",
        metadata=described(
            "schedule the next step while the device runs this one (auto: on CUDA only, "
            "where the device runs apart from the host)",
            choices=OVERLAP,
        ),
    )

    def __post_init__(self) -> None:
        if self.overlap not in OVERLAP:
            raise ValueError(f"overlap={self.overlap!r}: choose from {', '.join(OVERLAP)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose from {', '.join(DTYPES)}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization={self.quantization!r}: choose from {', '.join(QUANTIZATIONS)}"
            )
        if self.quantization in ("int8", "gguf") and self.device.startswith("cuda"):
            raise ValueError(
                f"quantization={self.quantization!r} runs on the CPU only (device='cpu'; on "
                "CUDA, quantization='fp8' or 'none')"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r}: choose from {', '.join(KV_CACHE_DTYPES)}"
            )
        if self.kv_cache_dtype == "fp8" and self.device.startswith("cuda"):
            raise ValueError(
                "kv_cache_dtype='fp8' runs on the CPU only for now: the CUDA attention kernels "
                "(Triton, flash-attn) read the model's dtype (kv_cache_dtype='auto')"
            )
        if self.quantization == "gguf" and self.model and Path(self.model).expanduser().is_dir():
            raise ValueError(
                f"quantization='gguf' serves a GGUF file's weights as stored; model="
                f"{self.model!r} is an HF folder (quantization='int8' quantizes any "
                "checkpoint at load)"
            )
        if self.quantization == "fp8" and self.device == "cpu":
            raise ValueError(
                "quantization='fp8' runs on CUDA GPUs of compute capability 8.9 or newer "
                "(on the CPU, quantization='int8')"
            )
        if self.device != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device={self.device!r}: choose auto, cpu or cuda[:N]")
        if self.device == "cpu" and self.dtype == "float16":
            raise ValueError("dtype='float16' is for GPUs; on the CPU use float32 or bfloat16")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend={self.attention_backend!r}: choose from "
                + ", ".join(ATTENTION_BACKENDS)
            )
        bs = self.block_size
        if bs is not None and (isinstance(bs, bool) or bs <= 0 or bs & (bs - 1)):
            raise ValueError(f"block_size={bs}: must be a positive power of two")
        if self.attention_backend == "flash-attn":
            self._check_flash()
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks}: must be positive")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"kv_cache_gb={self.kv_cache_gb}: must be positive")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len={self.max_model_len}: must be > 1")
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads={self.num_threads}: must be positive")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ValueError(f"tp={self.tp!r}: must be a whole number of ranks, 1 or more")
        if self.tp > 1 and self.quantization == "gguf":
            raise ValueError(
                "quantization='gguf' serves a GGUF's blocks whole, on one rank: with tp > 1, "
                "choose quantization 'int8' or 'none'"
            )
        self.scheduler(self.max_model_len or 8192)  # its checks name engine fields too

    def _check_flash(self) -> None:
        """What flash-attn refuses, refused when the config loads rather than at every step;
        a dtype or block size left to auto resolves to what it takes."""
        if self.device == "cpu":
            raise ValueError(
                "attention_backend='flash-attn' runs on CUDA only: set device to cuda or auto"
            )
        dtype = None if self.dtype == "auto" else self.dtype
        why = flash_refusal(dtype=dtype, block_size=self.block_size)
        if why is not None:
            raise ValueError(
                f"{why} (attention_backend='flash-attn'; leave block_size and dtype unset for "
                f"{FLASH_PAGE_MULTIPLE} and bfloat16, or choose attention_backend auto)"
            )

    def resolve(self, cuda: bool | None = None, bf16: bool | None = None) -> EngineConfig:
        """This config with device, dtype and block size fixed: `device: auto` is CUDA where
        `cuda` says a GPU is at hand (default: whether torch sees one), and the dtype and
        block size left unset take that device's defaults, which every backend there takes:
        on CUDA, bfloat16 where the GPU computes in it (`bf16`; default: Ampere, sm80, or
        newer, as torch reports), else float16."""
        device = self.device
        if device == "auto":
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            device = "cuda" if cuda else "cpu"
        kind = device.partition(":")[0]
        dtype, block_size = AUTO[kind]
        if self.dtype == "auto" and kind == "cuda":
            if bf16 is None:
                bf16 = _gpu_computes_bf16(device)
            dtype = "bfloat16" if bf16 else "float16"
        return replace(
            self,
            device=device,
            dtype=dtype if self.dtype == "auto" else self.dtype,
            block_size=self.block_size or block_size,
        )

    def kv_blocks(self, num_layers: int, kv_size: int) -> int:
        """The KV blocks that kv_cache_gb holds for a model of this many layers and K (or
        V) width per token, in the KV cache's dtype; the dtype resolved."""
        itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        if self.kv_cache_dtype == "fp8":
            itemsize = 1
        per_block = 2 * num_layers * self.block_size * kv_size * itemsize
        return max(1, int(self.kv_cache_gb * 2**30) // per_block)

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
            fair_share=self.fair_share,
            aging_per_s=self.aging_per_s,
            max_wait_s=self.max_wait_s,
            prefill_share=self.prefill_share,
            batching=self.batching,
            max_model_len=max_model_len,
        )


def _gpu_computes_bf16(device: str) -> bool:
    """Whether this CUDA device computes in bfloat16 natively (sm80 or newer); assumed so
    where no GPU is visible (a config checked on a head node)."""
    import torch

    if not torch.cuda.is_available():
        return True
    index = torch.device(device).index
    return torch.cuda.get_device_capability(index) >= (8, 0)
