"""The wrappers of Megatron-LM's ``megatron.training`` functions (the seams), and
:func:`enable` / :func:`disable`, which install and remove them.

Each seam is looked up by name when ``pretrain`` calls it (docs/megatron-lm-seams.md says
why these): ``validate_args`` checks the ``--edgc-*`` flags before any process group
exists; ``setup_model_and_optimizer`` builds the EDGC runtime
(:class:`~megatron_edgc.runtime.step.EdgcRuntime`, the one this project's trainer uses) on
Megatron's DDP chunks; ``train_step`` runs it around each step, its scalars going to
Megatron-LM's TensorBoard writer (tags ``edgc/*``) and ``--edgc-metrics-file``;
``save_checkpoint`` / ``load_checkpoint`` write and read EDGC's sidecar
(:mod:`megatron_edgc.megatron_lm.checkpoint`). The per-iteration records are the trainer's
(:class:`~megatron_edgc.runtime.frontend.IterationRecords`), read from the device and
written at Megatron-LM's ``--log-interval``, before a checkpoint and at the last iteration.
"""

from __future__ import annotations

import functools
import inspect
import sys

from megatron_edgc.config import ConfigError, validate_edgc
from megatron_edgc.megatron_lm.checkpoint import (stop_if_weights_nonfinite, wrap_load_checkpoint,
                                                   wrap_save_checkpoint)
from megatron_edgc.megatron_lm.flags import run_config
from megatron_edgc.megatron_lm.state import state as _state
from megatron_edgc.runtime.telemetry import expert_split, format_ranks, link_line, slow_hop

#: Megatron-LM tags whose ``megatron/training`` these seams were read from and tested on.
TESTED_MEGATRON_LM = ("core_v0.16.1", "core_v0.19.0")

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


# ---------------------------------------------------------------------------- wrappers


def _fail(exc: Exception) -> None:
    print(f"error: {exc}", file=sys.stderr, flush=True)
    sys.exit(2)


def _validate_args(original):
    @functools.wraps(original)
    def validate_args(args, *rest, **kwargs):
        out = original(args, *rest, **kwargs)
        try:
            from megatron_edgc.megatron_lm.cpu_shims import megatron_fsdp_on_cpu

            megatron_fsdp_on_cpu(args)   # --use-megatron-fsdp without CUDA, any --edgc-mode
            _state.cfg = run_config(args)
            _fp16_grads_in_fp32(args, _state.cfg)
            from megatron_edgc.patches.cpu import check_megatron_version

            check_megatron_version(_state.cfg.allow_untested_megatron)
        except Exception as exc:  # ConfigError, UnsupportedMegatronVersion
            _fail(exc)
        return out
    return validate_args


def _fp16_grads_in_fp32(args, cfg) -> None:
    """``--fp16`` with DP compression: the gradients kept and reduced in fp32
    (``--accumulate-allreduce-grads-in-fp32``), as the trainer does by default: a
    compressed result written into fp16 buffers overflows where the dense sum does not,
    and every skip that follows gives back a larger message (docs/method.md)."""
    if args.fp16 and cfg.edgc.mode != "off" and not args.accumulate_allreduce_grads_in_fp32:
        args.accumulate_allreduce_grads_in_fp32 = True
        if getattr(args, "rank", 0) == 0:
            print("EDGC: --fp16 with DP compression: gradients accumulated and reduced in "
                  "fp32 (--accumulate-allreduce-grads-in-fp32)", flush=True)


def _setup_model_and_optimizer(original):
    @functools.wraps(original)
    def setup_model_and_optimizer(*args, **kwargs):
        model, optimizer, scheduler = original(*args, **kwargs)
        _guard(optimizer)   # any run of ours, --edgc-mode off too
        if _state.compression_on():
            _build_runtime(model, optimizer, scheduler)
            from megatron_edgc.runtime import lost_ranks

            # torchrun: an exception that ends this rank (a collective fails in train_step,
            # Megatron-LM's logging or a save) names a rank lost without an error of its own
            lost_ranks.watch(uncaught=True)
        return model, optimizer, scheduler
    return setup_model_and_optimizer


def _guard(optimizer) -> None:
    """The non-finite step guard on Megatron-LM's optimizer
    (:mod:`megatron_edgc.patches.nonfinite_step`): a step whose reduced gradient is not
    finite returns ``update_successful=False``, which ``train_step`` counts as a skipped
    iteration (``skipped_iter``; its LR step is not taken)."""
    from megatron.training.global_vars import get_args

    from megatron_edgc.runtime.frontend import guard_optimizer

    _state.guard = guard_optimizer(optimizer, lambda: get_args().curr_iteration + 1)
    _state.first_iteration = None


