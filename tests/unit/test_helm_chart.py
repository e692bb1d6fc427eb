"""The Helm chart and the container images, checked without a cluster or a Docker engine.

The chart is linted and rendered by Helm's own Go engine (helm-python-sdk binds the Helm
SDK; no helm binary), and the manifests are validated against the Kubernetes OpenAPI
schemas shipped in kubernetes-validate. Both work offline.
"""

import copy
import functools
import json
import re
from pathlib import Path

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from packaging.specifiers import SpecifierSet

from neuron_serve.config.schema import load_config, parse_config
from neuron_serve.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "neuron-serve"
RELEASE, NAMESPACE = "demo", "models"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest
# kubernetes-validate knows; every core manifest must validate against both.
KUBE_VERSIONS = ("1.25.0", kubernetes_validate.utils.latest_version())
NEURONCORE = "aws.amazon.com/neuroncore"
COMMAND = ["neuron-serve", "deploy", "/etc/neuron-serve/model.yaml", "--grpc-port", "8001", "--host", "0.0.0.0",
           "--port", "8000"]

# gRPC is served in deployment mode only; a RayService render must turn it off.
RAYSERVICE = {"mode": "rayservice", "server": {"grpc": {"enabled": False}}}
SCENARIOS = {
    "default": {},
    "deployment": {
        "mode": "deployment",
        "replicaCount": 2,
        "nodeSelector": {"node.kubernetes.io/instance-type": "inf2.xlarge"},
    },
    "rayservice": {**RAYSERVICE},
    "existing-configmap": {"modelConfig": {"existingConfigMap": "my-model", "existingConfigMapKey": "encoder.yaml"}},
    "monitoring-autoscaling": {
        "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
        "autoscaling": {"enabled": True},
    },
    "existing-claim": {"compileCache": {"existingClaim": "shared-neuron-cache"}},
    "grpc-probes": {"probes": {"protocol": "grpc"}},
}
EXPECTED_KINDS = {
    "grpc-probes": {"ConfigMap", "Deployment", "PersistentVolumeClaim", "Service", "PodDisruptionBudget"},
    "default": {"ConfigMap", "Deployment", "PersistentVolumeClaim", "Service", "PodDisruptionBudget"},
    "deployment": {"ConfigMap", "Deployment", "PersistentVolumeClaim", "Service", "PodDisruptionBudget"},
    "rayservice": {"ConfigMap", "RayService", "PersistentVolumeClaim", "Service", "PodDisruptionBudget"},
    "existing-configmap": {"Deployment", "PersistentVolumeClaim", "Service", "PodDisruptionBudget"},
    "monitoring-autoscaling": {
        "ConfigMap",
        "Deployment",
        "PersistentVolumeClaim",
        "Service",
        "PodDisruptionBudget",
        "ServiceMonitor",
        "HorizontalPodAutoscaler",
    },
    "existing-claim": {"ConfigMap", "Deployment", "Service", "PodDisruptionBudget"},
}

# CRDs have no schema in kubernetes-validate, so they are checked structurally: the
# fields the chart writes, by the names of the ray.io/v1 and monitoring.coreos.com/v1
# CRDs, with unknown keys refused. Their pod templates are validated as core Pods below.
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_POD_TEMPLATE = {
    "type": "object",
    "required": ["spec"],
    "additionalProperties": False,
    "properties": {"metadata": {"type": "object"}, "spec": {"type": "object"}},
}
RAYSERVICE_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayService"},
        "spec": {
            "type": "object",
            "required": ["serveConfigV2", "rayClusterConfig"],
            "additionalProperties": False,
            "properties": {
                "serveConfigV2": {"type": "string"},
                "rayClusterConfig": {
                    "type": "object",
                    "required": ["rayVersion", "headGroupSpec", "workerGroupSpecs"],
                    "additionalProperties": False,
                    "properties": {
                        "rayVersion": {"type": "string"},
                        "headGroupSpec": {
                            "type": "object",
                            "required": ["rayStartParams", "template"],
                            "additionalProperties": False,
                            "properties": {"rayStartParams": _STR_MAP, "template": _POD_TEMPLATE},
                        },
                        "workerGroupSpecs": {
                            "type": "array",
                            "minItems": 1,
                            "items": {
                                "type": "object",
                                "required": ["groupName", "replicas", "template"],
                                "additionalProperties": False,
                                "properties": {
                                    "groupName": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                                    "replicas": {"type": "integer", "minimum": 0},
                                    "minReplicas": {"type": "integer", "minimum": 0},
                                    "maxReplicas": {"type": "integer", "minimum": 0},
                                    "rayStartParams": _STR_MAP,
                                    "template": _POD_TEMPLATE,
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}
SERVICEMONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {"type": "object", "properties": {"matchLabels": _STR_MAP}, "additionalProperties": False},
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                        "any": {"type": "boolean"},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        },
                    },
                },
            },
        },
    },
}
CRD_SCHEMAS = {"RayService": RAYSERVICE_SCHEMA, "ServiceMonitor": SERVICEMONITOR_SCHEMA}


