"""Front-end 1, this project's trainer: GPT-2 pretraining on megatron-core (model, data,
tokenizer, loop, checkpoints, launch, zero-shot eval) and its two commands, ``edgc-pretrain``
(:mod:`.pretrain`) and ``edgc-prepare-data`` (:mod:`.prepare_data`)."""
