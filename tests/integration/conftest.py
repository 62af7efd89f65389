"""Fixtures shared by the integration tests (the servers themselves come from tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gateway_servers import Front


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_text_model):
    """transformers' own tokenizer of the tiny text model: the reference the servers' token ids
    and texts are checked against."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_text_model))


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> Path:
    """An HMAC key file the engines of a prefill/decode pair share (--hmac-key-file)."""
    path = tmp_path_factory.mktemp("pd-key") / "hmac.key"
    path.write_bytes(b"k" * 32)
    return path


@pytest.fixture(scope="module")
def front(module_aio_server, tiny_text_model) -> Front:
    """render and derender of the tiny Qwen2, for gateways over engines of it."""
    from tito_derender.config import DerenderConfig
    from tito_derender.server import create_server as create_derender
    from tito_render.config import RenderConfig
    from tito_render.server import create_server as create_render

    model = str(tiny_text_model)
    return Front(module_aio_server(lambda: create_render(RenderConfig(model=model))),
                 module_aio_server(lambda: create_derender(DerenderConfig(model=model))), module_aio_server)
