"""`tandem doctor`: what this machine offers, what the cluster config needs of it, and what is
missing, said plainly, before anything is started.

    tandem doctor [--config F] [cluster flags] [--json]

It starts nothing: Ray is only asked (when the config joins a running cluster) how many GPUs
its nodes declare, and a configured Redis is only pinged. The exit status is 1 when something
the config needs is missing, so a deploy script can run it first.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from cluster.config import ClusterConfig
from kv_transfer.torch_dist import NCCL_MIN_TORCH, version_before
from router.config import Mode
from workers.model.flash_rules import FLASH_DTYPES, FLASH_PAGE_MULTIPLE


@dataclass
class Report:
    offers: list[tuple[str, str]] = field(default_factory=list)  # (what, what is here)
    needs: list[tuple[str, str]] = field(default_factory=list)  # (what, how it is met)
    missing: list[str] = field(default_factory=list)  # needed and not here: exit status 1
    notes: list[str] = field(default_factory=list)  # works, but not at its best

    def to_json(self) -> dict:
        return {
            "offers": dict(self.offers),
            "needs": dict(self.needs),
            "missing": self.missing,
            "notes": self.notes,
        }

    def text(self) -> str:
        width = max(len(k) for k, _ in self.offers + self.needs)
        lines = ["This machine:"]
        lines += [f"  {k:<{width}}  {v}" for k, v in self.offers]
        lines += ["The config needs:"]
        lines += [f"  {k:<{width}}  {v}" for k, v in self.needs]
        lines += [f"NOTE     {n}" for n in self.notes]
        lines += [f"MISSING  {m}" for m in self.missing]
        lines.append("OK: nothing the config needs is missing" if not self.missing else "")
        return "\n".join(lines).rstrip() + "\n"


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def examine(cfg: ClusterConfig, ray_gpus: float | None = None) -> Report:
    """The report for this config on this machine. `ray_gpus`: the GPUs a running Ray
    cluster declares (None: no cluster asked; the local GPUs count)."""
    import torch

    r = Report()
    torch_version = torch.__version__
    r.offers.append(("torch", torch_version))
    cuda = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if cuda else 0
    if cuda:
        names = [torch.cuda.get_device_name(i) for i in range(gpus)]
        caps = [torch.cuda.get_device_capability(i) for i in range(gpus)]
        listed = ", ".join(f"{n} (sm{a}{b})" for n, (a, b) in zip(names, caps))
        r.offers.append(("CUDA", f"{torch.version.cuda}: {gpus} GPU(s): {listed}"))
    else:
        build = (
            f"torch built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
        )
        r.offers.append(("CUDA", f"no GPU visible ({build} of torch)"))
    if ray_gpus is not None:
        r.offers.append(("GPUs in Ray", f"{ray_gpus:g}"))
    nccl = _nccl(torch)
    r.offers.append(("NCCL", nccl or "not in this torch build"))
    flash = _flash(cuda)
    r.offers.append(
        (
            "flash-attn",
            f"{flash[0]}; takes KV pages of a multiple of {FLASH_PAGE_MULTIPLE} tokens, "
            f"{'/'.join(FLASH_DTYPES)}, sm80+",
        )
    )
    triton = version("triton")
    r.offers.append(("Triton", triton or "not installed"))
    r.offers.append(("CPU kernels", _cpu_kernels()))
    r.offers.append(("int8 and GGUF-as-stored weights (CPU)", _int8_kernel()))
    r.offers.append(("fp8 weights (CUDA)", _fp8(torch, cuda)))
    r.offers.append(("tensor parallelism (tp)", _tp(gpus)))
    r.offers.append(("redis-server", shutil.which("redis-server") or "not on PATH"))
    r.offers.append(("Ray", _ray_auth(version("ray"))))
    _needs(r, cfg, torch_version, cuda, ray_gpus if ray_gpus is not None else gpus, nccl, flash)
    return r


def _needs(r: Report, cfg: ClusterConfig, torch_version, cuda, gpus, nccl, flash) -> None:
    # As a worker on this machine would resolve it (the dtype for this GPU, if any).
    engines = {p: cfg.engine_for(p).resolve() for p in cfg.pools}
    want = sum(cfg.pool(p).replicas * cfg.pool(p).gpus for p in cfg.pools)
    for pool, e in engines.items():
        where = f"{cfg.pool(pool).replicas} x {cfg.pool(pool).gpus:g} GPU" if want else "CPU"
        r.needs.append(
            (
                f"{pool.value} workers",
                f"{e.device}, {e.dtype}"
                + (f", {e.quantization} weights" if e.quantization != "none" else "")
                + f", KV blocks of {e.block_size} tokens, "
                f"attention {e.attention_backend}, on {where}",
            )
        )
    on_cuda = any(e.device.startswith("cuda") for e in engines.values())
    if on_cuda:
        if gpus < want:
            r.missing.append(
                f"GPUs: the pools want {want:g} (a whole GPU per worker), "
                f"{'Ray declares' if cfg.ray_address else 'this machine has'} {gpus:g}"
            )
        if not cuda and not cfg.ray_address:
            r.missing.append("CUDA: the config runs workers on CUDA and no GPU is visible here")
        if cfg.mode is Mode.DISAGGREGATED or any(e.tp > 1 for e in engines.values()):
            if nccl is None:
                r.missing.append("NCCL: CUDA KV transfers and tp > 1 need a torch build with NCCL")
            if version_before(torch_version, NCCL_MIN_TORCH):
                r.missing.append(
                    f"torch >= 2.6 for NCCL KV transfers and tp > 1 (this is {torch_version}): "
                    "older ones ignore a wait's timeout"
                )
        e = engines[cfg.pools[0]]
        if e.attention_backend == "flash-attn" and not flash[1]:
            r.missing.append(f"flash-attn, which attention_backend asks for: {flash[0]}")
        elif e.attention_backend == "auto" and not flash[1]:
            r.notes.append(
                "flash-attn is not loadable here: attention runs on the Triton kernel "
                "(pip install --no-build-isolation flash-attn for the faster path)"
            )
        elif e.attention_backend == "auto" and e.block_size % FLASH_PAGE_MULTIPLE:
            r.notes.append(
                f"block_size={e.block_size}: flash-attn is passed over (pages of "
                f"{FLASH_PAGE_MULTIPLE}); the Triton kernel is used"
            )
        if version("triton") is None and not flash[1]:
            r.notes.append(
                "neither flash-attn nor Triton: decode attention gathers blocks for SDPA "
                "and decode steps are not captured in CUDA graphs"
            )
    if cfg.redis.url is None:
        r.needs.append(("Redis", "embedded: redis-server on PATH"))
        if shutil.which("redis-server") is None:
            r.missing.append("redis-server: not on PATH (install it, or give --redis-url)")
    else:
        r.needs.append(("Redis", _redis_ping(cfg.redis.url, r)))


def _tp(gpus: int) -> str:
    """What tp > 1 would run on here: its CPU ranks' collectives, and how many GPU ranks."""
    import os

    from workers.model.shm_collectives import shm_available

    why = shm_available()
    cpu = "shared memory" if why is None else f"gloo ({why})"
    cores = len(os.sched_getaffinity(0))
    text = f"CPU ranks: collectives over {cpu}, {cores} cores shared among them"
    return text + (f"; CUDA: up to tp {gpus}, a GPU per rank" if gpus else "; no GPU ranks")


