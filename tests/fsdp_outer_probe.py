"""EDGC on the outer hop of Megatron-FSDP's HSDP, 4 CPU processes with gloo (issue 94).

    torchrun --nproc-per-node 4 tests/fsdp_outer_probe.py CASE[,CASE...] OUT_DIR [STEPS]

Each CASE is ``MODE-INNER[:lin]``, INNER one of ``no_shard``, ``optim_grads_params`` (the model,
optimizer of ``tests/fsdp_hsdp_probe.py``, 2 instances x 2, 2 micro-batches; ``:lin``:
Adam in its linear regime, :data:`LIN`; tokens from :func:`tokens`),
MODE one of:

* ``dense``: Megatron-FSDP as it is (the reference);
* ``full``: :class:`~megatron_edgc.patches.fsdp_outer.FSDPOuterCompression` at rank
  :data:`FULL_RANK` (= min(n, m) of every matrix) with every matrix compressed;
* ``low``: at rank :data:`LOW_RANK`, the compressibility rule as the DP patch's;
* ``skip``: ``low`` with rank 0's loss NaN at step :data:`SKIP_STEP`: the optimizer is not
  stepped there and the step is reported not applied;
* ``resume``: ``low`` whose compressor state is saved after :data:`RESUME_AT` steps
  (``torch.save`` to bytes), the patch taken off, a new compressor built on the model and
  loaded from those bytes, then the rest of the steps.

Writes ``OUT_DIR/CASE/rank<r>.pt``: the weights after the steps, the losses, the calls
and bytes of the outer (inter-instance) group and of the inner (instance) group, the
reduced gradient buffers of step 0 per bucket, Megatron-FSDP's layout, and per mode what
the tests read (the compressor's own wire bytes; for ``skip`` the state around the skipped
step; for ``resume`` the state saved and as loaded).
"""

from __future__ import annotations

import io
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import fsdp_hsdp_probe as base  # noqa: E402
from megatron_edgc.patches.cpu import apply_cpu_shims  # noqa: E402

FULL_RANK, LOW_RANK, SKIP_STEP, RESUME_AT = 64, 16, 1, 2
#: ``:lin``: megatron-core's Adam (the distributed optimizer takes no other) in its linear
#: regime, ``eps`` far above ``sqrt(v)`` and no momentum: each update is
#: ``lr * g / (sqrt(v) + eps)``, i.e. ``g`` to within ``|g| / eps`` (gradients here are
#: below 1e-1): an SGD whose weights differ by what the gradients differ by
LIN = dict(lr=1.0, adam_eps=1.0, adam_beta1=0.0)


