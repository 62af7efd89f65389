"""render's own Renderer over a model directory, for tests that need requests built the way render
builds them (chat template, processor tensors, HMAC tags) without a render server: the engine's
tests and render's domain tests."""

from __future__ import annotations

from pathlib import Path

from tito_render.config import RenderConfig
from tito_render.media.features import Signer
from tito_render.model import load_render_model
from tito_render.renderer import Renderer, RenderLimits


def load_renderer(model_dir: Path | str, limits: RenderLimits | None = None, signer: Signer | None = None) -> Renderer:
    """A Renderer over `model_dir` with `limits` (default: render's) and, to tag media items, `signer`."""
    return Renderer(load_render_model(RenderConfig(model=str(model_dir))), limits, signer)