def _end_of_step(out, call: dict) -> None:
    """After ``train_step`` (``call``: its arguments): at the last iteration, the weights
    checked (a run whose weights are not finite does not exit 0) and the guard's count
    said."""
    from megatron.training.global_vars import get_args

    args = get_args()
    iteration = call.get("iteration")
    if iteration is None:
        iteration = args.curr_iteration
    if _state.first_iteration is None:
        _state.first_iteration = iteration
    _state.skipped += bool(out[1])   # Megatron-LM's skipped_iter: the guard's or the scaler's
    if out[3] or iteration + 1 != args.train_iters:   # should_exit, or not the last
        return
    stop_if_weights_nonfinite(call["model"], f"at the end (iteration {iteration + 1})")
    guard = _state.guard
    if guard is not None:
        from megatron_edgc.runtime.frontend import log_rank0

        from megatron_edgc.runtime.step import CompressionTally

        from megatron_edgc.runtime.step import has_loss_scaler

        done = iteration + 1 - _state.first_iteration
        which = f" ({', '.join(map(str, guard.skipped))})" if guard.skipped else ""
        runtime, optimizer = _state.runtime, call.get("optimizer")
        scaler = ""
        if has_loss_scaler(optimizer):   # fp16: the skips of Megatron's own loss scaler
            scaler = f" | {_state.skipped - len(guard.skipped)} skipped by the loss scaler"
            if runtime is not None and runtime.loss_scale_changes is not None:
                scaler += (f" | {int(runtime.loss_scale_changes)} loss-scale changes (now "
                           f"{float(optimizer.get_loss_scale()):g})")
        compressed = f" | {CompressionTally.line(runtime.tally.summary())}" \
            if runtime is not None and runtime.dp_compression is not None else ""
        log_rank0(f"EDGC summary | {done} iterations | {len(guard.skipped)} skipped for a "
                  f"non-finite gradient{which}{scaler}{compressed} | {ran_words(runtime)}")


def ran_words(runtime) -> str:
    """Whether EDGC ran, for the summary line: ``EDGC ran (DP edgc, PP off)``, or ``EDGC did
    not run (--edgc-mode off, --edgc-pp-compression off: dense)``."""
    e = _state.cfg.edgc if _state.cfg is not None else None
    if runtime is None or e is None:
        return ("EDGC did not run (--edgc-mode off, --edgc-pp-compression off: dense)"
                if e is not None else "EDGC did not run (the --edgc-* flags were never read)")
    return f"EDGC ran (DP {e.mode}, PP {e.pp_compression})"


def _build_runtime(model, optimizer, scheduler) -> None:
    import torch.distributed as dist
    from megatron.core import mpu
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.utils import get_model_config
    from megatron.training.global_vars import get_args, get_tensorboard_writer

    from megatron_edgc.runtime.frontend import (IterationRecords, compute_device,
                                                is_logging_rank, log_rank0, lr_at, print_notes)
    from megatron_edgc.runtime.rank_state import restore_rank_state
    from megatron_edgc.runtime.step import EdgcRuntime
    from megatron_edgc.runtime.telemetry import MetricsWriter

    args, cfg = get_args(), _state.cfg
    # The compressibility check from the real parameter shapes of every stage.
    shapes = [tuple(p.shape) for chunk in model for p in chunk.module.parameters()]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, shapes)
    try:
        validate_edgc(cfg, shapes=[s for rank in gathered for s in rank])
    except ConfigError as exc:
        if dist.get_rank() == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    device = compute_device()
    runtime = EdgcRuntime(
        cfg, model, get_model_config(model[0]), dp_group=mpu.get_data_parallel_group(),
        pp_group=mpu.get_pipeline_model_parallel_group(),
        stage=mpu.get_pipeline_model_parallel_rank(),
        num_stages=args.pipeline_model_parallel_size,
        num_microbatches=get_num_microbatches(),
        activation_shape=(args.seq_length, args.micro_batch_size, args.hidden_size),
        device=device, optimizer=optimizer,
        # Megatron-LM's scheduler counts samples
        lr_at=functools.partial(lr_at, scheduler, samples_per_step=args.global_batch_size,
                                param_group=scheduler.optimizer.param_groups[0]))
    if _state.stashed is not None:
        saved, changed = _state.stashed
        reset = restore_rank_state(saved, bool(changed))
        if reset:
            log_rank0(f"EDGC: resumed on another {'/'.join(changed)} size; per-replica "
                         f"state reset ({', '.join(reset)})")
        _state.stashed = None
    _state.runtime = runtime
    # The JSONL file on the logging rank; the scalars wherever Megatron-LM keeps its
    # TensorBoard writer (the last rank). The records are job-wide after the all-reduce.
    tb = get_tensorboard_writer()
    _state.records = IterationRecords(
        [MetricsWriter(args.edgc_metrics_file, None, is_logging_rank(),
                       resume_from=args.iteration),
         MetricsWriter(None, None, tb is not None, tb_writer=tb, tb_prefix="edgc/")],
        runtime, use_cuda=device.type == "cuda")
    print_notes(cfg)