def tokens(step: int, micro: int, dp_rank: int) -> torch.Tensor:
    """A learnable stream (every token's successor is ``(5 t + 3) mod V``) from a random
    first token per sequence, by step, micro-batch and DP rank: the loss falls from
    ln V within a few steps, so its curve can tell compressed from dense."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * micro + dp_rank)
    t = torch.randint(0, base.VOCAB, (base.MICRO_BATCH, 1), generator=g)
    seq = [t]
    for _ in range(base.SEQ):
        seq.append((5 * seq[-1] + 3) % base.VOCAB)
    return torch.cat(seq, dim=1)


def compressor(model, mode: str):
    from megatron_edgc.patches.fsdp_outer import FSDPOuterCompression

    if mode == "full":
        return FSDPOuterCompression(model, rank=FULL_RANK, seed=base.SEED, compress_all=True)
    return FSDPOuterCompression(model, rank=LOW_RANK, seed=base.SEED)


def run_case(case: str, out_dir: str, steps: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    name, _, opt = case.partition(":")
    mode, _, inner_strategy = name.partition("-")
    model, config = base.build("hsdp-" + inner_strategy)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", **(LIN if opt == "lin" else dict(lr=base.LR)),
                        weight_decay=0.0, clip_grad=0.0,
                        use_distributed_optimizer=True, bf16=False, fp16=False), [model])
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    dp_rank = parallel_state.get_data_parallel_rank()
    outer = parallel_state.get_inter_distributed_optimizer_instance_group()
    pipeline = model.module.grad_reduce_pipeline
    layout = base.fsdp_layout(model)
    inner = model.param_and_grad_buffer.parameter_groups[layout[0]["bucket_id"]] \
        .main_grad_buffer.data_parallel_group
    outer_counter, inner_counter = base.OuterCounter(), base.OuterCounter()
    outer_counter.install(outer)
    inner_counter.install(inner)
    comp = compressor(model, mode) if mode != "dense" else None
    initial = base.full_weights(model) if mode == "dense" else None
    out = {"initial_weights": initial, "wire_bytes": comp.wire_bytes() if comp else None,
           "dense_outer_bytes": comp.dense_outer_bytes() if comp else None}

    def forward_step(data_iterator, model, nan=False):
        batch = next(data_iterator)
        ids, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        position_ids = torch.arange(base.SEQ).unsqueeze(0).expand_as(ids)
        losses = model(ids, position_ids, None, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            if nan:
                loss = loss * float("nan")
            return loss, {"lm loss": loss.detach().clone()}

        return losses, loss_func

    losses, first_grads, step_s = [], [], []
    try:
        for step in range(steps):
            if mode == "resume" and step == RESUME_AT:
                saved = comp.state_dict()
                blob = io.BytesIO()
                torch.save(saved, blob)
                comp.restore()
                comp = compressor(model, mode)
                out["resume_unfit"] = comp.load_state_dict(
                    torch.load(io.BytesIO(blob.getvalue()), weights_only=False))
                out["resume_saved"], out["resume_loaded"] = saved, comp.state_dict()
            model.zero_grad_buffer()
            optimizer.zero_grad()
            if comp is not None:
                comp.set_iteration(step)
                comp.set_loss_scale(None)
                comp.prepare_iteration()
            skip = mode == "skip" and step == SKIP_STEP
            if skip:
                out["skip_before"] = comp.state_dict()
                out["skip_weights_before"] = base.full_weights(model)
            nan = skip and dist.get_rank() == 0
            data = iter([tokens(step, m, dp_rank) for m in range(base.MICRO_BATCHES)])
            t0 = time.perf_counter()
            res = get_forward_backward_func()(
                forward_step_func=lambda it, m: forward_step(it, m, nan), data_iterator=data,
                model=model, num_microbatches=base.MICRO_BATCHES, seq_length=base.SEQ,
                micro_batch_size=base.MICRO_BATCH, forward_only=False)
            step_s.append(time.perf_counter() - t0)
            if step == 0:
                first_grads = [pipeline.get_fsdp_buffer(b["bucket_id"]).data.detach().clone()
                               for b in layout]
            if skip:
                # the reduced gradients as the optimizer would see them, and no step: the
                # optimizer's skip of a non-finite gradient
                out["skip_grads_finite"] = all(
                    bool(torch.isfinite(pipeline.get_fsdp_buffer(b["bucket_id"]).data).all())
                    for b in layout)
                comp.after_step(applied=False)
                out["skip_after"] = comp.state_dict()
                losses.append(float("nan"))
                continue
            ok, _, _ = optimizer.step()
            assert ok
            if comp is not None:
                comp.after_step(applied=True)
            losses.append(float(sum(o["lm loss"] for o in res) / len(res)))
    finally:
        inner_counter.uninstall()
        outer_counter.uninstall()
    weights = base.full_weights(model)
    if comp is not None:
        comp.restore()
    out.update({"rank": dist.get_rank(), "losses": losses, "weights": weights,
                "outer_calls": outer_counter.calls, "outer_bytes": outer_counter.bytes,
                "outer_shapes": outer_counter.shapes,
                "inner_calls": inner_counter.calls, "inner_bytes": inner_counter.bytes,
                "inner_shapes": inner_counter.shapes,
                "outer_members": dist.get_process_group_ranks(outer),
                "inner_members": dist.get_process_group_ranks(inner),
                "first_grads": first_grads, "layout": layout, "step_s": step_s,
                "params": {n.removeprefix("module."): tuple(p.shape)
                           for n, p in model.module.named_parameters()}})
    os.makedirs(out_dir, exist_ok=True)
    torch.save(out, os.path.join(out_dir, f"rank{dist.get_rank()}.pt"))


def main() -> None:
    cases, out_dir = sys.argv[1].split(","), sys.argv[2]
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    apply_cpu_shims()
    from megatron_edgc.patches.fsdp_cpu import apply_fsdp_cpu_shims

    apply_fsdp_cpu_shims()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state

    for case in cases:
        torch.manual_seed(0)
        run_case(case, os.path.join(out_dir, case), steps)
        parallel_state.destroy_model_parallel()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
