"""EDGC in an unmodified Megatron-LM job: two lines in its ``pretrain_gpt.py``.

    import megatron_edgc.megatron_lm as edgc          # 1: before pretrain(...)
    edgc.enable()
    pretrain(..., extra_args_provider=edgc.add_args)  # 2: the --edgc-* flags

``add_args`` registers every ``--edgc-*`` flag of this project's trainer (same names,
defaults, ranges and errors); ``enable`` wraps five seams of ``megatron.training``, each
looked up by name when ``pretrain`` calls it (docs/megatron-lm-seams.md says why these):

* ``initialize.validate_args``: the EDGC flags are checked after Megatron's own checks and
  before any process group exists; a bad value prints ``error: --edgc-…: …`` and exits 2;
* ``training.setup_model_and_optimizer``: after Megatron built the DDP chunks (and loaded a
  checkpoint) the EDGC runtime (:class:`~megatron_edgc.runtime.step.EdgcRuntime`,
  the one this project's trainer uses) is built on them;
* ``training.train_step``: the runtime runs around each step — ranks in force before the
  forward/backward, the compressing PP communicator passed to the schedule, the telemetry
  all-reduce and the controller's decision after the optimizer step; scalars go to
  Megatron-LM's TensorBoard writer (tags ``edgc/*``) and ``--edgc-metrics-file``;
* ``training.save_checkpoint`` / ``training.load_checkpoint``: every rank writes its
  compressor and controller state to ``iter_XXXXXXX/edgc/tp{T}_pp{P}_dp{D}.pt`` before
  Megatron writes its own files and the ``latest`` pointer, and reads it back on resume.

With ``--edgc-mode off`` and ``--edgc-pp-compression off`` every wrapper passes through.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import logging
import os
import sys
from typing import Optional

from megatron_edgc.config import (ConfigError, EdgcConfig, RunConfig, _check_ranges,
                                  add_knob_argument, check_writable, flag_of)

#: Megatron-LM tags whose ``megatron/training`` these seams were read from and tested on.
TESTED_MEGATRON_LM = ("core_v0.16.1", "core_v0.19.0")

#: Checkpoint formats whose iteration directory and ``latest`` pointer the EDGC state
#: follows (docs/megatron-lm-seams.md §3); ``--async-save`` included.
CKPT_FORMATS = ("torch", "torch_dist")

#: The seams and the parameters each wrapper relies on (checked in :func:`enable`).
#: ``validate_args`` is wrapped where Megatron-LM calls it from: ``arguments`` (core_v0.19+:
#: ``parse_and_validate_args``) and, where it imports the name, ``initialize`` (core_v0.13.1
#: ... core_v0.16.1: ``initialize_megatron``); see :data:`_OPTIONAL_SEAMS`.
_SEAMS = {
    ("megatron.training.arguments", "validate_args"): ("args",),
    ("megatron.training.training", "setup_model_and_optimizer"):
        ("model_provider_func", "model_type"),
    # core_v0.13.1 has no forward_backward_func parameter (train_step gets the schedule from
    # get_forward_backward_func itself) and no iteration (args.curr_iteration has it);
    # core_v0.19+ add pg_collection and p2p_communicator, which the wrapper overrides.
    ("megatron.training.training", "train_step"):
        ("forward_step_func", "data_iterator", "model", "optimizer", "opt_param_scheduler",
         "config"),
    ("megatron.training.training", "save_checkpoint"): ("iteration", "model"),
    ("megatron.training.training", "load_checkpoint"): ("ddp_model",),
    ("megatron.training.checkpointing", "get_checkpoint_name"):
        ("checkpoints_path", "iteration", "return_base_dir"),
}

#: Seams wrapped only where the module has the name.
_OPTIONAL_SEAMS = {("megatron.training.initialize", "validate_args")}


class _State:
    def __init__(self):
        self.cfg: Optional[RunConfig] = None    # validated from the --edgc-* flags
        self.runtime = None                     # EdgcRuntime, when compression is on
        self.metrics = None                     # [JSONL writer, TensorBoard writer]
        self.stashed: Optional[tuple] = None    # (extensions, dp_changed) read at load
        self.originals: dict = {}               # (module, name) -> the wrapped function


_state = _State()


# ---------------------------------------------------------------------------- flags


def add_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM's ``extra_args_provider``: the ``--edgc-*`` flags; returns the parser."""
    group = parser.add_argument_group("EDGC", "entropy-driven gradient compression "
                                              "(megatron_edgc)")
    for f in dataclasses.fields(EdgcConfig):
        add_knob_argument(group, flag_of(f.name, EdgcConfig), f, dest=f"edgc_{f.name}",
                          default=f.default)
    group.add_argument("--edgc-metrics-file", default=None,
                       help="JSONL file, one EDGC record per iteration (logging rank)")
    group.add_argument("--edgc-allow-untested-megatron", action="store_true",
                       help="run on a megatron-core version the patches were not tested with")
    return parser