@functools.lru_cache(maxsize=None)
def _render(values_json: str) -> tuple:
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(json.loads(values_json), name=RELEASE, namespace=NAMESPACE)
    return tuple(
        doc
        for path, text in sorted(rendered.items())
        if path.endswith((".yaml", ".yml"))
        for doc in yaml.safe_load_all(text)
        if doc
    )


def render(values: dict | None = None) -> list[dict]:
    """Every manifest the chart renders for ``values`` (deep copies: tests may mutate)."""
    return copy.deepcopy(list(_render(json.dumps(values or {}, sort_keys=True))))


def is_dashboard(doc: dict) -> bool:
    return doc["kind"] == "ConfigMap" and doc["metadata"]["name"].endswith("-dashboard")


def one(docs: list[dict], kind: str) -> dict:
    """The one manifest of ``kind`` (ConfigMap: the model's, not the Grafana dashboard's)."""
    found = [d for d in docs if d["kind"] == kind and not is_dashboard(d)]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def serving_pods(docs: list[dict]) -> list[dict]:
    """Pod templates of the pods that compile and serve (Deployment pods or Ray workers)."""
    pods = [d["spec"]["template"] for d in docs if d["kind"] == "Deployment"]
    for rs in (d for d in docs if d["kind"] == "RayService"):
        pods += [g["template"] for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]]
    assert pods
    return pods


def all_pods(docs: list[dict]) -> list[dict]:
    pods = serving_pods(docs)
    for rs in (d for d in docs if d["kind"] == "RayService"):
        pods.append(rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"])
    return pods


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


# --- lint, render, validate ----------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_chart_lints_without_warnings(scenario):
    report = helm.lint(CHART, SCENARIOS[scenario], strict=True, kube_version=f"v{KUBE_VERSIONS[0]}")
    assert report["errors"] == []
    # Severity 1 is informational ("icon is recommended"); 2 and 3 are warnings and errors.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_renders_the_documented_resources(scenario):
    docs = render(SCENARIOS[scenario])
    assert sum(map(is_dashboard, docs)) == 1  # shipped by default
    assert {d["kind"] for d in docs if not is_dashboard(d)} == EXPECTED_KINDS[scenario]
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names))
    for kind, name in names:
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, name
        # KubeRay refuses longer RayService names (it derives 63-character names from them).
        assert kind != "RayService" or len(name) <= 47, name


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_manifests_validate_against_kubernetes_schemas(scenario, kube_version):
    for doc in render(SCENARIOS[scenario]):
        if doc["kind"] in CRD_SCHEMAS:
            jsonschema.validate(doc, CRD_SCHEMAS[doc["kind"]])
            continue
        kubernetes_validate.validate(doc, kube_version, strict=True)
    for pod in all_pods(render(SCENARIOS[scenario])):
        as_pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "template", **pod.get("metadata", {})},
            "spec": pod["spec"],
        }
        kubernetes_validate.validate(as_pod, kube_version, strict=True)


def test_strict_validation_catches_a_misspelt_field():
    deployment = one(render(), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["failureTreshold"] = 3
    with pytest.raises(kubernetes_validate.ValidationError, match="failureTreshold"):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[-1], strict=True)


# --- the model.yaml ------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["default", "rayservice"])
def test_rendered_model_yaml_is_the_mlp_example(scenario):
    configmap = one(render(SCENARIOS[scenario]), "ConfigMap")
    config = parse_config(yaml.safe_load(configmap["data"]["model.yaml"]), "ConfigMap model.yaml")
    assert config == load_config(ROOT / "deployments" / "mlp.yaml")
    # The images put /app/deployments (this repo's deployments/) on PYTHONPATH.
    module = config.model.factory.split(":")[0]
    assert (ROOT / "deployments" / (module.replace(".", "/") + ".py")).is_file()


ENCODER = {
    "name": "encoder",
    "model": {"factory": "example_models.encoder:build", "kwargs": {"layers": 2}},
    "inputs": [{"name": "input_ids", "shape": [8, 128], "dtype": "int64", "high": 30522}],
    "target": "xla",
}


