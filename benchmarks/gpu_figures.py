"""The figures benchmarks/gpu_check.py measures after its checks, each against its floor, on a
model of a given shape with random weights made on the device:

- read-bandwidth: GB/s of a sum over a large tensor (8 GiB on a GPU);
- decode-step-bN: a decode step's time at batch N, with every row's context at the shape's
  context length; floor: the model's linear layers alone (QKV, O, gate-up, down, lm_head) at
  that batch, chained in one CUDA graph (on the CPU, run as they are), with no attention,
  norms, sampling or Python. At large batches the KV read is on top of the floor: for the 8b
  shape at batch 256 of 512 tokens it is more bytes than the weights (a ratio near 2.2 is
  then the hardware's, at batch 64 near 1.3);
- prefill: one prompt's prefill (2,048 tokens) to its first token, as TFLOP/s of the model's
  matmuls over its wall time; floor: the same matmuls alone;
- offline: output tokens per second of a batch of requests (256 of 512 in, 128 out,
  max_num_seqs 256); floor: the same tokens at the floors above (every prompt token at the
  prefill floor's rate, every decode step at the floor of the full batch).
- with quantization fp8: decode-step-bN-fp8, the same step with the same weights quantized to
  fp8 at load (quantization: fp8), against the same bf16 floor, and fp8-over-bf16-bN, its time
  over the bf16 step's (a ratio: target at batch 1, at most 0.6).

Each figure has `name`, `value` (its unit in `unit`), `floor` and `ratio`: how many times the
floor's time it took (1.0 is the floor itself). Timings are medians of repeated runs on this
machine: compare ratios, never figures across machines.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.request import SamplingParams
from workers.model.config import ModelConfig
from workers.model.loader import assemble_model

SMOLLM2 = ModelConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
LLAMA3_8B = ModelConfig(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=8192,
)
SHAPES = {"smollm2": SMOLLM2, "8b": LLAMA3_8B}


@dataclass(frozen=True)
class Plan:
    """What is measured, at what size."""

    context: int  # tokens of context of each decode row
    batches: tuple[int, ...]
    prompt: int  # the prefill's prompt
    requests: int  # the offline batch
    prompt_in: int
    tokens_out: int
    max_num_seqs: int
    steps: int  # timed decode steps per batch

    @classmethod
    def of(cls, shape: str, quick: bool, cuda: bool) -> Plan:
        if quick:
            return cls(32, (1, 16), 128, 8, 32, 8, 8, 3)
        context = 512 if shape == "8b" else 128
        steps = 50 if cuda else 5
        return cls(context, (1, 16, 64, 256), 2048, 256, 512, 128, 256, steps)


RATES = ("GB/s", "TFLOP/s", "tok/s")  # higher is faster; the rest are times


@dataclass
class Figure:
    name: str
    value: float
    unit: str
    floor: float | None = None
    ratio: float | None = None  # times the floor's time

    def __post_init__(self) -> None:
        if self.floor:
            rate = self.unit in RATES
            self.ratio = self.floor / self.value if rate else self.value / self.floor

    def line(self) -> str:
        floor = "" if self.floor is None else f"  floor {self.floor:,.3g}  ({self.ratio:.2f}x)"
        return f"{self.name:<18} {self.value:>12,.3g} {self.unit}{floor}"


def random_model(
    cfg: ModelConfig, dev: torch.device, dtype: torch.dtype, seed: int = 0, quantization="none"
):
    """The model with seeded random weights made on `dev`, one tensor at a time, streamed
    through the checkpoint loader (and quantized as `quantization` asks)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    h, q, kv, f = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size

    def w(*shape, std=0.02, one=False):
        t = torch.randn(*shape, generator=g, device=dev, dtype=dtype) * std
        return t + 1 if one else t

    def tensors():
        yield "model.embed_tokens.weight", w(cfg.vocab_size, h, std=0.1)
        yield "model.norm.weight", w(h, std=0.1, one=True)
        if not cfg.tie_word_embeddings:
            yield "lm_head.weight", w(cfg.vocab_size, h)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            yield p + "self_attn.q_proj.weight", w(q, h)
            yield p + "self_attn.k_proj.weight", w(kv, h)
            yield p + "self_attn.v_proj.weight", w(kv, h)
            yield p + "self_attn.o_proj.weight", w(h, q)
            yield p + "mlp.gate_proj.weight", w(f, h)
            yield p + "mlp.up_proj.weight", w(f, h)
            yield p + "mlp.down_proj.weight", w(h, f)
            yield p + "input_layernorm.weight", w(h, std=0.1, one=True)
            yield p + "post_attention_layernorm.weight", w(h, std=0.1, one=True)

    return assemble_model(cfg, tensors(), dtype, dev, "random weights", quantization=quantization)


