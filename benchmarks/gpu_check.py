"""The first thing to run on a GPU: Tandem's CUDA path, checked in one file that needs torch
alone (no Ray, Redis or flash-attn; Triton and flash-attn are used where present).

    python benchmarks/gpu_check.py --shape 8b       # on cuda:0: the checks, then the figures
    python benchmarks/gpu_check.py --device cpu     # the same on the CPU (the test suite: --quick)

The default model's weights are not needed: a model of SmolLM2-135M's shape (30 layers, 9
heads over 3 KV heads of 64) with seeded random weights stands in, loaded through the same
streaming loader as a checkpoint. One line per check, PASS, FAIL or SKIP, with what was
compared and how long it took; exit status 1 if any check fails; `--json F` writes them all.

- engine: the engine on the device (bf16, the backend `auto` picks there) against the CPU
  engine in fp32, greedy and seeded, a prompt prefilled in small chunks, and a prefix-cache
  hit. Outputs are compared token by token, as vLLM's tests compare logprobs: equal until a
  first divergence, which must be a near-tie on both sides; and each equal token's logprob
  within a tolerance of the reference's.
- sampler: the same logits and parameters draw the same tokens on the device and the CPU.
- kv-protocol: a KV transfer of CUDA tensors, in place and staged, on streams of its own,
  lands every byte.
- nccl: a stalled operation times out in the caller and the process lives; a peer that never
  joins is a timeout, not a hang (on the CPU: the same through gloo).
- graphs: decode steps replayed from CUDA graphs equal eager steps.

Then the figures (benchmarks/gpu_figures.py), on a model of `--shape` (smollm2, or 8b: Llama-3
8B's) with random weights made on the device, each against its floor, the model's matmuls
alone: the card's read bandwidth, the decode step at batch 1, 16, 64 and 256, one 2,048-token
prompt's prefill in TFLOP/s, and offline throughput (256 requests of 512 in, 128 out).
`--json F` writes {"checks": [...], "figures": [...]}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.gpu_figures import SHAPES, SMOLLM2, as_json, measure  # noqa: E402
from kv_transfer.streams import indexed  # noqa: E402
from workers.engine.config import EngineConfig  # noqa: E402
from workers.engine.cuda_graphs import EagerReplay  # noqa: E402
from workers.engine.engine import LLMEngine  # noqa: E402
from workers.engine.request import SamplingParams  # noqa: E402
from workers.model.config import ModelConfig  # noqa: E402
from workers.model.loader import assemble_model  # noqa: E402

MAX_LEN = 2048
TOP = 20  # alternatives asked for with every token, to judge a divergence


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL, SKIP
    detail: str
    seconds: float = 0.0
    data: dict = field(default_factory=dict)

    def line(self) -> str:
        return f"{self.status:<4}  {self.name:<22} {self.detail} ({self.seconds:.1f} s)"


class NoTokenizer:
    """The engine reads no text here (no stop strings): only the EOS id, which there is none
    of (requests ignore EOS anyway)."""

    eos_token_id = None


def random_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named weights, seeded. Embeddings larger than an initialised model's, so that the
    next-token distribution is peaked enough for greedy choices to be stable."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.02):
        return torch.randn(*shape, generator=g) * std

    h, q, kv, f = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    out = {"model.embed_tokens.weight": w(cfg.vocab_size, h, std=0.1)}
    out["model.norm.weight"] = 1 + w(h, std=0.1)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = w(q, h)
        out[p + "self_attn.k_proj.weight"] = w(kv, h)
        out[p + "self_attn.v_proj.weight"] = w(kv, h)
        out[p + "self_attn.o_proj.weight"] = w(h, q)
        out[p + "mlp.gate_proj.weight"] = w(f, h)
        out[p + "mlp.up_proj.weight"] = w(f, h)
        out[p + "mlp.down_proj.weight"] = w(h, f)
        out[p + "input_layernorm.weight"] = 1 + w(h, std=0.1)
        out[p + "post_attention_layernorm.weight"] = 1 + w(h, std=0.1)
    return out


class Models:
    """One model per (device, dtype), built once from the same weights and shared by every
    engine on it (each engine owns its own KV cache)."""

    def __init__(self) -> None:
        self.weights = random_weights(SMOLLM2)
        self.built: dict = {}

    def get(self, device: torch.device, dtype: str):
        key = (str(device), dtype)
        if key not in self.built:
            self.built[key] = assemble_model(
                SMOLLM2, self.weights.items(), getattr(torch, dtype), device, "random weights"
            )
        return self.built[key]

    def engine(self, device: torch.device, dtype: str, make_graph=None, **config) -> LLMEngine:
        block = 256 if device.type == "cuda" else 16
        config.setdefault("num_kv_blocks", 24576 // block)
        cfg = EngineConfig(device=str(device), dtype=dtype, max_model_len=MAX_LEN, **config)
        return LLMEngine(
            cfg, tokenizer=NoTokenizer(), model=self.get(device, dtype), make_graph=make_graph
        )


def generate(engine: LLMEngine, prompts, sampling) -> list[list[tuple[int, dict]]]:
    """Per prompt: (token, {alternative: logprob}) for every output token."""
    ids = [engine.add_request(p, sampling) for p in prompts]
    out: dict[str, list] = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            tops = o.new_top_logprobs or [()] * len(o.new_token_ids)
            out[o.request_id] += [(t, dict(top)) for t, top in zip(o.new_token_ids, tops)]
    assert engine.pool.num_free_blocks == engine.pool.num_blocks, "KV blocks leaked"
    return [out[i] for i in ids]


def compare(ref, got, lp_tol: float, tie_tol: float) -> tuple[bool, str, int, float]:
    """Equal until a first divergence, which must be a near-tie on both sides (each token in
    the other's alternatives, their logprobs within tie_tol of each other: None for a seeded
    draw, whose two tokens need only be likely on both sides); every equal token's logprob
    within lp_tol. (ok, why not, tokens equal, largest logprob gap)."""
    equal, gap = 0, 0.0
    for (ta, tops_a), (tb, tops_b) in zip(ref, got):
        if ta == tb:
            if ta in tops_a and tb in tops_b:
                gap = max(gap, abs(tops_a[ta] - tops_b[tb]))
            equal += 1
            continue
        tie = (
            tb in tops_a
            and ta in tops_b
            and (
                tie_tol is None
                or abs(tops_a[ta] - tops_a[tb]) <= tie_tol
                and abs(tops_b[ta] - tops_b[tb]) <= tie_tol
            )
        )
        if not tie:
            return False, f"diverged at token {equal}: {ta} vs {tb}, not a near-tie", equal, gap
        break
    if len(ref) != len(got):
        return False, f"{len(ref)} tokens against {len(got)}", equal, gap
    if gap > lp_tol:
        return False, f"a logprob {gap:.3f} from the reference's", equal, gap
    return True, "", equal, gap


def prompts(n: int, length: int, seed: int, spread: int = 7) -> list[list[int]]:
    """n random prompts, the i-th `length + spread * i` tokens long."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(100, SMOLLM2.vocab_size, (length + spread * i,), generator=g).tolist()
        for i in range(n)
    ]


