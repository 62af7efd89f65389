"""Where each of the project's Python packages lives in the tree (the card's layout), for the tests
that read the source itself: packaging, error reasons, which frames are tito's own code."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: package name -> its folder. The services sit under services/, the client library under
#: clients/python/, the `tito` command under cli/, the offline model builders under models/, and the
#: common runtime with the generated stubs (tito.v1) at the top.
PACKAGE_ROOTS = {
    "tito": ROOT / "tito",
    "tito_render": ROOT / "services" / "render" / "tito_render",
    "tito_engine": ROOT / "services" / "engine" / "tito_engine",
    "tito_derender": ROOT / "services" / "derender" / "tito_derender",
    "tito_gateway": ROOT / "services" / "gateway" / "tito_gateway",
    "tito_client": ROOT / "clients" / "python" / "tito_client",
    "tito_cli": ROOT / "cli" / "tito_cli",
    "tito_models": ROOT / "models" / "tito_models",
}