def matmul_flops(cfg: ModelConfig, rows: int, logits_rows: int) -> float:
    """FLOPs of the model's linear layers over `rows` tokens, lm_head over `logits_rows`."""
    per_layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size
    return 2.0 * (
        rows * per_layer * cfg.num_layers + logits_rows * cfg.hidden_size * cfg.vocab_size
    )


def _timed(fn, dev: torch.device, repeats: int, calls: int = 1) -> float:
    """Median seconds a call of `fn()`, over `repeats` runs of `calls` calls back to back
    with one wait for the device at the end, after one call to warm. With several calls, a
    step left running (overlap) is counted where it runs, behind the host's work on the
    next, as in serving."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def linear_floor(model, rows: int, logits_rows: int, dev: torch.device, repeats: int) -> float:
    """Seconds of the model's linear layers alone over `rows` tokens (lm_head over
    `logits_rows`), in one CUDA graph on CUDA."""
    cfg = model.cfg
    x = torch.randn(rows, cfg.hidden_size, device=dev).to(model.embed_tokens.weight.dtype)
    attn = torch.randn(rows, cfg.q_size, device=dev).to(x.dtype)
    act = torch.randn(rows, cfg.intermediate_size, device=dev).to(x.dtype)

    def chain():
        for layer in model.layers:
            layer.qkv_proj(x)
            layer.o_proj(attn)
            layer.gate_up_proj(x)
            layer.down_proj(act)
        model.lm_head(x[:logits_rows])

    with torch.inference_mode():
        if dev.type != "cuda":
            return _timed(chain, dev, repeats)
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            chain()  # cuBLAS chooses its kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain()
        return _timed(graph.replay, dev, repeats)


def read_bandwidth(dev: torch.device, quick: bool) -> Figure:
    gib = 0.25 if quick or dev.type != "cuda" else 8.0
    x = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32, device=dev)
    seconds = _timed(x.sum, dev, 5)
    return Figure("read-bandwidth", x.numel() * 4 / seconds / 1e9, "GB/s")


def _engine(model, dev, plan: Plan, **config) -> LLMEngine:
    block = 256 if dev.type == "cuda" else 16
    rows = max(plan.max_num_seqs, max(plan.batches))
    per_row = -(-(max(plan.context, plan.prompt_in + plan.tokens_out) + 64) // block) + 1
    blocks = max(rows * per_row, -(-plan.prompt // block) + 2)
    cfg = EngineConfig(
        device=str(dev),
        dtype=str(model.embed_tokens.weight.dtype).removeprefix("torch."),
        max_model_len=max(plan.prompt, plan.context + 256, plan.prompt_in + plan.tokens_out) + 64,
        max_num_seqs=rows,
        num_kv_blocks=blocks,
        max_num_batched_tokens=max(plan.prompt, 2048),
        prefill_chunk_size=plan.prompt,
        **config,
    )
    return LLMEngine(cfg, tokenizer=_NoTokenizer(), model=model)


class _NoTokenizer:
    eos_token_id = None


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=g).tolist()


def _released(dev: torch.device) -> None:
    """An engine's cache handed back before the next one is made (the 8B shape's is tens
    of GB)."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def decode_steps(model, dev, plan: Plan) -> dict[int, float]:
    """Median seconds of a decode step at each batch, every row at `plan.context` tokens."""
    engine = _engine(model, dev, plan)
    out = {}
    for batch in plan.batches:
        ids = [
            engine.add_request(p, SamplingParams(max_tokens=10**6, ignore_eos=True))
            for p in _prompts(batch, plan.context, model.cfg.vocab_size, batch)
        ]
        sched = engine.scheduler
        while sched.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in sched.running
        ):
            engine.step()
        out[batch] = _timed(engine.step, dev, 3, calls=plan.steps)
        if len(sched.running) != batch:
            raise RuntimeError(f"{len(sched.running)} of {batch} rows running")
        for i in ids:
            engine.abort(i)
    return out


