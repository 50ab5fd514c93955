"""Checkpoints: model, optimizer, LR schedule, data position and every rank's RNG states.

Layout (one directory per saved iteration)::

    <save>/iter_0000100/model_optim_tp00_pp000.pt   model chunks + optimizer + scheduler,
                                                     written by DP rank 0 of each (TP, PP)
    <save>/iter_0000100/rank_state_00003.pt          per-rank state: RNG, this rank's
                                                     distributed-optimizer shard, extensions
    <save>/iter_0000100/precision.txt                the run's precision (an unset
                                                     --bf16 resumes in it)
    <save>/latest_checkpointed_iteration.txt         written last

An iteration directory is written under a temporary name and renamed once every rank
has finished, and the ``latest`` pointer is updated after that, so a crash during a save
never leaves a loadable half-checkpoint. The data position is the iteration itself
(:class:`~megatron_edgc.training.data.MicroBatchStream` is addressed by iteration).

Extensions (the gradient compressor, the rank controller) register themselves with
:func:`~megatron_edgc.runtime.rank_state.register_rank_state` and are saved and restored
with every rank's state.

Resuming with a different DP size (same TP, PP, virtual stages, no distributed optimizer):
model, optimizer and schedule come from the (TP, PP) file as always; the per-rank state of
each stage is taken from the old DP rank 0 of that stage, where extensions that declared
themselves DP-invariant (the rank controller: identical on every replica) are restored
and the others (error-feedback residuals, warm starts: one per replica, nothing to map
them to) start fresh, with a warning.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from typing import Callable, Optional

import numpy
import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel

from megatron_edgc.runtime.rank_state import collect_rank_state, restore_rank_state
from megatron_edgc.training.checkpoint_files import (LATEST, iteration_dir, model_file_name,
                                                     rank_file_name)

logger = logging.getLogger(__name__)

#: the run's precision, beside the model files: an unset --bf16 resumes in it
PRECISION_FILE = "precision.txt"


class CheckpointError(RuntimeError):
    pass


def read_latest_iteration(root: str) -> Optional[int]:
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"--load: {path} does not hold an iteration number ({text[:40]!r})")
    return int(text)


def saved_precision(root: str) -> Optional[tuple]:
    """``(precision, where)`` of the latest checkpoint in ``root`` (``fp32``, ``bf16`` or
    ``fp16``), or None (no checkpoint, or one saved before it was recorded)."""
    iteration = read_latest_iteration(root)
    if iteration is None:
        return None
    path = os.path.join(iteration_dir(root, iteration), PRECISION_FILE)
    if not os.path.isfile(path):
        return None
    return open(path).read().strip(), f"{root}, iteration {iteration}"


def _layout_names(iteration_path: str) -> tuple[str, str]:
    tp = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_rank()
    ep = parallel_state.get_expert_model_parallel_rank()
    return (os.path.join(iteration_path, model_file_name(tp, pp, ep)),
            os.path.join(iteration_path, rank_file_name(dist.get_rank())))


def _inner_optimizers(optimizer) -> list:
    return [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]


def grad_scaler_states(optimizer) -> list:
    """fp16's loss scalers (scale, growth and hysteresis trackers), one per inner
    optimizer; None where there is none. The distributed optimizer's shard state does not
    carry them, and a resume across a scale change needs them with the residuals, whose
    units they are (docs/method.md)."""
    return [opt.grad_scaler.state_dict() if getattr(opt, "grad_scaler", None) else None
            for opt in getattr(optimizer, "chained_optimizers", [optimizer])]


def load_grad_scaler_states(optimizer, states) -> None:
    for opt, state in zip(getattr(optimizer, "chained_optimizers", [optimizer]), states or []):
        if state is not None and getattr(opt, "grad_scaler", None):
            opt.grad_scaler.load_state_dict(state)


def distributed_optimizer_shard_state(optimizer) -> list:
    """This DP rank's shard: the torch optimizer state and its fp32 main parameters.

    (megatron-core 0.16.1's gathered ``save/load_parameter_state`` drops torch Adam's
    per-parameter ``step`` and cannot be loaded back without apex/TE; the shard is exact.)
    """
    return [{"inner": inner.state_dict(),
             "main_params": [p.detach().clone() for g in inner.param_groups for p in g["params"]]}
            for inner in _inner_optimizers(optimizer)]


def load_distributed_optimizer_shard_state(optimizer, states: list) -> None:
    inners = _inner_optimizers(optimizer)
    if len(inners) != len(states):
        raise CheckpointError("--load: distributed-optimizer state does not match this model")
    for inner, state in zip(inners, states):
        inner.load_state_dict(state["inner"])
        params = [p for g in inner.param_groups for p in g["params"]]
        for p, saved in zip(params, state["main_params"], strict=True):
            p.copy_(saved)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": numpy.random.get_state(),
             "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    numpy.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if torch.cuda.is_available() and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


def _global_rank(tp: int, pp: int, dp: int, layout: dict) -> int:
    """megatron-core 0.16.1's default rank order "tp-cp-ep-dp-pp" (cp = ep = 1)."""
    return tp + layout["tp"] * (dp + layout["dp"] * pp)


