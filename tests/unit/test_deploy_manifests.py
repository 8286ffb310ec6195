"""The deployment files cannot rot silently: every manifest parses; every `tandem` command they
run parses with the CLI's own parser; the config they mount is a valid cluster config; the
ports, Ray resources, GPUs, Redis address and mounted paths they name agree with that config
and with each other; and the Grafana dashboard plots every series the code records, and no
other."""

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from cluster import config_io
from cluster.cli import build_parser
from cluster.config import ClusterConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBERAY = DEPLOY / "kuberay"


def docs() -> list[dict]:
    return [d for p in sorted(KUBERAY.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())]


def of_kind(kind: str) -> list[dict]:
    return [d for d in docs() if d["kind"] == kind]


def named(kind: str, name: str) -> dict:
    [d] = [d for d in of_kind(kind) if d["metadata"]["name"] == name]
    return d


def tandem_commands(script: str) -> list[list[str]]:
    """Each `tandem ...` invocation in a shell script, as argv (after `tandem`)."""
    found = []
    for part in re.split(r"&&|\|\||;|&|\n", script):
        words = shlex.split(part)
        if words[:1] == ["exec"]:
            words = words[1:]
        if words[:1] == ["tandem"]:
            found.append(words[1:])
    return found


def containers() -> list[tuple[str, dict, dict]]:
    """(group, pod spec, container) for every container of the RayCluster."""
    [rc] = of_kind("RayCluster")
    groups = [("head", rc["spec"]["headGroupSpec"])]
    groups += [(g["groupName"], g) for g in rc["spec"]["workerGroupSpecs"]]
    pods = [(name, g["template"]["spec"]) for name, g in groups]
    return [(name, pod, c) for name, pod in pods for c in pod["containers"]]


def mounted_config() -> ClusterConfig:
    text = named("ConfigMap", "tandem-config")["data"]["cluster.yaml"]
    return config_io.build(ClusterConfig, yaml.safe_load(text), "tandem-config/cluster.yaml")


def test_every_manifest_parses_and_the_local_config_is_valid():
    kinds = {d["kind"] for d in docs()}
    assert kinds >= {"ConfigMap", "RayCluster", "Service", "StatefulSet", "PodMonitor"}
    local = yaml.safe_load((DEPLOY / "local" / "cluster.yaml").read_text())
    config_io.build(ClusterConfig, local, "deploy/local/cluster.yaml")
    cfg = mounted_config()
    assert cfg.mode == "disaggregated" and cfg.engine.device == "cuda"


def test_every_tandem_command_parses_and_its_config_file_is_mounted():
    parser = build_parser()
    seen = 0
    for _, pod, c in containers():
        script = " ".join([*c.get("command", []), *c.get("args", [])])
        for argv in tandem_commands(script):
            seen += 1
            args = parser.parse_args(argv)  # an unknown command or flag exits here
            if getattr(args, "config", None):
                mount = next(
                    m for m in c["volumeMounts"] if args.config.startswith(m["mountPath"] + "/")
                )
                volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
                key = args.config[len(mount["mountPath"]) + 1 :]
                assert key in named("ConfigMap", volume["configMap"]["name"])["data"]
    assert seen >= 1, "no container runs tandem"
    # The Dockerfile's own command, and the install script it runs, exist.
    dockerfile = (KUBERAY / "Dockerfile").read_text()
    assert "bash deploy/local/install.sh" in dockerfile
    assert (DEPLOY / "local" / "install.sh").is_file()
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", dockerfile, re.M).group(1))
    assert cmd[0] == "tandem"
    with pytest.raises(SystemExit) as e:
        parser.parse_args(cmd[1:])
    assert e.value.code == 0