def chain(*providers):
    """Several ``extra_args_provider``s as one (e.g. ``chain(add_modelopt_args, add_args)``)."""
    def provider(parser):
        for p in providers:
            if p is not None:
                parser = p(parser)
        return parser
    return provider


def run_config(args) -> RunConfig:
    """A validated :class:`RunConfig` from Megatron-LM's ``args`` (the ``--edgc-*`` flags
    and the model/parallel/training values EDGC reads). Raises :class:`ConfigError`."""
    if not hasattr(args, "edgc_mode"):
        raise ConfigError("--edgc-mode", "the EDGC flags are not registered: pass "
                                         "extra_args_provider=megatron_edgc.megatron_lm.add_args"
                                         " to pretrain(...)")
    cfg = RunConfig(allow_untested_megatron=args.edgc_allow_untested_megatron)
    for f in dataclasses.fields(EdgcConfig):
        setattr(cfg.edgc, f.name, getattr(args, f"edgc_{f.name}"))
    _check_ranges(cfg.edgc)
    cfg.edgc.resolve()
    m, p, t = cfg.model, cfg.parallel, cfg.training
    m.num_layers, m.hidden_size = args.num_layers, args.hidden_size
    m.num_attention_heads, m.ffn_hidden_size = args.num_attention_heads, args.ffn_hidden_size
    m.seq_length, m.max_position_embeddings = args.seq_length, args.max_position_embeddings
    p.tensor_model_parallel_size = args.tensor_model_parallel_size
    p.pipeline_model_parallel_size = args.pipeline_model_parallel_size
    p.data_parallel_size = args.data_parallel_size
    p.virtual_pipeline_model_parallel_size = args.virtual_pipeline_model_parallel_size
    p.overlap_grad_reduce = args.overlap_grad_reduce
    p.use_distributed_optimizer = args.use_distributed_optimizer
    t.micro_batch_size, t.global_batch_size = args.micro_batch_size, args.global_batch_size
    t.train_iters = args.train_iters or (args.train_samples or 0) // args.global_batch_size
    t.seed = args.seed
    e = cfg.edgc
    if e.mode == "off" and e.pp_compression == "off":
        return cfg
    if e.pp_compression != "off" and p.pipeline_model_parallel_size < 2:
        raise ConfigError("--edgc-pp-compression", f"compresses pipeline sends: needs "
                                                   f"--pipeline-model-parallel-size >= 2, got "
                                                   f"{p.pipeline_model_parallel_size}")
    _refuse_unsupported(args)
    e.check_layout(p)
    if args.edgc_metrics_file:
        check_writable("--edgc-metrics-file", args.edgc_metrics_file, is_file=True)
    return cfg


def _refuse_unsupported(args) -> None:
    """Megatron-LM features the EDGC seams do not cover, each named by its flag."""
    def refuse(flag: str, why: str):
        raise ConfigError(flag, f"not supported with EDGC compression on ({why})")

    if getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False):
        refuse("--use-torch-fsdp2/--use-megatron-fsdp", "the patch compresses DDP's buckets")
    if getattr(args, "num_experts", None):
        refuse("--num-experts", "expert-parallel buckets are not compressed")
    if getattr(args, "context_parallel_size", 1) > 1:
        refuse("--context-parallel-size", "the DP group would include CP")
    if getattr(args, "num_distributed_optimizer_instances", 1) > 1:
        refuse("--num-distributed-optimizer-instances", "one DP group per bucket is assumed")
    if getattr(args, "non_persistent_save_interval", None):
        refuse("--non-persistent-save-interval", "EDGC state is saved with persistent "
                                                 "checkpoints only")
    if (args.save or args.load) and getattr(args, "ckpt_format", "torch") not in CKPT_FORMATS:
        refuse("--ckpt-format", f"{args.ckpt_format}; use --ckpt-format "
                                f"{' or '.join(CKPT_FORMATS)}")
    if getattr(args, "cuda_graph_impl", "none") not in ("none", None):
        refuse("--cuda-graph-impl", "graphs would skip the per-step hooks")
    if args.edgc_pp_compression != "off" and getattr(args, "rampup_batch_size", None):
        refuse("--rampup-batch-size", "PP compression fixes the micro-batch count")