# -- checks ---------------------------------------------------------------------------------


def check_engine(models: Models, dev: torch.device, quick: bool) -> list[Result]:
    """The engine on `dev` in bf16 against the CPU engine in fp32."""
    cpu = torch.device("cpu")
    ref = models.engine(cpu, "float32")
    got = models.engine(dev, "bfloat16")
    tokens = 8 if quick else 24
    tol = {"lp_tol": 0.6, "tie_tol": 0.6}  # bf16 through 30 layers, against fp32
    t0 = time.perf_counter()
    ps, sp = prompts(3, 40, 1), _with_logprobs(SamplingParams(max_tokens=tokens, temperature=0))
    outs = zip(generate(ref, ps, sp), generate(got, ps, sp))
    results = [_judge("engine-greedy", outs, tol, t0, f"{dev} bf16 vs cpu fp32")]
    # Seeded draws among each row's 20 best: where the two part, both tokens must be likely
    # on both sides. How soon they part depends on how flat the rows are and on the device's
    # bf16 arithmetic, so the count of equal tokens is reported, never judged: that a draw
    # follows its seed is the sampler check's (the same logits draw the same token).
    t0 = time.perf_counter()
    ps = prompts(3, 33, 2)
    sp = _with_logprobs(SamplingParams(max_tokens=tokens, temperature=0.8, top_k=20, seed=5))
    again = generate(got, ps, sp)
    outs = list(zip(generate(ref, ps, sp), generate(got, ps, sp)))
    res = _judge("engine-seeded", outs, {"lp_tol": 0.6, "tie_tol": None}, t0, "top-20 draws")
    if [b for _, b in outs] != again:
        res.status, res.detail = "FAIL", "two seeded runs on the device drew differently"
    results.append(res)
    # A long prompt prefilled in chunks of 128 on the device, whole on the CPU.
    t0 = time.perf_counter()
    chunked = models.engine(dev, "bfloat16", prefill_chunk_size=128, max_num_batched_tokens=256)
    long = prompts(1, 700, 3)
    sp = _with_logprobs(SamplingParams(max_tokens=8, temperature=0.0))
    outs = zip(generate(ref, long, sp), generate(chunked, long, sp))
    results.append(_judge("engine-chunked-prefill", outs, tol, t0, "700 tokens in 128s"))
    # A prefix-cache hit on the device, against a CPU engine with no cache.
    t0 = time.perf_counter()
    cached = models.engine(dev, "bfloat16")
    nocache = models.engine(cpu, "float32", enable_prefix_caching=False)
    shared = prompts(1, 600, 4)[0]
    first, second = shared + prompts(1, 20, 5)[0], shared + prompts(1, 30, 6)[0]
    generate(cached, [first], sp)
    hits = cached.pool.num_prefix_hits
    outs = list(zip(generate(nocache, [second], sp), generate(cached, [second], sp)))
    hit = cached.pool.num_prefix_hits - hits
    res = _judge("engine-prefix-cache", outs, tol, t0, f"{hit} cached blocks reused")
    if hit == 0:
        res.status, res.detail = "FAIL", "the second prompt found no cached blocks"
    results.append(res)
    return results