def layout_of(cfg) -> dict:
    p = cfg.parallel
    return {"tp": p.tensor_model_parallel_size, "pp": p.pipeline_model_parallel_size,
            "dp": p.data_parallel_size, "vp": p.virtual_pipeline_model_parallel_size,
            "distributed_optimizer": p.use_distributed_optimizer,
            "ep": p.expert_model_parallel_size,
            "instances": p.num_distributed_optimizer_instances}


#: What a checkpoint saved before an entry was part of the layout held.
_LAYOUT_DEFAULTS = {"ep": 1, "instances": 1}
#: The flag that sets each entry of the layout, for the error of a changed one.
_LAYOUT_FLAGS = {"tp": "--tensor-model-parallel-size", "pp": "--pipeline-model-parallel-size",
                 "vp": "--virtual-pipeline-model-parallel-size",
                 "distributed_optimizer": "--use-distributed-optimizer",
                 "ep": "--expert-model-parallel-size",
                 "instances": "--num-distributed-optimizer-instances"}


def dp_size_changed(saved: Optional[dict], ours: dict) -> bool:
    """Whether a checkpoint saved on layout ``saved`` (:func:`layout_of`) resumes on
    ``ours`` with another DP size (True) or the same layout (False); any other change raises
    :class:`CheckpointError`. (The number of distributed-optimizer instances sets the size
    of each rank's optimizer shard and compressor state: it may not change either.)"""
    if saved is not None:
        saved = {**_LAYOUT_DEFAULTS, **saved}
    if saved == ours:
        return False
    if saved is None:
        raise CheckpointError(f"--load: the checkpoint records no layout, this run's is {ours}"
                              f" (only the DP size may change on resume)")
    changed = [k for k in [*ours, *(k for k in saved if k not in ours)]
               if k != "dp" and saved.get(k) != ours.get(k)]
    if changed:
        raise CheckpointError("--load: the checkpoint was saved with " + ", ".join(
            f"{_LAYOUT_FLAGS.get(k, k)} {saved.get(k)}" for k in changed) + ", this run has "
            + ", ".join(str(ours.get(k)) for k in changed)
            + " (only the DP size may change on resume)")
    if ours["distributed_optimizer"]:
        raise CheckpointError(f"--load: saved with DP {saved['dp']}, resuming with DP "
                              f"{ours['dp']}: distributed-optimizer shards cannot be remapped")
    return True


def _first_failed_rank(failed: bool) -> int:
    """Collective: the lowest global rank that reports a failure, or -1 (every rank then
    takes the same branch: nobody waits in a barrier for a rank that gave up)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    world = dist.get_world_size()
    flag = torch.tensor([world - dist.get_rank() if failed else 0], dtype=torch.int64,
                        device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return world - int(flag.item()) if int(flag.item()) else -1


class SaveFailed(CheckpointError):
    """A save that failed; ``secondary`` on the ranks that only learned of another's failure."""

    def __init__(self, message: str, secondary: bool):
        super().__init__(message)
        self.secondary = secondary


