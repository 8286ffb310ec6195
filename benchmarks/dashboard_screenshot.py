"""Screenshots of a cluster under load, for docs/: the Ray dashboard's actors (the two named
pools) and Tandem's metrics scraped from Ray's Prometheus endpoint.

    python benchmarks/dashboard_screenshot.py [--seconds 60] [--out docs]

Starts a one-prefill, one-decode cluster (fp32, the dashboard on, Ray's metrics endpoint on
a free port), drives it with the serving benchmark's default workload at --rate requests/s,
and meanwhile runs Prometheus (scraping that endpoint every 2 s) if its binary is on PATH.
After --seconds it captures, with headless Chromium:
  docs/ray_dashboard_pools.png    the Ray dashboard's Actors page: prefill-0 and decode-0;
  docs/tandem_metrics.png         Prometheus graphs of ray_tandem_* series (decode tokens/s,
                                  KV blocks used, TTFT p90, requests by status).
The Ray dashboard draws its own metric charts through Grafana; with Grafana installed and
RAY_GRAFANA_HOST set, it also captures docs/ray_dashboard_metrics.png.
Needs: chromium (or chromium-browser / google-chrome) and, for the metrics, prometheus.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import ROOT, log  # noqa: E402

WORKLOAD = ROOT / "benchmarks" / "workloads" / "serving_default.jsonl"
GRAPHS = [
    ("sum by (worker) (rate(ray_tandem_decode_tokens_total[30s]))", "decode tokens/s"),
    ("sum by (pool, worker) (ray_tandem_kv_blocks_used)", "KV blocks used, by pool and worker"),
    ("histogram_quantile(0.9, sum by (le) (rate(ray_tandem_ttft_seconds_bucket[1m])))", "TTFT p90"),
    ("sum by (status) (ray_tandem_requests_total)", "requests by final status"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def browser() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return name
    raise SystemExit("no headless browser: install chromium (apt-get install chromium)")


def screenshot(url: str, out: Path, width: int = 1600, height: int = 1000) -> None:
    cmd = [
        browser(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--window-size={width},{height}",
        "--virtual-time-budget=15000",  # let the page's scripts fetch and draw
        f"--screenshot={out}",
        url,
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    log(f"wrote {out}")


def prometheus(metrics_port: int, workdir: Path) -> tuple[subprocess.Popen | None, int]:
    if not shutil.which("prometheus"):
        log("prometheus is not on PATH: no metrics graphs (apt-get install prometheus)")
        return None, 0
    port = free_port()
    config = workdir / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 2s}\n"
        "scrape_configs:\n"
        f"  - job_name: ray\n    static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]\n"
    )
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={workdir / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, port


def graph_url(port: int) -> str:
    q = {}
    for i, (expr, _) in enumerate(GRAPHS):
        q |= {f"g{i}.expr": expr, f"g{i}.tab": "0", f"g{i}.range_input": "5m"}
    return f"http://127.0.0.1:{port}/graph?" + urllib.parse.urlencode(q)


async def load(client, seconds: float, rate: float) -> int:
    """The default serving workload at `rate` requests/s for `seconds`; returns how many
    were served."""
    from dataclasses import replace

    from client import to_proto
    from cluster.requests_file import read_requests

    rows = read_requests(WORKLOAD)
    tasks, t0, i = [], time.monotonic(), 0
    while time.monotonic() - t0 < seconds:
        r = rows[i % len(rows)]
        r = replace(r, sampling=replace(r.sampling, max_tokens=min(r.sampling.max_tokens, 64)))
        tasks.append(asyncio.create_task(client.generate(to_proto(r), timeout_s=300)))
        i += 1
        await asyncio.sleep(1 / rate)
    results = await asyncio.gather(*tasks)
    return sum(r.status == "OK" for r in results)


async def main_async(args) -> None:
    from client import TandemClient
    from cluster import config_io
    from cluster.cluster import Cluster
    from cluster.config import ClusterConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="tandem-shots-"))
    os.environ.setdefault("RAY_metrics_report_interval_ms", "2000")
    # A headless browser cannot type Ray's dashboard token: this throwaway local cluster (all
    # on 127.0.0.1) runs without token auth unless RAY_AUTH_MODE says otherwise.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    metrics_port = free_port()
    values = dict(
        router={"port": 0},
        dashboard=True,
        metrics_export_port=metrics_port,
        engine={"dtype": "float32", "num_kv_blocks": 1024},
        data_dir=str(workdir / "data"),
    )
    cluster = Cluster(config_io.build(ClusterConfig, values, "screenshot"))
    await cluster.start(progress=log)
    prom, prom_port = prometheus(metrics_port, workdir)
    client = TandemClient(cluster.address)
    try:
        log(f"load: {args.rate} req/s for {args.seconds:.0f} s")
        driving = asyncio.create_task(load(client, args.seconds, args.rate))
        await asyncio.sleep(args.seconds * 0.8)  # shots while requests still run
        dashboard = os.environ.get("RAY_DASHBOARD_URL", "http://127.0.0.1:8265")
        await asyncio.to_thread(
            screenshot, f"{dashboard}/#/actors", out / "ray_dashboard_pools.png"
        )
        if prom is not None:
            await asyncio.to_thread(
                screenshot, graph_url(prom_port), out / "tandem_metrics.png", 1600, 2800
            )
        if os.environ.get("RAY_GRAFANA_HOST"):
            await asyncio.to_thread(
                screenshot, f"{dashboard}/#/metrics", out / "ray_dashboard_metrics.png"
            )
        done = await driving
        log(f"{done} requests served")
    finally:
        await client.close()
        if prom is not None:
            prom.terminate()
        await cluster.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--rate", type=float, default=0.5)
    ap.add_argument("--out", default=str(ROOT / "docs"))
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
