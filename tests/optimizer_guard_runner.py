"""One process (gloo, world 1, CPU shims): megatron-core's optimizers stepped on a NaN
gradient under the non-finite step guard; prints one JSON line per variant.

    python tests/optimizer_guard_runner.py

Each variant: a clean step (the optimizer state exists), then a gradient with one NaN:
``step()`` must return False and leave the parameters, the optimizer's main parameters
and its state bit-identical; then a clean step again updates them. A fresh process, as
the CPU shims patch torch's factories for good.
"""

import io
import json
import os
import sys
from contextlib import redirect_stdout

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

VARIANTS = {   # name: (bf16, clip_grad, distributed optimizer, chained[, guarded])
    "fp32": (False, 1.0, False, False),
    "fp32-clip0": (False, 0.0, False, False),
    "bf16": (True, 1.0, False, False),
    "bf16-clip0": (True, 0.0, False, False),
    "distopt-bf16": (True, 1.0, True, False),
    "chained-fp32": (False, 1.0, False, True),
    "chained-distopt-clip0": (False, 0.0, True, True),
    # the bug, without the guard: megatron-core writes the NaN into the weights
    "bf16-unguarded": (True, 1.0, False, False, False),
}


def tensors_of(optimizer) -> dict:
    """Every tensor the step may change: model parameters, the inner optimizers' parameters
    (fp32 main copies) and their state, cloned."""
    out = {}
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    for i, opt in enumerate(inner):
        for g, group in enumerate(opt.optimizer.param_groups):
            for k, p in enumerate(group["params"]):
                out[f"{i}.main.{g}.{k}"] = p.detach().clone()
                for name, value in opt.optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        out[f"{i}.state.{g}.{k}.{name}"] = value.detach().clone()
                    else:
                        out[f"{i}.state.{g}.{k}.{name}"] = torch.tensor(value)
    return out


def run(name, bf16, clip, distopt, chained, guarded=True) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.optimizer import ChainedOptimizer
    from megatron.core.transformer import TransformerConfig

    from megatron_edgc.patches.nonfinite_step import install_nonfinite_guard

    torch.manual_seed(0)
    dtype = torch.bfloat16 if bf16 else torch.float32
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)).to(dtype)
    tconf = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, bf16=bf16,
                              params_dtype=dtype)
    ddp = DistributedDataParallel(
        config=tconf, module=module,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                 use_distributed_optimizer=distopt))
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-2, clip_grad=clip, bf16=bf16, params_dtype=dtype,
        use_distributed_optimizer=distopt, weight_decay=0.1), [ddp])
    # megatron-core 0.16+ hands back a ChainedOptimizer of one; older ones the optimizer
    # itself: both forms are tested (the unchained one's step reaches clip_grad_norm)
    if not chained and isinstance(opt, ChainedOptimizer):
        assert len(opt.chained_optimizers) == 1
        opt = opt.chained_optimizers[0]
    if chained and not isinstance(opt, ChainedOptimizer):
        opt = ChainedOptimizer([opt])
    iteration = [0]
    lines = []
    guard = install_nonfinite_guard(opt, lambda: iteration[0], lines.append) if guarded \
        else None
    x = torch.randn(4, 8, dtype=dtype)

    def backward(poison: bool):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(x).float().square().sum().backward()
        ddp.finish_grad_sync()
        if poison:
            next(ddp.parameters()).main_grad.view(-1)[3] = float("nan")

    out = {"variant": name, "optimizer": type(opt).__name__}
    iteration[0] = 1
    backward(False)
    out["clean_ok"] = bool(opt.step()[0])
    before_params = [p.detach().clone() for p in ddp.parameters()]
    before = tensors_of(opt)
    iteration[0] = 2
    backward(True)
    ok, norm, _ = opt.step()
    after = tensors_of(opt)
    out.update(
        nan_ok=bool(ok), nan_norm=None if norm is None else float(norm),
        params_identical=all(torch.equal(a, p.detach())
                             for a, p in zip(before_params, ddp.parameters())),
        state_identical=before.keys() == after.keys()
        and all(torch.equal(before[k], after[k]) for k in before),
        state_tensors=len(before), lines=list(lines),
        skipped=list(guard.skipped) if guard else None,
        own_reads=guard.own_reads if guard else None)
    iteration[0] = 3
    backward(False)
    ok3, norm3, _ = opt.step()
    out.update(after_ok=bool(ok3), after_norm=None if norm3 is None else float(norm3),
               params_changed=not all(torch.equal(a, p.detach())
                                      for a, p in zip(before_params, ddp.parameters())),
               params_finite=all(bool(torch.isfinite(p).all()) for p in ddp.parameters()))
    if guard is not None:
        guard.uninstall()
        out["uninstalled"] = "step" not in vars(opt)
    return out


def main() -> int:
    from megatron.core import parallel_state

    from megatron_edgc.patches.cpu import apply_cpu_shims

    apply_cpu_shims(allow_untested=True)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    from megatron_edgc.patches.cpu import model_parallel_cpu_manual_seed

    model_parallel_cpu_manual_seed(0, 0)
    wanted = sys.argv[1:] or list(VARIANTS)
    for name in wanted:
        with redirect_stdout(io.StringIO()):   # megatron-core's own chatter
            result = run(name, *VARIANTS[name])
        print(json.dumps(result), flush=True)
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
