# autocompress-nemo on NVIDIA's NGC PyTorch container (the image Slurm jobs run in via pyxis).
#
#   docker build -t autocompress-nemo:0.1.0 .
#   docker run --rm --gpus all autocompress-nemo:0.1.0 python docker/smoke_imports.py
#   enroot import -o autocompress-nemo.sqsh dockerd://autocompress-nemo:0.1.0   # for cluster.container_image
#
# Why this base, pinned: the NGC PyTorch 26.04 release (Ubuntu 24.04) ships Python 3.12 - the
# version the project targets (megatron-core 0.19 requires >= 3.12) - with a CUDA build of torch,
# Transformer Engine, cuDNN, NCCL and Apex built together for Hopper and Blackwell (sm_90 /
# sm_100). We use the PyTorch image rather than the NeMo image because the project needs
# megatron-core 0.19.x exactly (pyproject: >=0.19,<0.20), installed from PyPI on top; the NeMo
# image bundles its own megatron-core / Megatron-Bridge versions, which we would fight.
# The tag was chosen without pulling it (no Docker engine where this was written): the smoke
# test below fails the build if Python is not 3.12 or Transformer Engine is older than the
# 2.10 that megatron-core 0.19's TE paths check for. Bump the tag with BASE_IMAGE if needed.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:26.04-py3
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1

WORKDIR /workspace/autocompress-nemo

# Keep the container's torch / Transformer Engine / NCCL: NGC images pin them in
# /etc/pip/constraint.txt (PIP_CONSTRAINT), and pyproject.toml deliberately does not pin torch.
COPY pyproject.toml README.md ./
COPY autocompress_nemo ./autocompress_nemo
COPY launchers ./launchers
COPY slurm ./slurm
COPY docker ./docker

# GPU extras: Transformer Engine is already in the image (the `gpu` extra's
# transformer-engine[pytorch] is satisfied by it); TensorRT-LLM and vLLM come with their own
# torch pins, so they live in their own serving images, not in this training image.
# mamba-ssm / causal-conv1d build against the container's CUDA for the hybrid (Mamba) models.
RUN pip install -e ".[engines,eval,launch,dev]" \
 && pip install --no-build-isolation "mamba-ssm>=2.2" "causal-conv1d>=1.4" \
 && python docker/smoke_imports.py --no-cuda

# The repository is also mounted over WORKDIR by the Slurm jobs (cluster.container_mounts),
# so code changes do not need a rebuild; the editable install follows the mount.
CMD ["python", "docker/smoke_imports.py"]
