#!/usr/bin/env bash
# Checks deploy/ offline, without a cluster or a Docker engine:
#   1. every Kubernetes manifest against the API schemas (kubernetes-validate --strict, from
#      PyPI, installed in target/venv-check-deploy when missing); CRD kinds (ServiceMonitor,
#      ScaledObject, Kustomization) have no schema there and are only parsed, and the KEDA
#      ScaledObject is then checked against a schema of the fields it uses (below);
#   2. what the schemas cannot know: the probes ask the relayer's real endpoints, the pods run
#      as the image's numeric non-root UID, the grace period outlasts the shutdown drain, and
#      the relayer and the migration Job read their URLs from the Secret's keys;
#   3. the Dockerfile: non-root numeric USER, HEALTHCHECK, telemetry on 0.0.0.0, and a
#      .dockerignore that keeps target/ out of the build context.
set -euo pipefail
cd "$(dirname "$0")/.."

# kubernetes-validate and PyYAML live in a virtual environment under target/, not in the
# machine's Python.
venv=target/venv-check-deploy
if [ ! -x "$venv/bin/kubernetes-validate" ]; then
    echo "check-deploy: installing kubernetes-validate from PyPI into $venv (about a minute)" >&2
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check kubernetes-validate
fi
"$venv/bin/kubernetes-validate" --strict --quiet deploy/kubernetes/*.yaml deploy/kubernetes/*/*.yaml

# The base and its optional component build, when kubectl is installed.
if command -v kubectl >/dev/null 2>&1; then
    kubectl kustomize deploy/kubernetes >/dev/null
fi

"$venv/bin/python" - <<'PY'
import re, sys, tomllib, yaml

def load(name):
    with open(f"deploy/kubernetes/{name}") as f:
        return yaml.safe_load(f)

problems = []
def check(ok, what):
    if not ok:
        problems.append(what)

deployment = load("deployment.yaml")
job = load("migrate-job.yaml")
secret = load("secret.yaml")
config = load("configmap.yaml")
pod = deployment["spec"]["template"]["spec"]
relay = pod["containers"][0]
env = {e["name"]: e.get("value") for e in relay["env"]}

check(relay["livenessProbe"]["httpGet"]["path"] == "/healthz", "liveness probe must ask /healthz")
check(relay["readinessProbe"]["httpGet"]["path"] == "/readyz", "readiness probe must ask /readyz")
check(env.get("OUTBOX_TELEMETRY_ADDR") == "0.0.0.0:9187", "telemetry must listen on 0.0.0.0:9187")
for name, spec in [("deployment", pod), ("migrate job", job["spec"]["template"]["spec"])]:
    sc = spec["securityContext"]
    check(sc.get("runAsNonRoot") is True and sc.get("runAsUser") == 65532,
          f"{name}: runAsNonRoot with the image's numeric UID 65532")
    for c in spec["containers"]:
        csc = c["securityContext"]
        check(csc.get("readOnlyRootFilesystem") is True, f"{name}: read-only root filesystem")
        check(csc.get("allowPrivilegeEscalation") is False, f"{name}: no privilege escalation")

settings = tomllib.loads(config["data"]["relay.toml"])
drain = settings.get("shutdown_timeout_ms", 10000) / 1000
check(pod["terminationGracePeriodSeconds"] > drain + 5,
      f"terminationGracePeriodSeconds must exceed shutdown_timeout_ms ({drain} s) with room to release")

keys = set(secret["stringData"])
for name, spec, var in [("deployment", pod, "DATABASE_URL_FILE"),
                        ("migrate job", job["spec"]["template"]["spec"], "DATABASE_URL_FILE")]:
    c = spec["containers"][0]
    path = {e["name"]: e.get("value") for e in c["env"]}[var]
    items = [i for v in spec["volumes"] if "secret" in v for i in v["secret"]["items"]]
    check(any(path.endswith("/" + i["path"]) and i["key"] in keys for i in items),
          f"{name}: {var} must point at a key of the Secret")
check(job["spec"]["template"]["spec"]["containers"][0]["args"] == ["migrate"], "the Job runs migrate")

base = load("kustomization.yaml")
for name in base["resources"]:
    kind = load(name)["kind"]
    check(kind not in ("ServiceMonitor", "PodMonitor", "PrometheusRule", "ScaledObject"),
          f"kustomization.yaml: {name} is a {kind}, which needs a CRD (the Prometheus "
          "Operator's, KEDA's): make it a component")

