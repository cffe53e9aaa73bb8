# Serving image for the TensorRT-LLM engine worker (profile / validate / evaluate measure in it; the
# training image, ../Dockerfile, never imports TensorRT-LLM).
#
#   docker build -f docker/trtllm.Dockerfile -t acn-trtllm:1.2.0 .
#   docker run --rm --gpus all acn-trtllm:1.2.0            # prints the worker's version response
#   enroot import -o /shared/images/acn-trtllm.sqsh dockerd://acn-trtllm:1.2.0
#   ... cluster.engine_images.trtllm=/shared/images/acn-trtllm.sqsh   (or export ACN_TRTLLM_IMAGE)
#
# Base: NVIDIA's TensorRT-LLM release container on NGC (tensorrt_llm with its own torch, CUDA, NCCL,
# MPI). 1.2.0 is the release workers/trtllm_worker.py was written against (its docstring names the
# source files read). The tag was chosen without pulling it (no Docker engine where this was
# written); override with --build-arg BASE_IMAGE=nvcr.io/nvidia/tensorrt-llm/release:<tag>.
#
# What the worker needs is already in the base: the Python standard library, torch and
# tensorrt_llm. Nothing of the training stack (megatron-core, Transformer Engine extras, hydra, the
# project) is installed: the worker script is copied next to each request at run time
# (costs/engines/worker.py), so the image does not even need the repository; the copy below is only
# for the smoke test.
ARG BASE_IMAGE=nvcr.io/nvidia/tensorrt-llm/release:1.2.0
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    TLLM_LOG_LEVEL=WARNING

COPY autocompress_nemo/costs/engines/workers/_protocol.py \
     autocompress_nemo/costs/engines/workers/trtllm_worker.py \
     /opt/acn-workers/
COPY docker/engine_smoke.sh /opt/acn-workers/engine_smoke.sh

# The worker speaks the project's protocol with the standard library only: check it parses here.
RUN python3 -m py_compile /opt/acn-workers/_protocol.py /opt/acn-workers/trtllm_worker.py

ENTRYPOINT []
CMD ["bash", "/opt/acn-workers/engine_smoke.sh", "/opt/acn-workers/trtllm_worker.py"]