# ---------------------------------------------------------------------------- wrappers


def _fail(exc: Exception) -> None:
    print(f"error: {exc}", file=sys.stderr, flush=True)
    sys.exit(2)


def _validate_args(original):
    @functools.wraps(original)
    def validate_args(args, *rest, **kwargs):
        out = original(args, *rest, **kwargs)
        try:
            _state.cfg = run_config(args)
            from megatron_edgc.patches.cpu import check_megatron_version

            check_megatron_version(_state.cfg.allow_untested_megatron)
        except Exception as exc:  # ConfigError, UnsupportedMegatronVersion
            _fail(exc)
        return out
    return validate_args


def _compression_on() -> bool:
    cfg = _state.cfg
    return cfg is not None and (cfg.edgc.mode != "off" or cfg.edgc.pp_compression != "off")


def _setup_model_and_optimizer(original):
    @functools.wraps(original)
    def setup_model_and_optimizer(*args, **kwargs):
        model, optimizer, scheduler = original(*args, **kwargs)
        if _compression_on():
            _build_runtime(model, optimizer, scheduler)
        return model, optimizer, scheduler
    return setup_model_and_optimizer


def _build_runtime(model, optimizer, scheduler) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import mpu
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.utils import get_model_config
    from megatron.training.global_vars import get_args, get_tensorboard_writer
    from megatron.training.utils import print_rank_0

    from megatron_edgc.runtime.rank_state import restore_rank_state
    from megatron_edgc.runtime.step import EdgcRuntime
    from megatron_edgc.runtime.telemetry import MetricsWriter

    args, cfg = get_args(), _state.cfg
    # The compressibility check from the real parameter shapes of every stage.
    shapes = [tuple(p.shape) for chunk in model for p in chunk.module.parameters()]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, shapes)
    try:
        cfg._check_compression_ranks(shapes=[s for rank in gathered for s in rank])
    except ConfigError as exc:
        if dist.get_rank() == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")

    def lr_at(step: int) -> float:
        """The LR Megatron-LM's scheduler gives at ``step`` (it counts samples)."""
        now = scheduler.num_steps
        try:
            scheduler.num_steps = step * args.global_batch_size
            return float(scheduler.get_lr(scheduler.optimizer.param_groups[0]))
        finally:
            scheduler.num_steps = now

    runtime = EdgcRuntime(
        cfg, model, get_model_config(model[0]), dp_group=mpu.get_data_parallel_group(),
        pp_group=mpu.get_pipeline_model_parallel_group(),
        stage=mpu.get_pipeline_model_parallel_rank(),
        num_stages=args.pipeline_model_parallel_size,
        num_microbatches=get_num_microbatches(),
        activation_shape=(args.seq_length, args.micro_batch_size, args.hidden_size),
        device=device, lr_at=lr_at, optimizer=optimizer)
    if _state.stashed is not None:
        saved, dp_changed = _state.stashed
        reset = restore_rank_state(saved, dp_changed)
        if reset:
            print_rank_0(f"EDGC: resumed on another DP size; per-replica state reset "
                         f"({', '.join(reset)})")
        _state.stashed = None
    _state.runtime = runtime
    is_logger = (mpu.is_pipeline_last_stage(ignore_virtual=True)
                 and mpu.get_data_parallel_rank() == 0
                 and mpu.get_tensor_model_parallel_rank() == 0)
    # The JSONL file on the logging rank; the scalars wherever Megatron-LM keeps its
    # TensorBoard writer (the last rank). The records are job-wide after the all-reduce.
    tb = get_tensorboard_writer()
    _state.metrics = [MetricsWriter(args.edgc_metrics_file, None, is_logger,
                                    resume_from=args.iteration),
                      MetricsWriter(None, None, tb is not None, tb_writer=tb, tb_prefix="edgc/")]
    for note in cfg.compression_notes:
        print_rank_0(note)


