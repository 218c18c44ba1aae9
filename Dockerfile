# miles on GPUs: an SGLang image (CUDA, torch, sglang, sglang-router) with miles and its `gpu` extra installed.
#
#   docker build -t miles:gpu .                                    # pin SGLang: --build-arg BASE_IMAGE=lmsysorg/sglang:<tag>
#   docker run --gpus all --ipc=host --shm-size 32g -v /root:/root miles:gpu bash scripts/run-qwen3-4B-fsdp.sh
#
# Models and data are not in the image (miles never downloads them): mount them. The CPU variant is Dockerfile.cpu.
ARG BASE_IMAGE=lmsysorg/sglang:latest
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
# the base image's torch and sglang satisfy the requirements and are kept; the extra adds what is missing
RUN python3 -m pip install --no-cache-dir -e ".[gpu,test]"
COPY scripts ./scripts
COPY tests ./tests
COPY docs ./docs

CMD ["bash"]
