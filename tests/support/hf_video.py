"""transformers' video processor classes as references for render's video code.

Their modules import torchvision, which does not import beside the CPU torch here; the parts the
tests compare with (patchify, the size choice in resize, the class defaults) are plain torch. So
the class is imported behind empty stand-in torchvision modules, which leave sys.modules after.
"""

from __future__ import annotations

import importlib
import sys
import types

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
