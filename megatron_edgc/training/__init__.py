"""GPT-2 pretraining on megatron-core: model, data, loop, checkpoints, launch."""

import warnings

# megatron-core announces at import that it falls back from apex/transformer-engine to
# torch implementations; that is the expected configuration on CPU, not news.
warnings.filterwarnings("ignore", message=".*(Transformer Engine and Apex|Apex is not) "
                                          "(are not |)installed.*")
warnings.filterwarnings("ignore", message="full scope is deprecated")  # cuda-graph default