@pytest.mark.parametrize("form", ["text", "mapping"])
def test_inline_model_yaml_replaces_the_default_whole(form):
    # No 'partitioner' here: none may be inherited from the default MLP.
    inline = yaml.safe_dump(ENCODER) if form == "text" else ENCODER
    configmap = one(render({"modelConfig": {"inline": inline}}), "ConfigMap")
    assert yaml.safe_load(configmap["data"]["model.yaml"]) == ENCODER
    assert parse_config(ENCODER).partitioner is None


@pytest.mark.parametrize(
    "inline,error",
    [
        ("name: mlp\nmodel: {factory: 'm:f'}\n", "the model.yaml has no 'inputs'"),
        ("inputs: [x", "modelConfig.inline is not a YAML mapping"),
        ("just a sentence", "modelConfig.inline is not a YAML mapping"),
    ],
)
def test_inline_model_yaml_text_without_its_shape_is_refused(inline, error):
    with pytest.raises(helm.HelmRenderError, match=re.escape(error)):
        render({"modelConfig": {"inline": inline}})


LLM = {"name": "llm", "task": "generate", "model": {"pretrained": "/models/llm"},
       "generation": {"max_num_seqs": 8, "max_model_len": 256}}


@pytest.mark.parametrize("mode", ["deployment", "rayservice"])
def test_a_generate_model_yaml_without_inputs_renders(mode):
    docs = render({**(RAYSERVICE if mode == "rayservice" else {}), "modelConfig": {"inline": yaml.safe_dump(LLM)}})
    shipped = yaml.safe_load(one(docs, "ConfigMap")["data"]["model.yaml"])
    assert shipped == LLM and parse_config(shipped).task == "generate"
    if mode == "rayservice":
        serve = yaml.safe_load(one(docs, "RayService")["spec"]["serveConfigV2"])
        apps = {app["name"]: app for app in serve["applications"]}
        assert apps["llm"]["route_prefix"] == "/v2/models/llm"  # its OpenAI routes are forwarded by the server app


def test_parse_config_rejects_what_the_chart_must_not_ship():
    # The ConfigMap check above is only meaningful if parse_config is strict.
    with pytest.raises(ConfigError, match="inputs"):
        parse_config({"name": "mlp", "model": {"factory": "example_models.mlp:build"}})


def test_inline_model_change_rolls_the_pods():
    def checksum(values):
        return one(render(values), "Deployment")["spec"]["template"]["metadata"]["annotations"]["checksum/model-config"]

    assert checksum({}) != checksum(
        {
            "modelConfig": {
                "inline": {"name": "other", "model": {"factory": "m:f"}, "inputs": [{"name": "x", "shape": [1]}]}
            }
        }
    )


def test_existing_configmap_is_mounted_as_model_yaml():
    docs = render(SCENARIOS["existing-configmap"])
    assert not [d for d in docs if d["kind"] == "ConfigMap" and not is_dashboard(d)]
    volume = {v["name"]: v for v in one(docs, "Deployment")["spec"]["template"]["spec"]["volumes"]}["model-config"]
    assert volume["configMap"] == {"name": "my-model", "items": [{"key": "encoder.yaml", "path": "model.yaml"}]}


# --- the serving container ------------------------------------------------------------