def _with_logprobs(sp: SamplingParams) -> SamplingParams:
    return replace(sp, logprobs=True, top_logprobs=TOP, ignore_eos=True)


def _judge(name, pairs, tol, t0, what) -> Result:
    pairs = list(pairs)
    verdicts = [compare(a, b, **tol) for a, b in pairs]
    equal = sum(v[2] for v in verdicts)
    total = sum(len(a) for a, _ in pairs)
    gap = max(v[3] for v in verdicts)
    bad = [v[1] for v in verdicts if not v[0]]
    detail = f"{what}: {equal}/{total} tokens equal, largest logprob gap {gap:.3f}"
    if bad:
        detail += "; " + "; ".join(bad)
    return Result(
        name,
        "FAIL" if bad else "PASS",
        detail,
        time.perf_counter() - t0,
        {"equal": equal, "total": total, "gap": gap},
    )


def check_sampler(dev: torch.device) -> Result:
    """Identical logits and parameters draw identical tokens on both devices."""
    from workers.engine.sampler import FilterPlan, SamplingTensors, row_uniforms, sample

    t0 = time.perf_counter()
    rows, vocab = 64, SMOLLM2.vocab_size
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(rows, vocab, generator=g) * 3
    r = torch.arange(rows)
    top_k = torch.where(r % 5 == 1, 40, 0).tolist()
    top_p = torch.where(r % 3 == 2, 0.9, 1.0).tolist()

    def tensors(d):
        col = lambda v, dt=torch.float32: v.to(device=d, dtype=dt)  # noqa: E731
        return SamplingTensors(
            temperature=col(torch.where(r % 4 == 0, 0.0, 0.5 + (r % 3) * 0.3)),
            top_k=col(torch.tensor(top_k), torch.long),
            top_p=col(torch.tensor(top_p)),
            uniforms=col(torch.from_numpy(row_uniforms(r * 1_000_003 + 11, r % 17)), torch.float64),
            all_greedy=False,
            filters=FilterPlan.of(top_k, top_p, vocab, sort_all=d.type == "cuda"),
            want_logprobs=True,
            min_p=col(torch.where(r % 7 == 3, 0.05, 0.0)),
            top_logprobs=5,
        )

    a = sample(logits, tensors(torch.device("cpu")))
    b = sample(logits.to(dev), tensors(dev))
    same = int((a.token_ids == b.token_ids.cpu()).sum())
    lp = float((a.logprobs - b.logprobs.cpu()).abs().max())
    ok = same == rows and lp < 1e-3
    detail = f"{same}/{rows} rows drew the same token on {dev} and cpu, logprobs within {lp:.1e}"
    return Result("sampler", "PASS" if ok else "FAIL", detail, time.perf_counter() - t0)