def prefill_seconds(model, dev, plan: Plan) -> float:
    """Seconds from a prompt's submission to its first token (median of three)."""
    engine = _engine(model, dev, plan)
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    seeds = iter(range(7, 10**6))

    def one():  # a prompt of its own each time: never a prefix-cache hit
        engine.add_request(_prompts(1, plan.prompt, model.cfg.vocab_size, next(seeds))[0], sp)
        while engine.has_unfinished():
            engine.step()

    return _timed(one, dev, 3 if dev.type == "cuda" else 1)


def offline_tokens_per_s(model, dev, plan: Plan) -> float:
    engine = _engine(model, dev, plan)
    sp = SamplingParams(max_tokens=plan.tokens_out, ignore_eos=True, temperature=0)
    prompts = _prompts(plan.requests, plan.prompt_in, model.cfg.vocab_size, 3)
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, sp)
    made = 0
    while engine.has_unfinished():
        made += sum(len(o.new_token_ids) for o in engine.step())
    return made / (time.perf_counter() - t0)


def measure(
    shape: str, dev: torch.device, quick: bool, log=print, quantization: str = "none"
) -> list[Figure]:
    """Every figure above for `shape` on `dev` (bf16, graphs on where the device has them);
    with quantization fp8, the decode steps again with fp8 weights."""
    cfg = SHAPES[shape]
    plan = Plan.of(shape, quick, dev.type == "cuda")
    figures = [read_bandwidth(dev, quick)]
    log(figures[-1].line())
    model = random_model(cfg, dev, torch.bfloat16)
    repeats = 20 if dev.type == "cuda" else 3
    steps = decode_steps(model, dev, plan)
    _released(dev)
    floors = {}
    for batch, seconds in steps.items():
        floors[batch] = floor = linear_floor(model, batch, batch, dev, repeats)
        figures.append(Figure(f"decode-step-b{batch}", 1e3 * seconds, "ms", 1e3 * floor))
        log(figures[-1].line())

    flops = matmul_flops(cfg, plan.prompt, 1)
    seconds = prefill_seconds(model, dev, plan)
    _released(dev)
    floor_s = linear_floor(model, plan.prompt, 1, dev, repeats)
    figures.append(Figure("prefill", flops / seconds / 1e12, "TFLOP/s", flops / floor_s / 1e12))
    log(figures[-1].line())
    made = offline_tokens_per_s(model, dev, plan)
    _released(dev)
    step_floor = linear_floor(model, plan.max_num_seqs, plan.max_num_seqs, dev, repeats)
    prompt_floor = floor_s / plan.prompt * plan.prompt_in * plan.requests
    rounds = plan.tokens_out * -(-plan.requests // plan.max_num_seqs)
    floor_rate = plan.requests * plan.tokens_out / (prompt_floor + rounds * step_floor)
    figures.append(Figure("offline", made, "tok/s", floor_rate))
    log(figures[-1].line())
    if quantization == "fp8":  # the bf16 model gone first: the two need not fit at once
        del model
        _released(dev)
        figures += fp8_decode_steps(cfg, dev, plan, steps, floors, log)
    return figures


def fp8_decode_steps(cfg, dev, plan: Plan, bf16_steps: dict, floors: dict, log) -> list[Figure]:
    """The decode steps with the same random weights quantized to fp8 at load, each against
    the bf16 floor and the bf16 step."""
    model = random_model(cfg, dev, torch.bfloat16, quantization="fp8")
    figures = []
    for batch, seconds in decode_steps(model, dev, plan).items():
        figures.append(
            Figure(f"decode-step-b{batch}-fp8", 1e3 * seconds, "ms", 1e3 * floors[batch])
        )
        log(figures[-1].line())
        figures.append(Figure(f"fp8-over-bf16-b{batch}", seconds / bf16_steps[batch], "x"))
        log(figures[-1].line())
    del model
    _released(dev)
    return figures


def as_json(figures: list[Figure]) -> list[dict]:
    return [asdict(f) for f in figures]
