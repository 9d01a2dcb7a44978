"""deploy/kuberay/rayservice.yaml embeds the same Serve applications as deploy/serve_config.gpu.yaml,
and every Serve config in deploy/ validates against Ray's schema and our ServiceConfig."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from service.config import ServiceConfig

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def test_rayservice_embeds_gpu_serve_config():
    rs = _load("kuberay/rayservice.yaml")
    embedded = yaml.safe_load(rs["spec"]["serveConfigV2"])
    assert embedded["applications"] == _load("serve_config.gpu.yaml")["applications"]
    groups = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    gpu = groups["gpu"]["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert gpu["nvidia.com/gpu"] == "1" and "cpu" in groups


@pytest.mark.parametrize("name", ["serve_config.yaml", "serve_config.gpu.yaml", "kuberay/rayservice.yaml"])
def test_serve_configs_validate(name):
    from ray.serve.schema import ServeDeploySchema

    config = _load(name)
    if "spec" in config:
        config = yaml.safe_load(config["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    for app in config["applications"]:
        ServiceConfig.from_dict(app["args"])
        for d in app["deployments"]:
            assert {"min_replicas", "max_replicas", "target_ongoing_requests"} <= set(d["autoscaling_config"])
            assert "num_gpus" in d["ray_actor_options"] and "limits" in d["user_config"]
            if d["autoscaling_config"]["max_replicas"] > 1:  # else a replica still loading gets requests: 503s
                router = (d.get("request_router_config") or {}).get("request_router_class")
                assert router == "service.routing:ReadyFirstRouter", (name, d["name"])


def test_cpu_default_is_loopback_and_cpu():
    c = _load("serve_config.yaml")
    assert c["http_options"]["host"] == "127.0.0.1"
    assert c["applications"][0]["deployments"][0]["ray_actor_options"]["num_gpus"] == 0


def test_grafana_dashboard_uses_exported_metric_names():
    import json
    import re

    from service import metrics

    dash = json.loads((DEPLOY / "grafana" / "dashboard.json").read_text())
    exported = {m.name for m in metrics.REGISTRY.collect()}  # counters are named without _total here
    used = {re.sub(r"_(bucket|sum|count|total)$", "", n)
            for p in dash["panels"] for t in p["targets"] for n in re.findall(r"attnserve_\w+", t["expr"])}
    assert used and used <= exported, used - exported


def test_rayservice_containers_carry_the_serve_tuning_env():
    from service.ray_local import SERVE_TUNING_ENV

    spec = _load("kuberay/rayservice.yaml")["spec"]["rayClusterConfig"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for g in groups:
        for c in g["template"]["spec"]["containers"]:
            env = {e["name"]: e["value"] for e in c.get("env", [])}
            assert {k: env.get(k) for k in SERVE_TUNING_ENV} == SERVE_TUNING_ENV, c["name"]
