"""GPT-2 pretraining on megatron-core: model, data, loop, checkpoints, launch."""