def check_kv_protocol(dev: torch.device) -> Result:
    """A transfer of `dev` tensors, in place and staged, each side on a stream of its own,
    the sender's layers written by a 'model' on the default stream as it goes."""
    from kv_transfer.channel import PagedBlocks, StagingBuffers, recv_kv, send_kv
    from kv_transfer.inprocess import InProcessChannel
    from kv_transfer.layout import KVLayout
    from kv_transfer.protocol import TransferDescriptor
    from kv_transfer.streams import device_streams
    from workers.kv_sender import LayerProgress

    t0 = time.perf_counter()
    layout = KVLayout(4, 3, 64, 16, "bfloat16")
    shape = layout.layer_shape(64)
    g = torch.Generator().manual_seed(3)
    truth = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(4)]
    src = [torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(4)]
    dst = [torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(4)]
    a, b = InProcessChannel.pair()
    for ch in (a, b):
        ch.device = dev
        ch.streams = device_streams(dev)
        ch.stream = ch.streams.new_stream()
    src_ids = list(range(2, 12)) + [40, 33, 34]  # a run of 10, then scattered
    dst_ids = [50, 51, 52, 7, 8, 9, 10, 11, 12, 13, 60, 20, 21]
    progress = LayerProgress(4, dev)
    desc = TransferDescriptor("r1", layout, len(src_ids), len(src_ids) * 16)
    target = PagedBlocks(dst_ids, lambda i: dst[i])
    box = {}
    receiver = threading.Thread(
        target=lambda: box.setdefault(
            "out", recv_kv(b, layout, 10, dev, target=lambda d: target, staging=StagingBuffers())
        )
    )
    receiver.start()

    def write_layer(i):  # the model: layer i's KV, written on the default stream, then marked
        src[i].copy_(truth[i].to(dev, non_blocking=True))
        progress.mark(i)
        return src[i]

    source = PagedBlocks(src_ids, write_layer, ready=progress.event)
    send_kv(a, desc, source, 10, staging=StagingBuffers())
    receiver.join(30)
    device_streams(dev).wait(target.landed)  # as the engine admits the request
    ok = (
        all(torch.equal(dst[i][dst_ids].cpu(), truth[i][src_ids]) for i in range(4))
        and box.get("out", (None,))[0] == desc
    )
    detail = f"13 blocks x 4 layers over {dev} tensors, one run in place, the rest staged"
    return Result("kv-protocol", "PASS" if ok else "FAIL", detail, time.perf_counter() - t0)


NCCL_STALL = """
import datetime, os, sys, time, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from kv_transfer.torch_dist import PairGroup, nccl_environment
os.environ.update(nccl_environment(2))
torch.cuda.set_device(0)
opts = dist.ProcessGroupNCCL.Options()
opts._timeout = datetime.timedelta(seconds=4)  # the group's own: passed while we look on
opts.config.blocking = 0
pg = dist.ProcessGroupNCCL(dist.HashStore(), 0, 1, opts)
x = torch.ones(1, device="cuda")
pg.allreduce([x]).wait(datetime.timedelta(seconds=30))  # the communicator, made
g = PairGroup.over(pg, "stall", 0, torch.device("cuda"), backend="nccl")
torch.cuda._sleep(int(2e10))  # the stream stalls for about ten seconds
work = pg.allreduce([x])
t0 = time.monotonic()
try:
    g.wait(work, 2)  # Tandem's own wait: polled to its deadline, the abort on the reaper
    print("WAIT-RETURNED")
except Exception as e:
    print("RAISED", type(e).__name__, round(time.monotonic() - t0, 1))
try:
    g.settle([], 60)  # as a quarantine does: until the reaper's abort has returned
    print("SETTLED", round(time.monotonic() - t0, 1))
except Exception as e:
    print("SETTLE-RAISED", type(e).__name__, str(e)[:120])
    sys.exit(3)  # the quarantine would keep its blocks for good: a failure
time.sleep(6)  # past the group's own timeout: nothing may take the process down
print("ALIVE")
"""