def _nccl(torch) -> str | None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_nccl_available():
        return None
    try:
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # available in the build, but its library does not load here
        return "in this torch build"


def _flash(cuda: bool) -> tuple[str, bool]:
    """(what is here, whether it loads)."""
    v = version("flash-attn")
    if v is None:
        return "not installed", False
    if not cuda:
        return f"{v} installed (no GPU to run it here)", False
    from workers.model.attention.flash_backend import flash_attn_unavailable

    why = flash_attn_unavailable()
    return (f"{v}", True) if why is None else (f"{v}, but {why}", False)


def _cpu_kernels() -> str:
    from workers.model import cpu_kernels

    if cpu_kernels.switched_off():
        return "off (TANDEM_CPU_KERNELS=0)"
    if cpu_kernels.built():
        return "built for this CPU"
    return "not built yet: the first CPU worker compiles them (about 30 s; needs g++)"


def _fp8(torch, cuda) -> str:
    """Whether quantization: fp8 runs on this machine's first GPU."""
    if not cuda:
        return "needs a CUDA GPU of compute capability 8.9 or newer (none visible here)"
    from workers.model.fp8_linear import fp8_unavailable

    why_not = fp8_unavailable(torch.device("cuda", 0))
    return why_not or "torch._scaled_mm on this GPU's fp8 tensor cores"