# The KEDA example (component keda/): KEDA's fields where KEDA wants them (trigger metadata
# values are strings), scaling this Deployment, on metrics the relayer exports.
import jsonschema
scaled = load("keda/scaledobject.yaml")
string_map = {"type": "object", "additionalProperties": {"type": "string"}}
scaled_object_schema = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["scaleTargetRef", "triggers"],
            "properties": {
                "scaleTargetRef": {
                    "type": "object", "additionalProperties": False, "required": ["name"],
                    "properties": {"name": {"type": "string"}, "kind": {"type": "string"},
                                   "apiVersion": {"type": "string"}},
                },
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "advanced": {"type": "object"},
                "fallback": {"type": "object"},
                "triggers": {
                    "type": "array", "minItems": 1,
                    "items": {
                        "type": "object", "additionalProperties": False,
                        "required": ["type", "metadata"],
                        "properties": {"type": {"type": "string"}, "name": {"type": "string"},
                                       "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                                       "metadata": string_map,
                                       "authenticationRef": {"type": "object"}},
                    },
                },
            },
        },
    },
}
try:
    jsonschema.validate(scaled, scaled_object_schema)
except jsonschema.ValidationError as e:
    problems.append(f"keda/scaledobject.yaml: {e.message} at {'/'.join(map(str, e.absolute_path))}")
else:
    spec = scaled["spec"]
    check(spec["scaleTargetRef"]["name"] == deployment["metadata"]["name"],
          "keda/scaledobject.yaml must scale the relayer Deployment")
    check(spec.get("minReplicaCount", 0) >= 2,
          "keda/scaledobject.yaml: keep two relayers at least, like the disruption budget")
    check(spec.get("minReplicaCount", 0) <= spec.get("maxReplicaCount", 100),
          "keda/scaledobject.yaml: minReplicaCount above maxReplicaCount")
    exported = set(re.findall(r'"(outbox_[a-z_]+)"', open("src/telemetry.rs").read()))
    for trigger in spec["triggers"]:
        meta = trigger["metadata"]
        if trigger["type"] == "prometheus":
            for key in ("serverAddress", "query", "threshold"):
                check(key in meta, f"keda/scaledobject.yaml: a prometheus trigger needs {key}")
            for name in re.findall(r"outbox_[a-z_]+", meta.get("query", "")):
                check(name in exported, f"keda/scaledobject.yaml: the query names {name}, "
                      "which the relayer does not export (src/telemetry.rs)")
            check(re.fullmatch(r"\d+(\.\d+)?", meta.get("threshold", "")) is not None,
                  "keda/scaledobject.yaml: threshold must be a number (as a string)")
check(load("keda/kustomization.yaml")["resources"] == ["scaledobject.yaml"],
      "keda/kustomization.yaml must list scaledobject.yaml")
job_tag = job["spec"]["template"]["spec"]["containers"][0]["image"].rsplit(":", 1)[-1]
relay_tag = relay["image"].rsplit(":", 1)[-1]
check(job["metadata"]["name"] == f"outbox-relay-migrate-{job_tag}",
      f"migrate-job.yaml: the Job's name must end with its image tag ({job_tag}), so that a "
      "new version applies as a new Job (a Job's pod template is immutable)")
check(job_tag == relay_tag, f"the migrate Job ({job_tag}) and the Deployment ({relay_tag}) "
      "must run the same version")

with open("docker-compose.yml") as f:
    compose = yaml.safe_load(f)
for service, spec in compose["services"].items():
    for mapping in spec.get("ports", []):
        host_port = str(mapping).split(":")[-2]
        check(host_port not in ("5432", "6379"),
              f"docker-compose.yml: {service} publishes {host_port}, the port of a local "
              "Postgres or Redis: publish another")

dockerfile = open("Dockerfile").read()
check(re.search(r"^USER \d+:\d+$", dockerfile, re.M) is not None, "Dockerfile: numeric non-root USER")
check("HEALTHCHECK" in dockerfile, "Dockerfile: HEALTHCHECK")
check("OUTBOX_TELEMETRY_ADDR=0.0.0.0:9187" in dockerfile, "Dockerfile: telemetry on 0.0.0.0:9187")
check(dockerfile.count("FROM ") >= 2, "Dockerfile: multi-stage")
ignore = open(".dockerignore").read().split()
check("target" in ignore or "/target" in ignore, ".dockerignore must keep target/ out")

if problems:
    print("check-deploy: " + "\n check-deploy: ".join(problems), file=sys.stderr)
    sys.exit(1)
print("check-deploy: manifests and Dockerfile ok")
PY
