"""The gateway's Starlette app in the test process, over a fake of the three services
(tests/support/gateway_fakes.py): fast enough to send it hundreds of hostile bodies."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gateway_fakes import SERVED, FakeUpstream
from starlette.testclient import TestClient

from tito_gateway.app import Gateway


@pytest.fixture
def upstream() -> FakeUpstream:
    return FakeUpstream(model_id=SERVED)


@pytest.fixture
def client(upstream) -> Iterator[TestClient]:
    """The gateway's app over `upstream`, serving the model render reports (no --served-model-name)."""
    with TestClient(Gateway(upstream).asgi(), raise_server_exceptions=False) as http:
        yield http
