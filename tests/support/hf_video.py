"""transformers' video processing as the reference for render's video code.

transformers' video processor modules import torchvision, which does not import beside the CPU
torch here; the parts the tests compare with (patchify, the size choice in resize, the class
defaults) are plain torch. So `video_processor_class` imports a class behind empty stand-in
torchvision modules, which leave sys.modules after.
"""

from __future__ import annotations

import importlib
import sys
import types

import numpy as np
import torch

_TORCHVISION = ["torchvision", "torchvision.transforms", "torchvision.transforms.v2",
                "torchvision.transforms.v2.functional"]


def video_processor_class(module_name: str, class_name: str) -> type:
    """`class_name` from transformers' `module_name`, imported behind a stand-in torchvision."""
    import transformers.video_processing_utils  # noqa: F401 - import before torchvision is faked

    saved = {name: sys.modules.get(name) for name in [*_TORCHVISION, module_name]}
    for name in _TORCHVISION:
        sys.modules[name] = types.ModuleType(name)
    try:
        return getattr(importlib.import_module(module_name), class_name)
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def hf_video_rows(image_processor, settings, frames, size: tuple[int, int], video_processor_class):
    """HF's pixel rows and grid for `frames` at `size` (height, width): the image processor (PIL
    backend) converts, resizes, rescales and normalizes each frame, then the video processor's
    patchify pads the frames and lays out the patches. `settings` is render's VideoSettings."""
    from transformers.image_utils import SizeDict

    height, width = size
    normalized = []
    for frame in frames:
        array = image_processor.process_image(frame, do_convert_rgb=True)  # [C, H, W] uint8
        array = type(image_processor).__mro__[1].resize(
            image_processor, array, SizeDict(height=height, width=width), resample=settings.resample)
        array = image_processor.rescale(array, settings.rescale_factor)
        array = image_processor.normalize(array, list(settings.image_mean), list(settings.image_std))
        normalized.append(array)
    video = torch.from_numpy(np.stack(normalized))[None]  # [1, T, C, H, W]
    rows, grid_t, grid_h, grid_w = video_processor_class.patchify(
        None, video, patch_size=settings.patch_size, merge_size=settings.merge_size,
        temporal_patch_size=settings.temporal_patch_size)
    return rows[0].numpy(), np.array([[grid_t, grid_h, grid_w]], dtype=np.int64)