GLOO_STALL = """
import sys, threading, time, torch
sys.path.insert(0, {root!r})
from kv_transfer.torch_dist import PairGroup, store_client, store_server
server = store_server("127.0.0.1")
box = {{}}
t = threading.Thread(target=lambda: box.setdefault("g", PairGroup(
    store_client("127.0.0.1", server.port, 10), "p/1", 0, torch.device("cpu"), "127.0.0.1", 10)))
t.start()
g = PairGroup(server, "p/1", 1, torch.device("cpu"), "127.0.0.1", 10)
t.join()
t0 = time.monotonic()
try:
    g.wait(g.post_recv(torch.zeros(4)), 2)  # the peer never sends
    print("WAIT-RETURNED")
except Exception as e:
    print("RAISED", type(e).__name__, round(time.monotonic() - t0, 1))
print("ALIVE")
"""

NCCL_INIT_NEVER_JOINS = """
import datetime, sys, time, torch
sys.path.insert(0, {root!r})
from kv_transfer.torch_dist import _nccl_group
torch.cuda.set_device(0)
store = torch.distributed.HashStore()
pg = _nccl_group(store, 0, 3)  # rank 1 never comes: the communicator's init cannot finish
t0 = time.monotonic()
try:
    pg.send([torch.ones(1, device="cuda")], 1, 0).wait(datetime.timedelta(seconds=3))
    print("WAIT-RETURNED")
except Exception as e:
    print("RAISED", type(e).__name__, round(time.monotonic() - t0, 1), str(e)[:120])
print("ALIVE")
"""

NEVER_JOINS = """
import sys, time, torch
sys.path.insert(0, {root!r})
from kv_transfer.torch_dist import PairGroup, store_server
server = store_server("127.0.0.1")
t0 = time.monotonic()
try:
    PairGroup(server, "pair/x/1", 0, torch.device({device!r}), "127.0.0.1", 3)
    print("FORMED")
except Exception as e:
    print("RAISED", type(e).__name__, round(time.monotonic() - t0, 1), str(e)[:120])
print("ALIVE")
"""