def _server(docs):
    return one(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


def test_container_runs_neuron_serve_deploy_on_the_mounted_model_yaml():
    docs = render()
    container = _server(docs)
    assert container["command"] + container["args"] == COMMAND
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["model-config"]["mountPath"] == "/etc/neuron-serve"
    assert mounts["model-config"]["readOnly"] is True


@pytest.mark.parametrize("values,http_port", [({}, 8000), ({"server": {"httpPort": 9000}}, 9000)])
def test_probes_hit_the_v2_health_endpoints_on_the_http_port(values, http_port):
    docs = render(values)
    container = _server(docs)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == http_port
    assert container["args"][-2:] == ["--port", str(http_port)]
    paths = {}
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["port"] == "http" or get["port"] == http_port
        paths[probe] = get["path"]
    assert paths == {
        "startupProbe": "/v2/health/ready",
        "livenessProbe": "/v2/health/live",
        "readinessProbe": "/v2/health/ready",
    }
    # ...and they are routes the server really serves (the integration tests call them).
    from neuron_serve.serve.http.app import server_app

    async def no_models():
        return {}

    served = {route.path for route in server_app(no_models).routes if "GET" in getattr(route, "methods", ())}
    assert set(paths.values()) <= served
    service_ports = {p["name"]: p for p in one(docs, "Service")["spec"]["ports"]}
    assert service_ports["http"]["port"] == service_ports["http"]["targetPort"] == http_port


def test_startup_probe_allows_thirty_minutes_of_compilation_and_is_configurable():
    startup = _server(render())["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60
    longer = _server(render({"probes": {"startup": {"failureThreshold": 360}}}))["startupProbe"]
    assert longer["periodSeconds"] * longer["failureThreshold"] == 60 * 60


@pytest.mark.parametrize("scenario", ["default", "rayservice"])
@pytest.mark.parametrize("cores", [None, 8])
def test_serving_pods_request_neuroncores(scenario, cores):
    values = copy.deepcopy(SCENARIOS[scenario])
    if cores:
        values["neuron"] = {"cores": cores}
    for pod in serving_pods(render(values)):
        resources = pod["spec"]["containers"][0]["resources"]
        assert resources["limits"][NEURONCORE] == (cores or 2)  # default: the MLP's cores_per_replica
        assert resources["requests"][NEURONCORE] == resources["limits"][NEURONCORE]
        assert resources["requests"]["memory"] == "16Gi"


def test_ray_head_requests_no_neuroncores():
    head = one(render({**RAYSERVICE}), "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
    resources = head["template"]["spec"]["containers"][0]["resources"]
    assert NEURONCORE not in resources.get("limits", {}) and NEURONCORE not in resources.get("requests", {})


@pytest.mark.parametrize("scenario", ["default", "rayservice"])
def test_pods_run_non_root_with_a_read_only_root_filesystem(scenario):
    for pod in all_pods(render(SCENARIOS[scenario])):
        spec = pod["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] == 1000
        assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert spec["automountServiceAccountToken"] is False
        volumes = {v["name"]: v for v in spec["volumes"]}
        for container in spec["containers"]:
            ctx = container["securityContext"]
            assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == 1000
            assert ctx["allowPrivilegeEscalation"] is False
            assert ctx["readOnlyRootFilesystem"] is True
            assert ctx["capabilities"]["drop"] == ["ALL"]
            assert ctx["seccompProfile"] == {"type": "RuntimeDefault"}
            tmp = [m for m in container["volumeMounts"] if m["mountPath"] == "/tmp"]
            assert len(tmp) == 1 and "emptyDir" in volumes[tmp[0]["name"]]


def test_pods_tolerate_the_neuron_taint_and_take_a_node_selector():
    default = serving_pods(render())[0]["spec"]
    assert {"key": "aws.amazon.com/neuron", "operator": "Exists", "effect": "NoSchedule"} in default["tolerations"]
    assert "nodeSelector" not in default
    pinned = serving_pods(render(SCENARIOS["deployment"]))[0]["spec"]
    assert pinned["nodeSelector"] == {"node.kubernetes.io/instance-type": "inf2.xlarge"}


# --- compile cache --------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["default", "rayservice", "existing-claim"])
def test_compile_cache_claim_is_mounted_and_passed_to_the_server(scenario):
    docs = render(SCENARIOS[scenario])
    claims = [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    expected_claim = (
        "shared-neuron-cache"
        if scenario == "existing-claim"
        else one(docs, "PersistentVolumeClaim")["metadata"]["name"]
    )
    if scenario == "existing-claim":
        assert claims == []
    for pod in serving_pods(docs):
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        container = pod["spec"]["containers"][0]
        mount = {m["name"]: m for m in container["volumeMounts"]}["compile-cache"]
        assert volumes["compile-cache"]["persistentVolumeClaim"]["claimName"] == expected_claim
        assert env_of(container)["NEURON_SERVE_CACHE_DIR"] == mount["mountPath"] == "/var/cache/neuron-serve"


def test_compile_cache_can_be_an_emptydir_at_another_path():
    docs = render({"compileCache": {"enabled": False, "mountPath": "/cache"}})
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    pod = serving_pods(docs)[0]["spec"]
    assert {v["name"]: v for v in pod["volumes"]}["compile-cache"] == {"name": "compile-cache", "emptyDir": {}}
    assert env_of(pod["containers"][0])["NEURON_SERVE_CACHE_DIR"] == "/cache"


# --- Service, ServiceMonitor, HPA, PDB -----------------------------------------------


@pytest.mark.parametrize("scenario", ["default", "rayservice"])
def test_service_exposes_http_and_metrics_of_the_serving_pods(scenario):
    docs = render(SCENARIOS[scenario])
    service = one(docs, "Service")
    grpc = {"grpc": 8001} if scenario == "default" else {}  # a RayService serves no gRPC
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"http": 8000, "metrics": 8080, **grpc}
    # neuron-serve serves /metrics on its HTTP port.
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {"http": 8000, "metrics": 8000, **grpc}
    for pod in serving_pods(docs):
        assert matches(service["spec"]["selector"], pod["metadata"]["labels"])
        container_ports = {p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= container_ports


def test_servicemonitor_scrapes_the_metrics_port_of_the_service():
    docs = render(SCENARIOS["monitoring-autoscaling"])
    monitor, service = one(docs, "ServiceMonitor"), one(docs, "Service")
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [NAMESPACE]
    assert monitor["spec"]["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "30s", "scrapeTimeout": "10s"}
    ]


def test_hpa_scales_the_deployment_which_then_leaves_replicas_to_it():
    docs = render(SCENARIOS["monitoring-autoscaling"])
    hpa, deployment = one(docs, "HorizontalPodAutoscaler"), one(docs, "Deployment")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 4)
    assert "replicas" not in deployment["spec"]
    assert one(render(SCENARIOS["deployment"]), "Deployment")["spec"]["replicas"] == 2


def test_hpa_is_refused_in_rayservice_mode():
    with pytest.raises(helm.HelmRenderError, match="autoscaling.enabled is for mode=deployment"):
        render({**RAYSERVICE, "autoscaling": {"enabled": True}})


@pytest.mark.parametrize(
    "values,expected",
    [({}, {"maxUnavailable": 1}), ({"podDisruptionBudget": {"minAvailable": "50%"}}, {"minAvailable": "50%"})],
)
def test_pdb_covers_the_serving_pods(values, expected):
    docs = render(values)
    pdb = one(docs, "PodDisruptionBudget")
    assert {k: v for k, v in pdb["spec"].items() if k != "selector"} == expected
    assert matches(pdb["spec"]["selector"]["matchLabels"], serving_pods(docs)[0]["metadata"]["labels"])


# --- RayService -----------------------------------------------------------------------


def test_rayservice_serves_the_same_model_yaml_with_ray_serve():
    docs = render({**RAYSERVICE})
    spec = one(docs, "RayService")["spec"]
    serve = yaml.safe_load(spec["serveConfigV2"])
    assert serve["http_options"] == {"host": "0.0.0.0", "port": 8000}
    apps = {app["name"]: app for app in serve["applications"]}
    assert set(apps) == {"mlp", "neuron-serve"}
    assert apps["mlp"]["route_prefix"] == "/v2/models/mlp"
    assert apps["mlp"]["args"] == {"config": "/etc/neuron-serve/model.yaml"}
    assert apps["neuron-serve"]["route_prefix"] == "/"
    assert apps["neuron-serve"]["args"] == {"configs": ["/etc/neuron-serve/model.yaml"]}  # its token too
    for app in apps.values():
        assert re.fullmatch(r"neuron_serve(\.\w+)+:\w+", app["import_path"])
    cluster = spec["rayClusterConfig"]
    [worker] = cluster["workerGroupSpecs"]
    configmap = one(docs, "ConfigMap")["metadata"]["name"]
    for group in (cluster["headGroupSpec"], worker):
        pod = group["template"]["spec"]
        mount = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}["model-config"]
        assert mount["mountPath"] == "/etc/neuron-serve"
        assert {v["name"]: v for v in pod["volumes"]}["model-config"]["configMap"]["name"] == configmap
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"]


def test_rayservice_with_an_existing_configmap_needs_the_model_name():
    values = {**RAYSERVICE, "modelConfig": {"existingConfigMap": "my-model"}}
    with pytest.raises(helm.HelmRenderError, match="ray.modelName"):
        render(values)
    values["ray"] = {"modelName": "encoder"}
    serve = yaml.safe_load(one(render(values), "RayService")["spec"]["serveConfigV2"])
    assert serve["applications"][0]["route_prefix"] == "/v2/models/encoder"


@pytest.mark.parametrize(
    "values,error",
    [
        ({"modelConfig": {"inline": dict(ENCODER, replicas=2)}, "neuron": {"cores": 1}}, "needs 2 NeuronCores"),
        (
            {
                "modelConfig": {"inline": dict(ENCODER, cores_per_replica=2, autoscaling={"max_replicas": 3})},
                "neuron": {"cores": 4},
            },
            "needs 6 NeuronCores",
        ),
        (
            {
                **RAYSERVICE,
                "modelConfig": {"inline": dict(ENCODER, cores_per_replica=2)},
                "ray": {"worker": {"replicas": 2}},
                "neuron": {"cores": 1},
            },
            "cores_per_replica (2) exceeds neuron.cores (1)",
        ),
    ],
)
def test_model_replicas_must_fit_the_granted_neuroncores(values, error):
    with pytest.raises(helm.HelmRenderError, match=re.escape(error)):
        render(values)


def test_model_replicas_that_fit_render():
    inline = dict(ENCODER, cores_per_replica=2, replicas=2)
    assert render({"modelConfig": {"inline": inline}, "neuron": {"cores": 4}})
    assert render(
        {
            **RAYSERVICE,
            "modelConfig": {"inline": inline},
            "neuron": {"cores": 2},
            "ray": {"worker": {"replicas": 2}},
        }
    )


def test_ray_serve_deployment_overrides_reach_serve_config():
    overrides = [{"name": "model", "num_replicas": 2, "max_ongoing_requests": 64}]
    spec = one(render({**RAYSERVICE, "ray": {"serveDeployments": overrides}}), "RayService")["spec"]
    assert yaml.safe_load(spec["serveConfigV2"])["applications"][0]["deployments"] == overrides


# --- values.schema.json ---------------------------------------------------------------


def test_schema_is_draft07_and_accepts_the_defaults():
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.Draft7Validator.check_schema(schema)
    # A second implementation agreeing with Helm's: the defaults are valid.
    jsonschema.Draft7Validator(schema).validate(yaml.safe_load((CHART / "values.yaml").read_text()))


@pytest.mark.parametrize(
    "values,error",
    [
        ({"mode": "kserve"}, "/mode"),
        ({"neuron": {"cores": 0}}, "/neuron/cores"),
        ({"replicas": 2}, "replicas"),
        (
            {
                "modelConfig": {
                    "inline": {"name": "MLP", "model": {"factory": "m:f"}, "inputs": [{"name": "x", "shape": [1]}]}
                }
            },
            "/modelConfig/inline/name",
        ),
        (
            {
                "modelConfig": {
                    "inline": {"name": "mlp", "model": {"factory": "no-colon"}, "inputs": [{"name": "x", "shape": [1]}]}
                }
            },
            "factory",
        ),
        ({"modelConfig": {"inline": {"name": "mlp", "model": {"factory": "m:f"}}}}, "inputs"),
        ({"probes": {"startup": {"failureThreshold": "many"}}}, "/probes/startup/failureThreshold"),
        ({"ray": {"worker": {"rayStartParams": {"num-cpus": 4}}}}, "rayStartParams"),
        ({"compileCache": {"accessModes": ["ReadWriteSometimes"]}}, "/compileCache/accessModes"),
        ({"server": {"httpPort": 70000}}, "/server/httpPort"),
    ],
)
def test_schema_refuses_bad_values(values, error):
    with pytest.raises(helm.HelmValuesError, match=re.escape(error)):
        render(values)


# --- README ---------------------------------------------------------------------------

OPAQUE_VALUES = {"modelConfig.inline"}  # a model.yaml, documented as a whole


def _leaves(values: dict, prefix: str = ""):
    for key, value in values.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value and path not in OPAQUE_VALUES:
            yield from _leaves(value, path + ".")
        else:
            yield path, value


def test_readme_documents_every_value_with_its_default():
    values = dict(_leaves(yaml.safe_load((CHART / "values.yaml").read_text())))
    rows = {
        m["key"]: m["default"]
        for m in re.finditer(
            r"^\| `(?P<key>[^`]+)` \| (?P<default>.+?) \| .+ \|$", (CHART / "README.md").read_text(), re.M
        )
    }
    assert sorted(set(values) - set(rows)) == []
    assert sorted(set(rows) - set(values)) == []
    for key, default in rows.items():
        if key in OPAQUE_VALUES:
            continue
        code = re.fullmatch(r"`(.*)`", default)
        assert code, f"{key}: default is not a code span: {default}"
        assert json.loads(code[1]) == values[key], (
            f"README default of {key} is {code[1]}, values.yaml says {values[key]!r}"
        )


# --- Dockerfiles ----------------------------------------------------------------------

DOCKERFILES = ["Dockerfile", "Dockerfile.neuron"]


def _instructions(name: str) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (ROOT / name).read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def _args(instructions) -> dict:
    return dict(arg.split("=", 1) for kind, arg in instructions if kind == "ARG" and "=" in arg)


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_python_is_one_the_project_supports(name):
    instructions = _instructions(name)
    args = _args(instructions)
    requires = re.search(r'^requires-python\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)[1]
    bases = [
        re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], arg.split()[0]) for kind, arg in instructions if kind == "FROM"
    ]
    assert bases and all(re.fullmatch(r"python:3\.\d+-slim(-\w+)?", b) for b in bases), bases
    for base in bases:
        assert f"{base.split(':')[1].split('-')[0]}.0" in SpecifierSet(requires), base


@pytest.mark.parametrize("name", DOCKERFILES)
def test_image_installs_the_project_like_the_readme(name):
    instructions = _instructions(name)
    copied = {
        src
        for kind, arg in instructions
        if kind == "COPY" and not arg.startswith("--from")
        for src in arg.split()[:-1]
        if not src.startswith("--")
    }
    # pyproject.toml names README.md as the readme: setuptools fails without it.
    assert {"pyproject.toml", "README.md", "neuron_serve", "deployments"} <= copied
    installs = [
        arg for kind, arg in instructions if kind == "RUN" and re.search(r"pip install [^&]*(?<![\w/.-])\.(\s|$)", arg)
    ]
    assert len(installs) == 1, "the project is pip-installed from its pyproject.toml exactly once"
    # torch and torch-xla versions come from pyproject.toml, never from the Dockerfile.
    assert not re.search(r"\btorch(-xla)?==", " ".join(arg for _, arg in instructions))
    env = " ".join(arg for kind, arg in instructions if kind == "ENV")
    assert re.search(r"PYTHONPATH=\S*/app/deployments", env)
    assert ("COPY", "--chown=1000:1000 deployments /app/deployments") in instructions
    user = [arg for kind, arg in instructions if kind == "USER"]
    assert user and user[-1].split(":")[0] == "1000"
    assert [arg for kind, arg in instructions if kind == "EXPOSE"] == ["8000 8080"]
    assert [arg for kind, arg in instructions if kind == "ENTRYPOINT"] == ['["neuron-serve"]']
    [cmd] = [json.loads(arg) for kind, arg in instructions if kind == "CMD"]
    assert (ROOT / cmd[1].replace("/app/", "", 1)).is_file()


def test_neuron_image_adds_the_neuron_sdk():
    instructions = _instructions("Dockerfile.neuron")
    runs = " ".join(arg for kind, arg in instructions if kind == "RUN")
    [install] = [arg for kind, arg in instructions if kind == "RUN" and "pip install --extra-index-url" in arg]
    # One resolver run, so torch-neuronx agrees with the torch pinned in pyproject.toml.
    assert "https://pip.repos.neuron.amazonaws.com" in install
    assert re.search(r'"neuronx-cc[=<>]', install) and re.search(r'"torch-neuronx[=<>]', install)
    assert re.search(r"\s\.\s", install)
    assert "apt.repos.neuron.amazonaws.com" in runs
    for package in ("aws-neuronx-runtime-lib", "aws-neuronx-tools"):
        assert re.search(rf"apt-get install [^&]*\b{package}\b", runs), package
    assert _args(instructions)["TORCH_NEURONX_VERSION"].startswith("2.9")


def test_dockerignore_keeps_the_build_inputs_and_drops_the_rest():
    patterns = [
        p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")
    ]
    for needed in ("pyproject.toml", "README.md", "neuron_serve", "deployments", "deployments/example_models/mlp.py"):
        assert not any(Path(needed).match(p) or needed.split("/")[0] == p for p in patterns), needed
    for dropped in (".venv", ".git", "tests"):
        assert dropped in patterns


# --- gRPC -------------------------------------------------------------------------------


def test_grpc_port_reaches_the_server_the_container_and_the_service():
    docs = render({"server": {"grpc": {"enabled": True, "port": 9001}}})
    container = _server(docs)
    assert container["args"][2:4] == ["--grpc-port", "9001"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"] == 9001
    ports = {p["name"]: p for p in one(docs, "Service")["spec"]["ports"]}
    assert (ports["grpc"]["port"], ports["grpc"]["targetPort"], ports["grpc"]["appProtocol"]) == (9001, 9001, "grpc")


def test_grpc_off_passes_no_grpc_and_drops_the_ports():
    docs = render({"server": {"grpc": {"enabled": False, "port": 8001}}})
    container = _server(docs)
    assert "--no-grpc" in container["args"] and "--grpc-port" not in container["args"]
    assert "grpc" not in {p["name"] for p in container["ports"]}
    assert "grpc" not in {p["name"] for p in one(docs, "Service")["spec"]["ports"]}


def test_grpc_probes_ask_the_health_service():
    docs = render(SCENARIOS["grpc-probes"])  # validated against Kubernetes' schemas with the other scenarios
    container = _server(docs)
    services = {probe: (container[probe]["grpc"]["port"], container[probe]["grpc"]["service"])
                for probe in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert services == {"startupProbe": (8001, "ready"), "livenessProbe": (8001, "live"),
                        "readinessProbe": (8001, "ready")}
    assert "httpGet" not in container["readinessProbe"]
    # ...answered by the server's grpc.health.v1 service (tests/integration/test_grpc.py calls it).
    from neuron_serve.serve.grpc.service import HealthServicer

    assert {"ready", "live"} <= set(HealthServicer.LIVE + HealthServicer.READY)


@pytest.mark.parametrize("values,error", [
    ({"mode": "rayservice"}, "server.grpc.enabled is for mode=deployment"),
    ({"probes": {"protocol": "grpc"}, "server": {"grpc": {"enabled": False, "port": 8001}}},
     "probes.protocol=grpc needs server.grpc.enabled=true"),
])
def test_grpc_settings_that_cannot_work_are_refused(values, error):
    with pytest.raises(helm.HelmRenderError, match=re.escape(error)):
        render(values)


# --- Grafana dashboard ------------------------------------------------------------------

DASHBOARD = CHART / "dashboards" / "neuron-serve.json"


def test_dashboard_configmap_carries_the_dashboard_for_the_grafana_sidecar():
    docs = render()
    maps = [d for d in docs if is_dashboard(d)]
    assert len(maps) == 1
    assert maps[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(maps[0]["data"]["neuron-serve.json"]) == json.loads(DASHBOARD.read_text())
    for kube_version in KUBE_VERSIONS:
        kubernetes_validate.validate(maps[0], kube_version, strict=True)
    assert not [d for d in render({"grafanaDashboard": {"enabled": False, "labels": {"grafana_dashboard": "1"}}})
                if is_dashboard(d)]


def test_dashboard_panels_cover_the_serving_metrics():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))  # rows have none
    for metric in ("neuron_serve_requests_total", "neuron_serve_request_latency_seconds_bucket",
                   "neuron_serve_queue_time_seconds_bucket", "neuron_serve_batch_size_rows",
                   "neuron_serve_padding_rows_total", "neuroncore_utilization_ratio",
                   "neuron_serve_partition_seconds", "neuron_serve_compile_cache_hits_total",
                   # the generation engine's (task: generate), in the Generation row
                   "neuron_serve_generation_tokens_total", "neuron_serve_prompt_tokens_total",
                   "neuron_serve_time_to_first_token_seconds_bucket",
                   "neuron_serve_time_per_output_token_seconds_bucket",
                   "neuron_serve_e2e_request_latency_seconds_bucket", "neuron_serve_num_requests_running",
                   "neuron_serve_num_requests_waiting", "neuron_serve_kv_cache_usage_perc",
                   "neuron_serve_request_success_total", "neuron_serve_generation_step_seconds_sum"):
        assert metric in exprs, metric
    # Every metric a panel reads is one neuron-serve declares.
    from neuron_serve import metrics

    declared = {m._name for m in vars(metrics).values() if hasattr(m, "_name") and hasattr(m, "_type")}
    used = set(re.findall(r"\b(neuron_serve_\w+|neuroncore_\w+|execution_\w+)\{", exprs))
    suffixes = ("_bucket", "_sum", "_count", "_total")
    assert {next((u[: -len(s)] for s in suffixes if u.endswith(s)), u) for u in used} <= declared


def test_dashboard_panels_tile_without_overlap_and_generation_comes_last():
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = {}
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]
    rows = [p for p in panels if p["type"] == "row"]
    assert [r["title"] for r in rows] == ["Generation"]
    # Grafana puts the panels after a row in it: the row sits below every serving panel
    # and above every generation one, which read the generation metrics only.
    at = panels.index(rows[0])
    serving, generation = panels[:at], panels[at + 1:]
    assert max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in serving) <= rows[0]["gridPos"]["y"]
    assert min(p["gridPos"]["y"] for p in generation) >= rows[0]["gridPos"]["y"] + 1
    generation_metrics = re.compile(r"neuron_serve_(time_to_first_token|time_per_output_token|e2e_request_latency|"
                                    r"prompt_tokens|generation_tokens|num_requests|kv_cache|request_success|"
                                    r"generation_step)")
    assert all(generation_metrics.search(t["expr"]) for p in generation for t in p["targets"])
    assert not any(generation_metrics.search(t["expr"]) for p in serving for t in p["targets"])
