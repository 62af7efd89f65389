"""The Kubernetes manifests (deploy/kubernetes) and the Dockerfiles cannot rot: every kustomization
renders (here, in Python: the subset of kustomize they use), every document validates against the
pinned Kubernetes version's schema (kubernetes-validate, offline, strict), and every `tito serve`
container names only flags and TITO_* variables that form of the CLI accepts."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tito_cli import main as cli
from tito.env_flags import apply_env, env_variables

REPO = Path(__file__).resolve().parents[3]
KUBERNETES = REPO / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33.0"  # native sidecars and gRPC probes are GA; keep docs/deploy.md in step
KUSTOMIZATIONS = sorted(path.parent for path in KUBERNETES.rglob("kustomization.yaml"))
#: TITO_* variables that are not flags (read by tito_models.tiny: where tiny models are built).
NON_FLAG_VARIABLES = {"TITO_CACHE_DIR"}
_KNOWN_KEYS = {"apiVersion", "kind", "resources", "images", "patches"}


def render(directory: Path) -> list[dict]:
    """The documents `kustomize build directory` gives, for the features these manifests use:
    resources (files and directories), images (newName/newTag) and JSON 6902 patches by kind/name."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - _KNOWN_KEYS
    assert not unknown, f"{directory}: teach render() {sorted(unknown)} (or use what it knows)"
    documents: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = directory / resource
        documents += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        matches = [d for d in documents
                   if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        assert len(matches) == 1, f"{directory}: patch target {target} matches {len(matches)} documents"
        for operation in yaml.safe_load(patch["patch"]):
            _apply(matches[0], operation)
    for image in kustomization.get("images", []):
        for container in _containers(documents):
            name = re.split(r"[:@]", container["image"], maxsplit=1)[0]
            if name == image["name"]:
                tag = image.get("newTag") or (container["image"].split(":", 1)[1] if ":" in container["image"] else "")
                container["image"] = image.get("newName", name) + (f":{tag}" if tag else "")
    return documents


def _apply(document: dict, operation: dict) -> None:
    """One JSON patch (RFC 6902) operation: add, replace, remove or test."""
    *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]]
    node = document
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    key = (len(node) if last == "-" else int(last)) if isinstance(node, list) else last
    op, value = operation["op"], copy.deepcopy(operation.get("value"))
    if op == "test":
        assert node[key] == value, f"patch test failed at {operation['path']}: {node[key]!r} != {value!r}"
    elif op == "remove":
        del node[key]
    elif op == "add" and isinstance(node, list):
        node.insert(key, value)
    elif op in ("add", "replace"):
        if op == "replace" and isinstance(node, dict):
            assert key in node, f"replace of a missing {operation['path']}"
        node[key] = value
    else:
        raise AssertionError(f"unsupported patch op {op!r}")


def _containers(documents: list[dict]) -> list[dict]:
    specs = [d["spec"]["template"]["spec"] for d in documents if d["kind"] == "Deployment"]
    return [c for spec in specs for c in (*spec.get("initContainers", []), *spec["containers"])]


def _tito_containers(documents: list[dict]) -> list[tuple[str, dict]]:
    """(serve form, container) for every container running `tito serve FORM`."""
    return [(c["args"][1], c) for c in _containers(documents) if c.get("args", [])[:1] == ["serve"]]


@pytest.fixture(scope="module", params=KUSTOMIZATIONS, ids=lambda p: str(p.relative_to(KUBERNETES)))
def rendered(request) -> tuple[Path, list[dict]]:
    return request.param, render(request.param)


def test_both_kustomizations_are_there():
    assert {p.relative_to(KUBERNETES).as_posix() for p in KUSTOMIZATIONS} >= {"base", "overlays/cuda"}


def test_every_document_is_valid_for_the_pinned_kubernetes(rendered):
    _, documents = rendered
    kinds = sorted(d["kind"] for d in documents)
    assert kinds == ["Deployment", "Deployment", "PodDisruptionBudget", "PodDisruptionBudget", "Service", "Service"]
    for document in documents:
        try:
            kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            raise AssertionError(f"{document['kind']}/{document['metadata']['name']}: {error.message} "
                                 f"at {list(error.path)}") from None