def save_checkpoint(root: str, iteration: int, bundle, cfg) -> str:
    """Collective: every rank calls it. Returns the final iteration directory.

    A failure on any rank (disk full, permissions, ...) is agreed on by all ranks; the
    partial ``.tmp`` directory is removed, the previous checkpoint and the ``latest``
    pointer are left as they were, and every rank raises :class:`SaveFailed` naming the
    failing rank, its error and the last complete checkpoint.
    """
    final = iteration_dir(root, iteration)
    tmp = final + ".tmp"
    cause = None

    def attempt(step: Callable[[], None]) -> int:
        nonlocal cause
        if cause is None:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 (reported, agreed on, re-raised below)
                cause = f"{type(exc).__name__}: {exc}"
        return _first_failed_rank(cause is not None)

    def prepare() -> None:
        if dist.get_rank() == 0:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)

    def write() -> None:
        model_file, rank_file = _layout_names(tmp)
        distributed_optimizer = cfg.parallel.use_distributed_optimizer
        # one writer per distinct model shard: DP rank 0, or with EP each EP rank's
        # expert-DP rank 0 (== DP rank 0 without EP)
        if parallel_state.get_expert_data_parallel_rank() == 0:
            torch.save({"iteration": iteration,
                        "model": [chunk.state_dict() for chunk in bundle.chunks],
                        "optimizer": None if distributed_optimizer
                        else bundle.optimizer.state_dict(),
                        "scheduler": bundle.scheduler.state_dict(),
                        "grad_scalers": grad_scaler_states(bundle.optimizer),
                        "layout": layout_of(cfg),
                        "config": cfg.to_dict()}, model_file)
        if dist.get_rank() == 0:   # read before the model is built (saved_precision)
            with open(os.path.join(tmp, PRECISION_FILE), "w") as fh:
                fh.write(cfg.precision + "\n")
        torch.save({"iteration": iteration, "rng": rng_state(), "layout": layout_of(cfg),
                    "coords": {"tp": parallel_state.get_tensor_model_parallel_rank(),
                               "pp": parallel_state.get_pipeline_model_parallel_rank(),
                               "dp": parallel_state.get_data_parallel_rank()},
                    "distributed_optimizer": distributed_optimizer_shard_state(bundle.optimizer)
                    if distributed_optimizer else None,
                    "extensions": collect_rank_state()},
                   rank_file)

    def publish() -> None:
        if dist.get_rank() == 0:
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(tmp, final)
            pointer = os.path.join(root, LATEST)
            with open(pointer + ".tmp", "w") as fh:
                fh.write(str(iteration))
            os.replace(pointer + ".tmp", pointer)

    for step in (prepare, write, publish):
        failed_rank = attempt(step)
        if failed_rank >= 0:
            break
    if failed_rank < 0:
        return final
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        last = read_latest_iteration(root)
    except CheckpointError:
        last = None
    kept = f"the last complete checkpoint is iteration {last} in {root}, intact" \
        if last is not None else f"no complete checkpoint in {root} yet"
    if cause is not None:
        raise SaveFailed(f"--save: saving iteration {iteration} failed on rank "
                         f"{dist.get_rank()}: {cause}; {kept}", secondary=False)
    raise SaveFailed(f"--save: saving iteration {iteration} failed on rank {failed_rank}; "
                     f"{kept}", secondary=True)


@torch.no_grad()
def load_checkpoint(root: str, bundle, cfg) -> int:
    """Collective. Restores everything and returns the iteration to continue from."""
    iteration = read_latest_iteration(root)
    if iteration is None:
        raise CheckpointError(f"--load: no {LATEST} in {root}")
    path = iteration_dir(root, iteration)
    model_file, rank_file = _layout_names(path)
    if not os.path.isfile(model_file):
        raise CheckpointError(f"--load: {model_file} is missing (saved with another TP/PP "
                              f"layout?)")
    try:
        state = torch.load(model_file, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"--load: {model_file} cannot be read: {exc}") from exc
    saved, ours = state.get("layout"), layout_of(cfg)
    dp_changed = dp_size_changed(saved, ours)
    if dp_changed:
        rank_file = os.path.join(path, rank_file_name(_global_rank(
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank(), 0, saved)))
    if not os.path.isfile(rank_file):
        raise CheckpointError(f"--load: {rank_file} is missing (saved with another layout?)")
    try:
        rank_state = torch.load(rank_file, map_location="cpu", weights_only=False)
    except Exception as exc:
        raise CheckpointError(f"--load: {rank_file} cannot be read: {exc}") from exc
    coords = rank_state.get("coords")
    if dp_changed and coords is not None and (
            coords["tp"], coords["pp"], coords["dp"]) != (
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_pipeline_model_parallel_rank(), 0):
        raise CheckpointError(f"--load: {rank_file} holds rank {coords}, not this stage's "
                              f"DP rank 0 (a rank order other than megatron-core's default?)")
    for chunk, sd in zip(bundle.chunks, state["model"]):
        chunk.load_state_dict(sd, strict=True)
    if cfg.parallel.use_distributed_optimizer:
        load_distributed_optimizer_shard_state(bundle.optimizer,
                                               rank_state["distributed_optimizer"])
    else:
        bundle.optimizer.load_state_dict(state["optimizer"])
    load_grad_scaler_states(bundle.optimizer, state.get("grad_scalers"))
    bundle.scheduler.load_state_dict(state["scheduler"])
    set_rng_state(rank_state["rng"])
    reset = restore_rank_state(rank_state["extensions"], dp_changed)
    if dp_changed and dist.get_rank() == 0:
        message = (f"warning: resuming iteration {iteration} saved with DP {saved['dp']} on DP "
                   f"{ours['dp']}: per-replica state reset ({', '.join(reset) or 'none'}); "
                   f"model, optimizer, schedule and DP-invariant state restored")
        logger.warning(message)
        print(message, flush=True)
    dist.barrier()
    return iteration
