"""A training loop of one's own on megatron-core, as Megatron-Bridge's is: megatron-core's
GPTModel, DistributedDataParallel, optimizer and schedule, stepped without Megatron-LM's
``train_step`` (issue 92). Run on gloo, DP over every process:

    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        -m megatron_edgc.megatron_lm.cpu tests/own_loop_job.py [--enable] [--as-bridge]

``--enable``: ``megatron_edgc.megatron_lm.enable()`` first, as a user adds it to a script;
``--as-bridge``: the loop (:func:`train`) runs from this file loaded under Megatron-Bridge's
module name, ``megatron.bridge.training.train`` (a stand-in: Megatron-Bridge does not
install here; docs/megatron-lm.md). Every rank prints ``own loop: iteration I loss L``
after each step (rank 0's line first) and ``own loop: done`` at the end.
"""

import argparse
import importlib.util
import sys

ITERATIONS = 3
MODEL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128,
             seq_length=32, micro_batch_size=2)


def train(model, optimizer, config, iterations: int, rank: int) -> None:
    """The loop: zero the buffers, megatron-core's schedule (its ``finalize_model_grads``
    syncs the gradients), the optimizer step."""
    import torch
    from megatron.core.pipeline_parallel import get_forward_backward_func

    forward_backward = get_forward_backward_func()
    seq, mbs, vocab = MODEL["seq_length"], MODEL["micro_batch_size"], MODEL["vocab_size"]
    # the same two micro-batches every iteration (each rank its own): the loss falls
    batches = torch.randint(0, vocab, (2, mbs, seq + 1),
                            generator=torch.Generator().manual_seed(1234 + rank))

    def forward_step(data_iterator, chunk):
        tokens = batches[next(data_iterator)]
        positions = torch.arange(seq).unsqueeze(0).expand(mbs, seq)
        output = chunk(tokens[:, :-1], positions, None, labels=tokens[:, 1:])

        def loss_func(output_tensor):
            loss = output_tensor.float().mean()
            return loss, {"lm loss": loss.detach().clone()}
        return output, loss_func

    for iteration in range(1, iterations + 1):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(forward_step_func=forward_step, data_iterator=iter(range(2)),
                                  model=model, num_microbatches=2, seq_length=seq,
                                  micro_batch_size=mbs, forward_only=False)
        ok, _, _ = optimizer.step()
        loss = float(sum(d["lm loss"] for d in losses) / len(losses))
        print(f"own loop: iteration {iteration} loss {loss:.4f} step "
              f"{'applied' if ok else 'skipped'}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--enable", action="store_true")
    parser.add_argument("--as-bridge", action="store_true")
    opts = parser.parse_args()
    if opts.enable:
        import megatron_edgc.megatron_lm as edgc
        edgc.enable()

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    from megatron_edgc.patches.cpu import model_parallel_cpu_manual_seed

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel()
    torch.manual_seed(1234)
    model_parallel_cpu_manual_seed(1234, 0)
    config = TransformerConfig(
        num_layers=MODEL["num_layers"], hidden_size=MODEL["hidden_size"],
        num_attention_heads=MODEL["num_attention_heads"], hidden_dropout=0.0,
        attention_dropout=0.0, normalization="LayerNorm", activation_func=F.gelu,
        use_cpu_initialization=True, masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        persist_layer_norm=False)
    gpt = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                   vocab_size=MODEL["vocab_size"], max_sequence_length=MODEL["seq_length"],
                   position_embedding_type="learned_absolute")
    model = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(),
                                    module=gpt)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=1.0), [model])
    config.finalize_model_grads_func = finalize_model_grads
    loop = train
    if opts.as_bridge:
        name = "megatron.bridge.training.train"
        spec = importlib.util.spec_from_file_location(name, __file__)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        loop = module.train
    loop(model, optimizer, config, ITERATIONS, dist.get_rank())
    print("own loop: done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
