#!/usr/bin/env bash
# Checks deploy/ offline, without a cluster or a Docker engine:
#   1. every Kubernetes manifest against the API schemas (kubernetes-validate --strict, from
#      PyPI, installed in target/venv-check-deploy when missing); CRD kinds (ServiceMonitor, Kustomization) have no schema
#      there and are only parsed;
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
    check(kind not in ("ServiceMonitor", "PodMonitor", "PrometheusRule"),
          f"kustomization.yaml: {name} is a {kind}, which needs the Prometheus Operator's CRDs: "
          "make it a component")
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