def test_ports_redis_and_the_router_service_agree_with_the_config():
    cfg = mounted_config()
    router_ports = {cfg.router.port, cfg.router.http_port}
    assert cfg.router.host == "0.0.0.0"  # reachable through the Service
    service = named("Service", "tandem-router")
    assert {p["targetPort"] for p in service["spec"]["ports"]} == router_ports
    assert service["spec"]["selector"]["ray.io/node-type"] == "head"
    [head] = [c for group, _, c in containers() if group == "head"]
    assert router_ports <= {p["containerPort"] for p in head["ports"]}
    assert 'eval "$KUBERAY_GEN_RAY_START_CMD"' in " ".join(head["args"])
    # Ray's metrics endpoint on every pod, on the port the PodMonitor scrapes.
    [rc] = of_kind("RayCluster")
    groups = [rc["spec"]["headGroupSpec"], *rc["spec"]["workerGroupSpecs"]]
    [monitor] = of_kind("PodMonitor")
    assert monitor["spec"]["selector"]["matchLabels"]["ray.io/cluster"] == rc["metadata"]["name"]
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    for group, (_, _, c) in zip(groups, containers()):
        [port] = [p for p in c["ports"] if p["name"] == endpoint["port"]]
        assert str(port["containerPort"]) == group["rayStartParams"]["metrics-export-port"]
    dockerfile = (KUBERAY / "Dockerfile").read_text()
    exposed = {int(p) for p in re.search(r"^EXPOSE (.*)$", dockerfile, re.M).group(1).split()}
    assert router_ports <= exposed
    # Redis: the URL (from the Secret, in the head's environment) names the Service, whose
    # port reaches a server with its AOF on a volume.
    assert cfg.redis.url is None  # no password in the ConfigMap
    env = {e["name"]: e for e in head["env"]}
    url = re.match(
        r"redis://:\$\(REDIS_PASSWORD\)@([^:/]+):(\d+)/", env["TANDEM_REDIS_URL"]["value"]
    )
    assert url and list(env).index("REDIS_PASSWORD") < list(env).index("TANDEM_REDIS_URL")
    redis_service = named("Service", url.group(1))
    assert int(url.group(2)) in {p["port"] for p in redis_service["spec"]["ports"]}
    sts = named("StatefulSet", url.group(1))
    [redis] = sts["spec"]["template"]["spec"]["containers"]
    args = redis["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    data_dir = args[args.index("--dir") + 1]
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    assert any(m["mountPath"] == data_dir and m["name"] in claims for m in redis["volumeMounts"])


def test_each_pool_lands_on_its_own_worker_group():
    """The pools' custom Ray resources exist on exactly their group's nodes, with the CPUs
    and GPUs a worker declares."""
    cfg = mounted_config()
    [rc] = of_kind("RayCluster")
    groups = {g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for name, group in groups.items():
        pool = getattr(cfg, name)
        params = group["rayStartParams"]
        custom = json.loads(json.loads(params.get("resources", '"{}"')))
        assert custom == pool.resources, name  # e.g. {"prefill": 1} on prefill nodes only
        assert float(params["num-cpus"]) >= pool.cpus
        assert float(params.get("num-gpus", 0)) >= pool.gpus
        [c] = group["template"]["spec"]["containers"]
        assert float(c["resources"]["limits"].get("nvidia.com/gpu", 0)) == float(
            params.get("num-gpus", 0)
        )
        assert 1 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        # Through eval: unquoted, bash would split the resources' JSON apart.
        assert 'eval "$KUBERAY_GEN_RAY_START_CMD"' in " ".join(c["args"])


def test_the_gpu_deploy_starts_on_gpus_as_configured():
    """The mounted config, resolved as each pool's workers resolve it, is what flash-attn takes
    (the config's own validation refuses anything else when it loads), with a whole GPU per
    worker; the image built for it carries flash-attn built against its torch."""
    from workers.messages import Pool
    from workers.model.flash_rules import flash_refusal

    cfg = mounted_config()
    for pool in (Pool.PREFILL, Pool.DECODE):
        engine = cfg.engine_for(pool)
        assert engine.device == "cuda" and cfg.pool(pool).gpus == 1
        assert flash_refusal(engine.dtype, engine.block_size, head_dim=64) is None
    assert cfg.engine_for(Pool.DECODE).cuda_graphs
    images = {c["image"] for _, _, c in containers()}
    assert images == {"tandem:gpu"}
    dockerfile = (KUBERAY / "Dockerfile").read_text()
    assert "tandem:gpu" in dockerfile and "FLASH_ATTN=1" in dockerfile
    assert "TANDEM_FLASH_ATTN=${FLASH_ATTN}" in dockerfile
    install = (DEPLOY / "local" / "install.sh").read_text()
    assert "--no-build-isolation" in install  # flash-attn's setup imports torch


def defined_series() -> tuple[set[str], set[str]]:
    """(counter and gauge names, histogram names) that the code records."""
    root = DEPLOY.parent
    text = (root / "workers" / "metrics.py").read_text() + (
        root / "router" / "metrics.py"
    ).read_text()
    plain = set(re.findall(r'(?:counter|gauge)\(\s*"(tandem_\w+)"', text))
    hists = set(re.findall(r'histogram\(\s*"(tandem_\w+)"', text))
    return plain, hists


def test_the_grafana_dashboard_plots_every_series_and_only_real_ones():
    dash = json.loads((DEPLOY / "grafana" / "tandem_grafana_dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dash["templating"]["list"] if v["type"] == "query"]
    used = {m for e in exprs for m in re.findall(r"ray_(tandem_\w+)", e)}
    plain, hists = defined_series()
    real = plain | {h + s for h in hists for s in ("_bucket", "_count", "_sum")}
    assert used <= real, f"the dashboard plots series no code records: {used - real}"
    covered = {re.sub(r"_(bucket|count|sum)$", "", u) for u in used}
    assert plain | hists <= covered, f"series without a panel: {(plain | hists) - covered}"
    # Ray's Grafana integration: a templated Prometheus data source, and unique panel ids.
    assert any(
        v["name"] == "datasource" and v["type"] == "datasource" for v in dash["templating"]["list"]
    )
    assert all(p["datasource"]["uid"] == "${datasource}" for p in dash["panels"])
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


def secret_ref(env: dict, name: str) -> dict:
    return env[name]["valueFrom"]["secretKeyRef"]


def test_the_deploy_is_closed_by_default():
    """Keys from a Secret, Ray with token auth on every pod, a Redis password, NetworkPolicies
    around Ray's ports and Redis, and no container running as root or able to write its
    image."""
    cfg = mounted_config()
    # API keys: the router's key file is mounted from the Secret, nothing secret in the config.
    [head] = [c for group, _, c in containers() if group == "head"]
    [(_, head_pod, _)] = [x for x in containers() if x[0] == "head"]
    mount = next(
        m for m in head["volumeMounts"] if cfg.router.api_keys_file.startswith(m["mountPath"] + "/")
    )
    volume = next(v for v in head_pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "tandem-secrets"
    assert cfg.router.auth_token is None
    config_text = named("ConfigMap", "tandem-config")["data"]["cluster.yaml"]
    assert "password" not in config_text and "redis://:" not in config_text
    # Ray: token auth on every Ray container, the token from the Secret.
    for group, _, c in containers():
        env = {e["name"]: e for e in c["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", group
        assert secret_ref(env, "RAY_AUTH_TOKEN")["name"] == "tandem-secrets", group
    [rc] = of_kind("RayCluster")
    autoscaler = {e["name"]: e for e in rc["spec"]["autoscalerOptions"]["env"]}
    assert autoscaler["RAY_AUTH_MODE"]["value"] == "token"
    assert secret_ref(autoscaler, "RAY_AUTH_TOKEN")["name"] == "tandem-secrets"
    # Redis: a password from the same Secret.
    [redis] = named("StatefulSet", "tandem-redis")["spec"]["template"]["spec"]["containers"]
    redis_env = {e["name"]: e for e in redis["env"]}
    assert redis["args"][redis["args"].index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    assert secret_ref(redis_env, "REDIS_PASSWORD")["key"] == "redis-password"
    # Non-root, read-only root filesystem, no capabilities: every pod and container.
    pods = [pod for _, pod, _ in containers()]
    pods.append(named("StatefulSet", "tandem-redis")["spec"]["template"]["spec"])
    for pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
            assert sc["capabilities"]["drop"] == ["ALL"]
            writable = {m["mountPath"] for m in c["volumeMounts"]}
            assert "/tmp" in writable or "/data" in writable  # where it writes
    dockerfile = (KUBERAY / "Dockerfile").read_text()
    assert re.search(r"^USER 1000$", dockerfile, re.M)
    # NetworkPolicies: Ray's pods take only each other (and the router's and metrics ports);
    # Redis only the RayCluster's pods.
    [rc] = of_kind("RayCluster")
    cluster_pods = {"ray.io/cluster": rc["metadata"]["name"]}
    policies = of_kind("NetworkPolicy")
    on_ray = [
        p
        for p in policies
        if p["spec"]["podSelector"]["matchLabels"].items() >= cluster_pods.items()
    ]
    open_ports = set()
    for policy in on_ray:
        for rule in policy["spec"]["ingress"]:
            if "from" not in rule:  # from anywhere: only these ports
                open_ports |= {p["port"] for p in rule["ports"]}
            else:
                for peer in rule["from"]:
                    inside = peer.get("podSelector", {}).get("matchLabels") == cluster_pods
                    assert inside or rule.get("ports"), policy["metadata"]["name"]
    assert open_ports == {cfg.router.port, cfg.router.http_port}
    [redis_policy] = [
        p for p in policies if p["spec"]["podSelector"]["matchLabels"] == {"app": "tandem-redis"}
    ]
    [rule] = redis_policy["spec"]["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": cluster_pods}}]