def _train_step(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def train_step(*args_, **kwargs):
        _state.stepping = True   # the loop is Megatron-LM's (loop_check)
        try:
            out = edgc_step(*args_, **kwargs)
        finally:
            _state.stepping = False
        _end_of_step(out, signature.bind(*args_, **kwargs).arguments)
        return out

    def edgc_step(*args_, **kwargs):
        runtime = _state.runtime
        if runtime is None:
            return original(*args_, **kwargs)
        from megatron.core.num_microbatches_calculator import get_current_global_batch_size
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
        records = _state.records
        records.begin()
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
        # the runtime's end_step (the controller decides) runs inside, before the end stamp
        records.end(
            iteration + 1, loss=_device_value(loss_dict.get("lm loss", float("nan"))),
            lr=float(scheduler.get_lr(optimizer.param_groups[0])),
            grad_norm=_device_value(grad_norm), skipped=bool(skipped),
            tokens=get_current_global_batch_size() * args.seq_length)
        logs = (iteration + 1) % args.log_interval == 0
        if logs or iteration + 1 == args.train_iters:   # the only host waits for the device
            done = records.flush()
            if logs:
                _log_line(done[-1])
        return out
    return train_step


def _device_value(value):
    """A loss or norm as Megatron-LM hands it: a tensor stays on the device (read at the
    flush), anything else becomes a float (None: NaN)."""
    import torch

    if value is None:
        return float("nan")
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.detach()
    return float(value)


def _log_line(rec: dict) -> None:
    from megatron.training.utils import print_rank_last

    saved = 1.0 - rec["dp_bytes_sent_job"] / rec["dp_bytes_dense_job"] \
        if rec.get("dp_bytes_dense_job") else 0.0
    parts = [f"EDGC iteration {rec['iteration']}", f"rank dp {format_ranks(rec)}",
             f"dp {rec['dp_bytes_sent_job'] / 2 ** 20:.2f} MiB (saved {100 * saved:.1f} %)"]
    if "dp_expert_bytes_sent_job" in rec:
        parts.append(expert_split(rec))
    if "dp_slow_hop_bytes_sent_job" in rec:
        parts.append(slow_hop(rec))
    if "dp_link_gbps" in rec:
        parts.append(link_line(rec))
    if "rank_pp" in rec:
        parts.append(f"rank pp {rec['rank_pp']}")
    if "pp_bytes_sent_job" in rec:
        parts.append(f"pp {rec['pp_bytes_sent_job'] / 2 ** 20:.2f} MiB")
    print_rank_last(" | ".join(parts))


# ---------------------------------------------------------------------------- enable


_WRAPPERS = {
    ("megatron.training.arguments", "validate_args"): _validate_args,
    ("megatron.training.initialize", "validate_args"): _validate_args,
    ("megatron.training.training", "setup_model_and_optimizer"): _setup_model_and_optimizer,
    ("megatron.training.training", "train_step"): _train_step,
    ("megatron.training.training", "save_checkpoint"): wrap_save_checkpoint,
    ("megatron.training.training", "load_checkpoint"): wrap_load_checkpoint,
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
    """Install the wrappers (idempotent), megatron-core's torch-Adam resume fix
    (:mod:`megatron_edgc.patches.torch_adam_resume`) where neither Apex nor TE is
    installed, and the check at the job's first gradient sync or optimizer step that EDGC
    engaged (:mod:`.loop_check`: a loop these seams do not reach stops there, saying so).
    Call before ``pretrain(...)``."""
    import importlib

    from megatron_edgc.megatron_lm.loop_check import check_first_step
    from megatron_edgc.patches import first_step
    from megatron_edgc.patches.torch_adam_resume import apply_torch_adam_resume_fix

    check_seams()
    apply_torch_adam_resume_fix()
    first_step.watch(check_first_step)
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

    from megatron_edgc.patches import first_step

    first_step.unwatch()
    for (module_name, name), original in _state.originals.items():
        setattr(importlib.import_module(module_name), name, original)
    _state.originals.clear()
    if _state.runtime is not None:
        _state.runtime.close()
    if _state.records is not None:
        _state.records.close()
    if _state.guard is not None:
        _state.guard.uninstall()
    _state.cfg = _state.runtime = _state.records = _state.stashed = _state.guard = None
    _state.first_iteration, _state.skipped, _state.stepping = None, 0, False

