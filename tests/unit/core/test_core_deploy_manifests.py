"""The Kubernetes manifests (deploy/kubernetes) and the Dockerfiles cannot rot: every kustomization
renders (here, in Python: the subset of kustomize they use), every document validates against the
pinned Kubernetes version's schema (kubernetes-validate, offline, strict), every `tito serve`
container names only flags and TITO_* variables that form of the CLI accepts, and SMG's container
(deploy/kubernetes/smg) only arguments SMG's own launcher parses, pointed at the engines' port."""

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


_TITO_FORMS = {"render", "engine", "derender", "gateway"}
#: Per kustomization: the kinds of its documents, and the `tito serve` forms its containers run.
EXPECTED = {
    "base": (["Deployment", "Deployment", "PodDisruptionBudget", "PodDisruptionBudget", "Service", "Service"],
             _TITO_FORMS),
    "overlays/cuda": (["Deployment", "Deployment", "PodDisruptionBudget", "PodDisruptionBudget", "Service", "Service"],
                      _TITO_FORMS),
    # tito behind SMG: engines, SMG (with the pod reader its service discovery needs), no tito gateway.
    "smg": (["Deployment", "Deployment", "Role", "RoleBinding", "Service", "Service", "ServiceAccount"], {"engine"}),
}


def _name(directory: Path) -> str:
    return directory.relative_to(KUBERNETES).as_posix()


def test_every_kustomization_is_there():
    assert {_name(p) for p in KUSTOMIZATIONS} == set(EXPECTED)


def test_every_document_is_valid_for_the_pinned_kubernetes(rendered):
    directory, documents = rendered
    kinds = sorted(d["kind"] for d in documents)
    assert kinds == EXPECTED[_name(directory)][0]
    for document in documents:
        try:
            kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            raise AssertionError(f"{document['kind']}/{document['metadata']['name']}: {error.message} "
                                 f"at {list(error.path)}") from None


def test_tito_containers_use_only_flags_and_variables_the_cli_accepts(rendered):
    directory, documents = rendered
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
    assert forms == EXPECTED[_name(directory)][1]


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


def _deployment(documents: list[dict], name: str) -> dict:
    return next(d for d in documents if d["kind"] == "Deployment" and d["metadata"]["name"] == name)


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def test_the_headless_service_selects_the_engine_pods(rendered):
    _, documents = rendered
    [service] = [d for d in documents if d["kind"] == "Service" and d["spec"].get("clusterIP") == "None"]
    engine = _deployment(documents, service["metadata"]["name"])
    assert service["spec"]["selector"].items() <= engine["spec"]["template"]["metadata"]["labels"].items()
    [container] = engine["spec"]["template"]["spec"]["containers"]
    assert container["args"] == ["serve", "engine"]
    [port] = service["spec"]["ports"]
    assert {p["name"]: p["containerPort"] for p in container["ports"]}[port["targetPort"]] == port["port"] == \
        int(_env(container)["TITO_ADDRESS"].rsplit(":", 1)[1])


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


@pytest.fixture(scope="module")
def smg_manifests() -> list[dict]:
    return render(KUBERNETES / "smg")


def _smg_container(documents: list[dict]) -> dict:
    [container] = _deployment(documents, "tito-smg")["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["smg"] and container["args"][0] == "launch", container["command"]
    return container


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_smg_finds_the_engine_pods_on_the_port_they_serve(smg_manifests):
    """The selector, port and namespace SMG discovers engines by are the engine Deployment's."""
    args = _smg_container(smg_manifests)["args"]
    engine = _deployment(smg_manifests, "tito-smg-engine")
    [engine_container] = engine["spec"]["template"]["spec"]["containers"]
    key, _, value = _arg(args, "--selector").partition("=")
    assert engine["spec"]["template"]["metadata"]["labels"][key] == value
    assert _arg(args, "--service-discovery-port") == _env(engine_container)["TITO_ADDRESS"].rsplit(":", 1)[1]
    assert _arg(args, "--policy") == "cache_aware"
    # SMG waits for requests in flight as long as the engines do.
    assert _arg(args, "--shutdown-grace-period-secs") == _env(engine_container)["TITO_GRACE_SECONDS"]
    smg = _smg_container(smg_manifests)
    namespace = _arg(args, "--service-discovery-namespace")
    assert namespace == "$(POD_NAMESPACE)"  # expanded by the kubelet from the downward API
    assert any(e["name"] == "POD_NAMESPACE" and e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
               for e in smg["env"])
    account = _deployment(smg_manifests, "tito-smg")["spec"]["template"]["spec"]["serviceAccountName"]
    [binding] = [d for d in smg_manifests if d["kind"] == "RoleBinding"]
    [role] = [d for d in smg_manifests if d["kind"] == "Role"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert {"list", "watch"} <= set(role["rules"][0]["verbs"]) and role["rules"][0]["resources"] == ["pods"]


def test_smgs_parsers_are_the_ones_tito_declares_and_its_port_is_served(smg_manifests):
    from tito.parsers import REASONING_FORMATS, TOOL_FORMATS

    smg = _smg_container(smg_manifests)
    args = smg["args"]
    assert _arg(args, "--reasoning-parser") == REASONING_FORMATS["qwen3"].smg
    assert _arg(args, "--tool-call-parser") == TOOL_FORMATS["hermes"].smg
    ports = {p["name"]: p["containerPort"] for p in smg["ports"]}
    assert ports["http"] == int(_arg(args, "--port")) and ports["metrics"] == int(_arg(args, "--prometheus-port"))
    [service] = [d for d in smg_manifests if d["kind"] == "Service" and d["metadata"]["name"] == "tito-smg"]
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert smg["readinessProbe"]["httpGet"]["port"] == "http"


@pytest.mark.smg
def test_smgs_arguments_are_ones_its_launcher_parses(smg_manifests):
    from smg.launch_router import parse_router_args

    args = _smg_container(smg_manifests)["args"]
    parsed = parse_router_args([arg.replace("$(POD_NAMESPACE)", "default") for arg in args[1:]])
    assert parsed.service_discovery and parsed.policy == "cache_aware"
    assert parsed.service_discovery_port == int(_arg(args, "--service-discovery-port"))