def test_tito_containers_use_only_flags_and_variables_the_cli_accepts(rendered):
    _, documents = rendered
    parser = cli.build_parser()
    forms = set()
    for form, container in _tito_containers(documents):
        forms.add(form)
        variables = env_variables(cli.serve_parser(parser, form))
        for entry in container.get("env", []):
            if entry["name"].startswith("TITO_"):
                assert entry["name"] in variables or entry["name"] in NON_FLAG_VARIABLES, \
                    f"{container['name']}: {entry['name']} is not a variable of `tito serve {form}`"
        for arg in container["args"][2:]:
            if arg.startswith("--"):
                assert arg.split("=")[0] in variables.values(), f"{container['name']}: {arg} is no flag of {form}"
        # The values parse the way the CLI would take them (types, choices, exclusive flags).
        argv = ["serve", form]
        args = parser.parse_args(argv)
        environ = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
        apply_env(parser, cli.serve_parser(parser, form), argv, args, environ)
    assert forms == {"render", "engine", "derender", "gateway"}


def test_probes_are_native_grpc_on_the_health_address(rendered):
    """The gRPC services' probes; the gateway's is HTTP on its own port."""
    _, documents = rendered
    for form, container in _tito_containers(documents):
        environ = {e["name"]: e.get("value") for e in container["env"]}
        if form == "gateway":  # HTTP: GET /health says whether the services behind it all serve
            assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
            assert {p["name"]: p["containerPort"] for p in container["ports"]}["http"] == \
                int(environ["TITO_ADDRESS"].rsplit(":", 1)[1])
            continue
        health_port = int(environ["TITO_HEALTH_ADDRESS"].rsplit(":", 1)[1])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"]["port"] == health_port, (container["name"], probe)
        service = container["readinessProbe"]["grpc"]["service"]
        assert service == f"tito.v1.{form.capitalize()}Service", service


def test_secrets_are_mounted_where_the_variables_point(rendered):
    _, documents = rendered
    for document in (d for d in documents if d["kind"] == "Deployment"):
        spec = document["spec"]["template"]["spec"]
        secret_volumes = {v["name"] for v in spec["volumes"] if "secret" in v}
        for form, container in _tito_containers([document]):
            mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
            for entry in container["env"]:
                if entry["name"].endswith("_FILE"):
                    directory = str(Path(entry["value"]).parent)
                    assert mounts.get(directory) in secret_volumes, (container["name"], entry["name"])


def test_the_headless_service_selects_the_engine_pods(rendered):
    _, documents = rendered
    service = next(d for d in documents if d["kind"] == "Service")
    engine = next(d for d in documents if d["kind"] == "Deployment" and d["metadata"]["name"] == "tito-engine")
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"].items() <= engine["spec"]["template"]["metadata"]["labels"].items()


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (the Python rendering ran)")
def test_the_python_rendering_matches_kubectl_kustomize(rendered):
    directory, documents = rendered
    result = subprocess.run(["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        pytest.skip(f"kubectl kustomize is unavailable here: {result.stderr.strip()[:200]}")
    key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
    assert sorted(yaml.safe_load_all(result.stdout), key=key) == sorted(documents, key=key)


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.cuda"])
def test_dockerfiles_run_tito_serve_all_with_variables_it_accepts(dockerfile):
    text = (REPO / dockerfile).read_text()
    assert 'ENTRYPOINT ["tito"]' in text and 'CMD ["serve", "all"]' in text
    assert re.search(r"^USER 10001", text, re.M), "the image runs as a non-root user"
    assert "torch==2.13.0" in text
    variables = env_variables(cli.serve_parser(cli.build_parser(), "all"))
    for name in re.findall(r"\b(TITO_[A-Z0-9_]+)=", text):
        assert name in variables or name in NON_FLAG_VARIABLES, f"{dockerfile}: {name} is not a serve all variable"
