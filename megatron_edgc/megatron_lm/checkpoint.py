"""EDGC's state in Megatron-LM checkpoints: a sidecar file per rank,
``iter_XXXXXXX/edgc/tp{T}_pp{P}_dp{D}.pt``, written before Megatron writes its own files
and the ``latest`` pointer (the wrapper of ``training.save_checkpoint``) and read back on
resume (of ``training.load_checkpoint``); docs/megatron-lm-seams.md §3."""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Optional

from megatron_edgc.megatron_lm.state import state as _state
from megatron_edgc.runtime.rank_state import collect_rank_state


def _sidecar(root: str, iteration: int, tp: int, pp: int, dp: int, cp: int = 0) -> str:
    """The file of one rank; with context parallelism its CP rank too (the CP ranks of one
    DP replica hold the same TP/PP/DP coordinates)."""
    from megatron.training.checkpointing import get_checkpoint_name

    base = get_checkpoint_name(root, iteration, return_base_dir=True)
    name = f"tp{tp:02d}_pp{pp:03d}_dp{dp:05d}" + (f"_cp{cp:03d}" if cp else "")
    return os.path.join(base, "edgc", name + ".pt")


def _coords() -> tuple:
    from megatron.core import mpu

    return (mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank(),
            mpu.get_data_parallel_rank(), mpu.get_context_parallel_rank())


#: Layout entries whose change keeps the DP-invariant state (the rank controller) and
#: resets the per-replica one (residuals, warm starts): the replicas are regrouped.
REPLICA_LAYOUT = ("dp", "ep")


def _layout(args) -> dict:
    return {"tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
            "dp": args.data_parallel_size, "vp": args.virtual_pipeline_model_parallel_size,
            "ep": getattr(args, "expert_model_parallel_size", 1),
            "cp": getattr(args, "context_parallel_size", 1)}


class _QuietAboutOurSidecars(logging.Filter):
    """Drops megatron-core's "Overwriting old incomplete / corrupted checkpoint" warning for
    an iteration directory that held nothing but the EDGC state written just before."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Overwriting old incomplete" not in record.getMessage()


def stop_if_weights_nonfinite(model, when: str) -> None:
    """Every rank exits 3 (rank 0 saying why) if any rank holds a non-finite weight: a run
    whose result is not finite does not exit 0, nor save it. A collective with one read
    (at a save and at the last iteration only)."""
    from megatron_edgc.runtime.frontend import NonFiniteWeights, check_weights_finite

    try:
        check_weights_finite(model, when)
    except NonFiniteWeights as exc:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(3)


def wrap_save_checkpoint(original):
    @functools.wraps(original)
    def save_checkpoint(iteration, model, *rest, **kwargs):
        if _state.guard is not None and not kwargs.get("non_persistent_ckpt", False):
            stop_if_weights_nonfinite(model, f"at the save of iteration {iteration}")
        if _state.runtime is None or kwargs.get("non_persistent_ckpt", False):
            return original(iteration, model, *rest, **kwargs)
        import torch
        # the records up to here are written, and the controller has seen every iteration
        # the checkpoint holds
        _state.records.flush()
        from megatron.training.global_vars import get_args

        args = get_args()
        path = _sidecar(args.save, iteration, *_coords())
        base = os.path.dirname(os.path.dirname(path))
        error = None
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            torch.save({"iteration": iteration, "coords": _coords(), "layout": _layout(args),
                        "extensions": collect_rank_state()}, path + ".tmp")
            os.replace(path + ".tmp", path)
        except OSError as exc:
            error = exc
        # Before the all-reduce no rank has begun Megatron's own files.
        quiet = _QuietAboutOurSidecars() if error is None and os.listdir(base) == ["edgc"] \
            else None
        _stop_if_any_rank_failed(error, iteration, args)
        logger = logging.getLogger("megatron.core.dist_checkpointing.serialization")
        if quiet is not None:
            logger.addFilter(quiet)
        try:
            return original(iteration, model, *rest, **kwargs)
        finally:
            if quiet is not None:
                logger.removeFilter(quiet)
    return save_checkpoint


def _stop_if_any_rank_failed(error: Optional[Exception], iteration: int, args) -> None:
    """All ranks agree whether every EDGC file was written (one all-reduce per save). If
    one was not, Megatron's files are never started: the job finishes any asynchronous save
    still in flight (so ``latest`` names the previous checkpoint, complete), the first
    failing rank says what failed, and every rank exits 2."""
    import torch
    import torch.distributed as dist

    from megatron_edgc.runtime.frontend import compute_device

    world = dist.get_world_size()
    first = torch.tensor([_global_rank() if error is not None else world],
                         device=compute_device())
    dist.all_reduce(first, op=dist.ReduceOp.MIN)
    first = int(first.item())  # once per save, not per step
    if first == world:
        return
    if getattr(args, "async_save", False):
        from megatron.training.async_utils import maybe_finalize_async_save

        maybe_finalize_async_save(blocking=True)
    if error is not None and _global_rank() == first:
        print(f"error: --save: saving iteration {iteration} failed on rank {first}: "
              f"{type(error).__name__}: {error}; {_last_complete(args.save)}",
              file=sys.stderr, flush=True)
    sys.exit(2)


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _last_complete(root: str) -> str:
    """Where the ``latest`` pointer stands: the checkpoint a restart resumes from."""
    from megatron.training.checkpointing import get_checkpoint_tracker_filename

    try:
        with open(get_checkpoint_tracker_filename(root)) as fh:
            return f"the last complete checkpoint is iteration {fh.read().strip()} in {root}, " \
                   f"intact"
    except OSError:
        return f"no complete checkpoint in {root} yet"


def wrap_load_checkpoint(original):
    @functools.wraps(original)
    def load_checkpoint(*args_, **kwargs):
        out = original(*args_, **kwargs)
        iteration = out[0] if isinstance(out, tuple) else out
        if not _state.compression_on() or not iteration:
            return out
        import torch
        from megatron.training.global_vars import get_args
        from megatron.training.utils import print_rank_0

        args = get_args()
        if args.finetune:
            return out
        root = getattr(args, kwargs.get("load_arg", "load"))
        tp, pp, dp, cp = _coords()
        # Our replica's file; a rank beyond the saved DP size reads replica 0's.
        first = _sidecar(root, iteration, tp, pp, 0, cp)
        path = _sidecar(root, iteration, tp, pp, dp, cp)
        path = path if os.path.isfile(path) else first
        if not os.path.isfile(path):
            print_rank_0(f"warning: EDGC: no compressor state in {os.path.dirname(path)} "
                         f"(saved without megatron_edgc?): compression starts fresh")
            return out
        state = torch.load(path, map_location="cpu", weights_only=False)
        ours = _layout(args)
        saved = {"ep": 1, "cp": 1, **state["layout"]}   # files from before EP/CP were kept
        if {k: v for k, v in saved.items() if k not in REPLICA_LAYOUT} != \
                {k: v for k, v in ours.items() if k not in REPLICA_LAYOUT}:
            print_rank_0(f"warning: EDGC: compressor state saved with layout {saved}, resumed "
                         f"with {ours}: compression starts fresh")
            return out
        changed = [k.upper() for k in REPLICA_LAYOUT if saved[k] != ours[k]]
        if changed and path != first:
            state = torch.load(first, map_location="cpu", weights_only=False)
        _state.stashed = (state["extensions"], changed)
        return out
    return load_checkpoint