def _script(name: str, code: str, limit_s: float, within_s: float) -> tuple[bool, str, float]:
    """Run `code` in a process of its own: it must raise (printing RAISED and the seconds it
    took, which must be at most within_s) and go on living (ALIVE)."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=limit_s
        )
    except subprocess.TimeoutExpired:
        return False, f"hung: no answer in {limit_s:.0f} s", time.perf_counter() - t0
    out = p.stdout.strip().splitlines()
    lines = [ln for ln in out if ln.split()[0] in ("RAISED", "WAIT-RETURNED", "FORMED")]
    raised = bool(lines) and lines[0].startswith("RAISED")
    took = float(lines[0].split()[2]) if raised else float("inf")
    ok = p.returncode == 0 and out[-1:] == ["ALIVE"] and raised and took <= within_s
    detail = "; ".join(lines) or (p.stderr.strip().splitlines() or ["no output"])[-1]
    if p.returncode != 0:
        detail += f"; the process died (exit {p.returncode})"
    elif raised and took > within_s:
        detail += f"; later than the {within_s:g} s allowed"
    return ok, detail, time.perf_counter() - t0


def check_nccl(dev: torch.device) -> list[Result]:
    """What one device can show of failure handling: a stalled operation, and a pair whose
    peer never joins."""
    root = str(ROOT)
    results = []
    if dev.type == "cuda":
        import torch.distributed as dist

        if not dist.is_nccl_available():
            return [Result("nccl", "FAIL", "this torch build has no NCCL")]
        ok, detail, s = _script("stall", NCCL_STALL.format(root=root), 120, 3)
        results.append(
            Result(
                "nccl-stalled-op",
                "PASS" if ok else "FAIL",
                f"a 2 s PairGroup.wait on a stalled allreduce: {detail}",
                s,
            )
        )
        ok, detail, s = _script("init", NCCL_INIT_NEVER_JOINS.format(root=root), 120, 8)
        results.append(
            Result(
                "nccl-init-never-joins",
                "PASS" if ok else "FAIL",
                f"a send to a rank that never inits (non-blocking init, 3 s): {detail}",
                s,
            )
        )
    else:
        ok, detail, s = _script("stall", GLOO_STALL.format(root=root), 120, 3)
        results.append(
            Result(
                "gloo-stalled-op",
                "PASS" if ok else "FAIL",
                f"a 2 s wait on a receive never sent: {detail}",
                s,
            )
        )
    ok, detail, s = _script("never", NEVER_JOINS.format(root=root, device=str(dev)), 120, 8)
    name = "nccl-peer-never-joins" if dev.type == "cuda" else "gloo-peer-never-joins"
    results.append(Result(name, "PASS" if ok else "FAIL", f"a 3 s handshake: {detail}", s))
    return results


def check_graphs(models: Models, dev: torch.device, quick: bool) -> Result:
    """Decode steps from captured graphs against eager ones, on the same model."""
    t0 = time.perf_counter()
    make = None if dev.type == "cuda" else EagerReplay
    graphs = models.engine(dev, "bfloat16", make_graph=make, max_num_seqs=8)
    eager = models.engine(dev, "bfloat16", cuda_graphs=False, max_num_seqs=8)
    if graphs.runner.graphs is None:
        why = f"backend {graphs.runner.backend.name} is not graph-safe: nothing was captured"
        return Result("graphs", "FAIL", why, time.perf_counter() - t0)
    replays = [0]
    run = graphs.runner.graphs.run

    def counted(*args):
        replays[0] += 1
        return run(*args)

    graphs.runner.graphs.run = counted
    ps = prompts(6, 20, 8)  # six prompts in a batch of up to 8: buckets with padding rows
    sp = _with_logprobs(SamplingParams(max_tokens=8 if quick else 20, temperature=0.0))
    pairs = list(zip(generate(eager, ps, sp), generate(graphs, ps, sp)))
    res = _judge("graphs", pairs, {"lp_tol": 0.05, "tie_tol": 0.05}, t0, "graph vs eager")
    res.detail += f", {replays[0]} steps replayed ({graphs.runner.backend.name})"
    if not replays[0]:
        res.status = "FAIL"
    return res


def check_overlap(models: Models, dev: torch.device, quick: bool) -> Result:
    """Overlap scheduling against waiting for every step, on the same device and model:
    greedy and seeded rows, stop tokens that leave a token in flight, arrivals mid-run."""
    t0 = time.perf_counter()
    make = None if dev.type == "cuda" else EagerReplay  # decodes replay on the CPU too
    on = models.engine(dev, "bfloat16", make_graph=make, max_num_seqs=8, overlap="on")
    off = models.engine(dev, "bfloat16", make_graph=make, max_num_seqs=8, overlap="off")
    tokens = 8 if quick else 24
    greedy = _with_logprobs(SamplingParams(max_tokens=tokens, temperature=0.0))
    seeded = _with_logprobs(SamplingParams(max_tokens=tokens, temperature=0.8, seed=3))
    ps = prompts(6, 24, 9)
    first = generate(off, ps[:2], greedy)
    stop = replace(greedy, stop_token_ids=(first[0][tokens // 2][0], first[1][2][0]))

    def run(engine):
        late = {1: [(ps[4], seeded)], 3: [(ps[5], greedy)]}
        ids = [engine.add_request(p, sp) for p, sp in zip(ps[:4], [stop, stop, seeded, greedy])]
        out, calls = {}, 0
        while engine.has_unfinished() or late:
            ids += [engine.add_request(p, sp) for p, sp in late.pop(calls, [])]
            for o in engine.step():
                tops = o.new_top_logprobs or [()] * len(o.new_token_ids)
                got = out.setdefault(o.request_id, [])
                got += [(t, dict(top)) for t, top in zip(o.new_token_ids, tops)]
            calls += 1
        assert engine.pool.num_free_blocks == engine.pool.num_blocks, "KV blocks leaked"
        return [out[i] for i in ids]

    before = on.overlapped_steps
    pairs = list(zip(run(off), run(on)))
    res = _judge("overlap", pairs, {"lp_tol": 0.05, "tie_tol": 0.05}, t0, "overlap on vs off")
    exact = sum(a == b for a, b in pairs)
    res.detail += (
        f", {exact}/{len(pairs)} streams identical, {on.overlapped_steps - before} steps overlapped"
    )
    if on.overlapped_steps == before:
        res.status, res.detail = "FAIL", "no step was left running: " + res.detail
    return res


def environment(dev: torch.device) -> Result:
    from workers.model.attention.flash_backend import flash_attn_unavailable
    from workers.model.triton_base import triton_unavailable

    parts = [f"torch {torch.__version__}"]
    if dev.type == "cuda":
        cap = torch.cuda.get_device_capability(dev)
        parts += [
            f"CUDA {torch.version.cuda}",
            f"{torch.cuda.get_device_name(dev)} sm{cap[0]}{cap[1]}",
        ]  # noqa: E501
        import torch.distributed as dist

        if dist.is_nccl_available():
            parts.append(f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    parts.append(f"flash-attn: {flash_attn_unavailable() or 'loads'}")
    parts.append(f"triton: {triton_unavailable() or 'runs'}")
    return Result("environment", "PASS", ", ".join(parts))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    ap.add_argument("--quick", action="store_true", help="fewer tokens (the CPU test's)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2", help="the figures' model")
    ap.add_argument("--no-figures", action="store_true", help="the checks alone")
    ap.add_argument(
        "--quantization",
        choices=("none", "fp8"),
        default="none",
        help="fp8: the decode steps again with fp8 weights, against the bf16 floor and step",
    )
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu for the CPU's checks")
        return 2
    if dev.type == "cuda":
        dev = indexed(dev)
        torch.cuda.set_device(dev)
    torch.manual_seed(0)
    models = Models()
    checks = [
        ("environment", lambda: [environment(dev)]),
        ("engine", lambda: check_engine(models, dev, args.quick)),
        ("sampler", lambda: [check_sampler(dev)]),
        ("kv-protocol", lambda: [check_kv_protocol(dev)]),
        ("nccl", lambda: check_nccl(dev)),
        ("graphs", lambda: [check_graphs(models, dev, args.quick)]),
        ("overlap", lambda: [check_overlap(models, dev, args.quick)]),
    ]
    results = []
    for name, check in checks:
        t0 = time.perf_counter()
        try:
            batch = check()
        except Exception as e:
            tail = traceback.format_exc().strip().splitlines()[-1]
            seconds = time.perf_counter() - t0
            batch = [Result(name, "FAIL", f"raised {type(e).__name__}: {tail}", seconds)]
        for r in batch:
            print(r.line(), flush=True)
        results += batch
    failed = [r.name for r in results if r.status == "FAIL"]
    figures = []
    if not args.no_figures:
        print(f"figures: the {args.shape} shape on {dev}, bf16, each against its floor")
        try:
            figures = measure(args.shape, dev, args.quick, quantization=args.quantization)
        except Exception as e:
            tail = traceback.format_exc().strip().splitlines()[-1]
            print(f"FAIL  figures raised {type(e).__name__}: {tail}")
            failed.append("figures")
    print(
        f"{len(results) - len(failed)} of {len(results)} checks passed on {dev}"
        + (f"; FAILED: {', '.join(failed)}" if failed else "")
    )
    if args.json:
        doc = {"device": str(dev), "shape": args.shape, "quantization": args.quantization}
        doc["checks"] = [r.__dict__ for r in results]
        doc["figures"] = as_json(figures)
        args.json.write_text(json.dumps(doc, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
