# miles on GPUs: an SGLang image (CUDA, torch, sglang, sglang-router) with miles and its `gpu` extra installed.
#
#   docker build -t miles:gpu .
#   docker run --gpus all --ipc=host --shm-size 32g -v /root:/root miles:gpu bash scripts/run-qwen3-4B-fsdp.sh
#
# Models and data are not in the image (miles never downloads them): mount them. The CPU variant is Dockerfile.cpu.
#
# The base is pinned to SGLang 0.5.23, the release miles' engine contract is written and tested against
# (docs/sglang-contract.md, scripts/sglang-venv.sh) and the `gpu` extra pins. SGLang publishes each release as
# lmsysorg/sglang:v<version> (its default CUDA build) and lmsysorg/sglang:v<version>-cu130 (CUDA 13.0, NVIDIA driver
# 580 or newer): for the CUDA 13 build pass --build-arg BASE_IMAGE=lmsysorg/sglang:v0.5.23-cu130. Another release
# breaks the pins (tests/unit/test_dockerfiles.py) until pyproject.toml and the contract move with it.
ARG BASE_IMAGE=lmsysorg/sglang:v0.5.23
FROM ${BASE_IMAGE}

ENV HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false \
    PYTHONUNBUFFERED=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /opt/miles
# metadata first, so that the dependency layer is rebuilt only when the dependencies change
COPY pyproject.toml setup.py README.md LICENSE ./
COPY miles ./miles
COPY examples ./examples
# the base image's torch and sglang (0.5.23, as the gpu extra pins) are kept; the extra adds what is missing
RUN python3 -m pip install --no-cache-dir -e ".[gpu,test]"
COPY scripts ./scripts
COPY tests ./tests
COPY docs ./docs

CMD ["bash"]