def _train_step(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def train_step(*args_, **kwargs):
        runtime = _state.runtime
        if runtime is None:
            return original(*args_, **kwargs)
        from megatron.training import training
        from megatron.training.global_vars import get_args

        args = get_args()
        bound = signature.bind(*args_, **kwargs)
        call = bound.arguments
        iteration = call.get("iteration")
        if iteration is None:
            iteration = args.curr_iteration
        config = call["config"]
        finalize = config.finalize_model_grads_func
        if finalize is not None and not getattr(finalize, "__edgc_timed__", False):
            # train() (re)sets it before the loop: stamp when gradients are ready.
            timed = runtime.timed_finalize(finalize)
            timed.__edgc_timed__ = True
            config.finalize_model_grads_func = timed
        runtime.begin_step(iteration)

        def with_edgc(forward_backward_func):
            def forward_backward(*fb_args, **fb_kwargs):
                runtime.begin_schedule()  # again on a rerun of the step
                fb_kwargs.update(runtime.schedule_kwargs())
                return forward_backward_func(*fb_args, **fb_kwargs)
            return forward_backward

        if "forward_backward_func" in signature.parameters:
            call["forward_backward_func"] = with_edgc(call["forward_backward_func"])
            out = original(*bound.args, **bound.kwargs)
        else:  # core_v0.13.1: train_step asks get_forward_backward_func() for the schedule
            get_schedule = training.get_forward_backward_func
            training.get_forward_backward_func = lambda *a, **k: with_edgc(get_schedule(*a, **k))
            try:
                out = original(*bound.args, **bound.kwargs)
            finally:
                training.get_forward_backward_func = get_schedule
        loss_dict, skipped, should_exit, grad_norm = out[0], out[1], out[3], out[5]
        if should_exit:
            return out
        optimizer, scheduler = call["optimizer"], call["opt_param_scheduler"]
        record = {"iteration": iteration + 1,
                  "loss": float(loss_dict["lm loss"]) if "lm loss" in loss_dict
                  else float("nan"),
                  "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                  "lr": float(scheduler.get_lr(optimizer.param_groups[0])),
                  "skipped": bool(skipped)}
        runtime.end_step(iteration, record)
        for writer in _state.metrics:
            writer.write(record)
        if (iteration + 1) % args.log_interval == 0:
            _log_line(record)
        return out
    return train_step


def _log_line(rec: dict) -> None:
    from megatron.training.utils import print_rank_last

    ranks = rec.get("rank_dp")
    saved = 1.0 - rec["dp_bytes_sent_job"] / rec["dp_bytes_dense_job"] \
        if rec.get("dp_bytes_dense_job") else 0.0
    parts = [f"EDGC iteration {rec['iteration']}",
             f"rank dp {ranks if ranks is not None else 'dense'}",
             f"dp {rec['dp_bytes_sent_job'] / 2 ** 20:.2f} MiB (saved {100 * saved:.1f} %)"]
    if "rank_pp" in rec:
        parts.append(f"rank pp {rec['rank_pp']}")
    if "pp_bytes_sent_job" in rec:
        parts.append(f"pp {rec['pp_bytes_sent_job'] / 2 ** 20:.2f} MiB")
    print_rank_last(" | ".join(parts))


# ---------------------------------------------------------------------------- checkpoints


def _sidecar(root: str, iteration: int, tp: int, pp: int, dp: int) -> str:
    from megatron.training.checkpointing import get_checkpoint_name

    base = get_checkpoint_name(root, iteration, return_base_dir=True)
    return os.path.join(base, "edgc", f"tp{tp:02d}_pp{pp:03d}_dp{dp:05d}.pt")


def _coords() -> tuple:
    from megatron.core import mpu

    return (mpu.get_tensor_model_parallel_rank(), mpu.get_pipeline_model_parallel_rank(),
            mpu.get_data_parallel_rank())


def _layout(args) -> dict:
    return {"tp": args.tensor_model_parallel_size, "pp": args.pipeline_model_parallel_size,
            "dp": args.data_parallel_size, "vp": args.virtual_pipeline_model_parallel_size}


class _QuietAboutOurSidecars(logging.Filter):
    """Drops megatron-core's "Overwriting old incomplete / corrupted checkpoint" warning for
    an iteration directory that held nothing but the EDGC state written just before."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Overwriting old incomplete" not in record.getMessage()


def _save_checkpoint(original):
    @functools.wraps(original)
    def save_checkpoint(iteration, model, *rest, **kwargs):
        if _state.runtime is None or kwargs.get("non_persistent_ckpt", False):
            return original(iteration, model, *rest, **kwargs)
        import torch
        from megatron.training.global_vars import get_args

        from megatron_edgc.runtime.rank_state import collect_rank_state

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

    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    first = torch.tensor([_global_rank() if error is not None else world], device=device)
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


def _load_checkpoint(original):
    @functools.wraps(original)
    def load_checkpoint(*args_, **kwargs):
        out = original(*args_, **kwargs)
        iteration = out[0] if isinstance(out, tuple) else out
        if not _compression_on() or not iteration:
            return out
        import torch
        from megatron.training.global_vars import get_args
        from megatron.training.utils import print_rank_0

        args = get_args()
        if args.finetune:
            return out
        root = getattr(args, kwargs.get("load_arg", "load"))
        tp, pp, dp = _coords()
        # Our replica's file; a rank beyond the saved DP size reads replica 0's.
        first = _sidecar(root, iteration, tp, pp, 0)
        path = _sidecar(root, iteration, tp, pp, dp)
        path = path if os.path.isfile(path) else first
        if not os.path.isfile(path):
            print_rank_0(f"warning: EDGC: no compressor state in {os.path.dirname(path)} "
                         f"(saved without megatron_edgc?): compression starts fresh")
            return out
        state = torch.load(path, map_location="cpu", weights_only=False)
        saved, ours = state["layout"], _layout(args)
        if {k: v for k, v in saved.items() if k != "dp"} != \
                {k: v for k, v in ours.items() if k != "dp"}:
            print_rank_0(f"warning: EDGC: compressor state saved with layout {saved}, resumed "
                         f"with {ours}: compression starts fresh")
            return out
        dp_changed = saved["dp"] != ours["dp"]
        if dp_changed and path != first:
            state = torch.load(first, map_location="cpu", weights_only=False)
        _state.stashed = (state["extensions"], dp_changed)
        return out
    return load_checkpoint


# ---------------------------------------------------------------------------- enable


_WRAPPERS = {
    ("megatron.training.arguments", "validate_args"): _validate_args,
    ("megatron.training.initialize", "validate_args"): _validate_args,
    ("megatron.training.training", "setup_model_and_optimizer"): _setup_model_and_optimizer,
    ("megatron.training.training", "train_step"): _train_step,
    ("megatron.training.training", "save_checkpoint"): _save_checkpoint,
    ("megatron.training.training", "load_checkpoint"): _load_checkpoint,
}


class MissingSeam(RuntimeError):
    """The Megatron-LM in use lacks a function (or parameter) the plug-in wraps."""


def check_seams() -> None:
    """Every seam exists with the parameters the wrappers rely on; else one line naming
    what is missing."""
    import importlib

    for (module_name, name), params in _SEAMS.items():
        module = importlib.import_module(module_name)
        fn = getattr(module, name, None)
        fn = getattr(fn, "__wrapped__", fn)
        if fn is None:
            raise MissingSeam(f"Megatron-LM's {module_name}.{name} is missing (megatron_edgc "
                              f"wraps it; tested with Megatron-LM {', '.join(TESTED_MEGATRON_LM)})")
        have = inspect.signature(fn).parameters
        missing = [p for p in params if p not in have]
        if missing:
            raise MissingSeam(f"Megatron-LM's {module_name}.{name} has no parameter "
                              f"{', '.join(missing)} (tested with Megatron-LM "
                              f"{', '.join(TESTED_MEGATRON_LM)})")


def enable() -> None:
    """Install the wrappers (idempotent). Call before ``pretrain(...)``."""
    import importlib

    check_seams()
    for (module_name, name), wrap in _WRAPPERS.items():
        module = importlib.import_module(module_name)
        current = getattr(module, name, None)
        if current is None and (module_name, name) in _OPTIONAL_SEAMS:
            continue
        if getattr(current, "__edgc_wrapped__", False):
            continue
        wrapped = wrap(current)
        wrapped.__edgc_wrapped__ = True
        _state.originals[(module_name, name)] = current
        setattr(module, name, wrapped)


def disable() -> None:
    """Restore the originals and drop the runtime (in-process tests)."""
    import importlib

    for (module_name, name), original in _state.originals.items():
        setattr(importlib.import_module(module_name), name, original)
    _state.originals.clear()
    if _state.runtime is not None:
        _state.runtime.close()
    for writer in _state.metrics or []:
        writer.close()
    _state.cfg = _state.runtime = _state.metrics = _state.stashed = None