def _int8_kernel() -> str:
    """Which path quantization: int8 (and gguf) takes on this CPU: the built kernels' own
    answer where they are built, else this CPU's flags (they are built for the CPU they run
    on)."""
    from workers.model import cpu_kernels
    from workers.model.int8_linear import int8_kernel

    if cpu_kernels.switched_off():
        return "unavailable: needs Tandem's CPU kernels (TANDEM_CPU_KERNELS=0)"
    kernels = cpu_kernels.cpu_kernels() if cpu_kernels.built() else None
    if kernels is not None:
        path = int8_kernel(kernels)
    else:
        vnni = {"avx512_vnni", "avx512bw"} <= cpu_kernels.cpu_info()[1]
        path = int8_kernel(None, vnni)
    if path == "avx512-vnni":
        return "AVX512-VNNI kernel"
    return "portable C++ kernel (no AVX512-VNNI here, or TANDEM_INT8_KERNEL=portable): same results"


def _ray_auth(ray_version: str | None) -> str:
    if ray_version is None:
        return "not installed"
    mode = os.environ.get("RAY_AUTH_MODE")
    token = (
        os.environ.get("RAY_AUTH_TOKEN")
        or Path(
            os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token"
        ).is_file()
    )
    if mode:
        auth = f"auth mode {mode} (RAY_AUTH_MODE)"
    elif version_before(ray_version, (2, 60)):
        auth = "no token auth by default in this version"
    else:
        auth = "token auth by default for local clusters"
    return f"{ray_version}, {auth}; a token {'is' if token else 'is not'} at hand"


def _redis_ping(url: str, r: Report) -> str:
    from cluster.state import redact

    try:
        import redis

        redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2).ping()
    except Exception as e:  # any failure: unreachable, refused, wrong password
        r.missing.append(f"Redis at {redact(url)}: {type(e).__name__}: {e}")
        return f"{redact(url)}: unreachable"
    return f"{redact(url)}: answers"


def ray_cluster_gpus(address: str) -> float:
    """The GPUs the nodes of the Ray cluster at `address` declare (joins it briefly)."""
    import ray

    from cluster.cluster import _use_ray_token

    _use_ray_token(address)
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        return float(ray.cluster_resources().get("GPU", 0.0))
    finally:
        ray.shutdown()


def cmd_doctor(args) -> int:
    from cluster.config import load_config

    try:
        cfg = load_config(args.config, args)
    except ValueError as e:
        print(f"tandem doctor: {e}")
        return 1
    ray_gpus = None
    if cfg.ray_address:
        try:
            ray_gpus = ray_cluster_gpus(cfg.ray_address)
        except Exception as e:
            print(f"tandem doctor: cannot ask Ray at {cfg.ray_address}: {e}")
            return 1
    report = examine(cfg, ray_gpus)
    print(json.dumps(report.to_json(), indent=2) if args.json else report.text(), end="")
    return 1 if report.missing else 0
