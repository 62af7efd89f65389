"""Fixtures shared by render's domain tests."""

from __future__ import annotations

import pytest

from tito_render.renderer import Renderer

from renderers import load_renderer


@pytest.fixture(scope="module")
def qwen(tiny_vl_model) -> Renderer:
    """The tiny Qwen2-VL's renderer, one per test module (its processed-media cache counts per module)."""
    return load_renderer(tiny_vl_model)
