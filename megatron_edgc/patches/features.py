"""What megatron_edgc's patches need from megatron-core, checked by feature, not by version.

Every patch names the megatron-core attributes, methods and parameters it patches or calls
(:data:`FEATURES`); :func:`check_megatron_version` (run at start-up, before any process
group) fails with one line naming what is missing, whatever the version. A complete version
outside :data:`SUPPORTED_MEGATRON_CORE_VERSIONS` runs with a one-line warning
(``--allow-untested-megatron`` silences it); a supported one runs silently.

Where the supported versions differ in *form* (not just presence), the patch branches on a
named probe defined here (:func:`grad_sync_takes_force_all_reduce`, :func:`schedule_form`,
...), never on the version string; docs/compat.md lists which version has which form.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
from dataclasses import dataclass, fields, is_dataclass
from typing import Callable, Optional

#: megatron-core versions the patches are tested on (``make test-compat``).
SUPPORTED_MEGATRON_CORE_VERSIONS = ("0.13.1", "0.14.0", "0.15.3", "0.16.1", "0.17.1", "0.18.2",
                                    "0.19.2")

_PPG = "megatron.core.distributed.param_and_grad_buffer"
_DDP = "megatron.core.distributed.distributed_data_parallel"
_DDP_CONFIG = "megatron.core.distributed.distributed_data_parallel_config"
_P2P = "megatron.core.pipeline_parallel.p2p_communication"
_SCHED = "megatron.core.pipeline_parallel.schedules"
_RANDOM = "megatron.core.tensor_parallel.random"
_MP_CONFIG = "megatron.core.model_parallel_config"
_PG_CONFIG = "megatron.core.process_groups_config"
_OPT = "megatron.core.optimizer.optimizer"

_P2P_OPS_PARAMS = ("tensor_send_prev", "tensor_recv_prev", "tensor_send_next",
                   "tensor_recv_next", "group", "prev_pipeline_rank", "next_pipeline_rank")
_COMMUNICATE_PARAMS = ("tensor_send_next", "tensor_send_prev", "recv_prev", "recv_next",
                       "tensor_shape", "wait_on_reqs")
_SCHEDULES = ("forward_backward_no_pipelining",
              "forward_backward_pipelining_without_interleaving",
              "forward_backward_pipelining_with_interleaving")
_SCHEDULE_PARAMS = ("forward_step_func", "data_iterator", "model", "num_microbatches",
                    "seq_length", "micro_batch_size", "decoder_seq_length", "forward_only")


class UnsupportedMegatronVersion(RuntimeError):
    pass


class _Missing(Exception):
    """A probe's finding: ``str(exc)`` names what is missing."""


# ---------------------------------------------------------------------- probe helpers

def resolve(module: str, path: str = ""):
    """``module`` imported, then ``path``'s dotted attributes; raises _Missing naming the
    first absent one."""
    try:
        obj = importlib.import_module(module)
    except ImportError as exc:  # e.g. 0.18+ schedules import triton unconditionally
        raise _Missing(f"{module} (import failed: {exc})") from exc
    done = module
    for part in path.split(".") if path else []:
        done = f"{done}.{part}"
        if not hasattr(obj, part):
            raise _Missing(done)
        obj = getattr(obj, part)
    return obj


def _params(fn) -> set:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _code_names(fn) -> set:
    """Global and attribute names ``fn`` (and the functions nested in it) look up."""
    code = getattr(inspect.unwrap(fn), "__code__", None)
    names, stack = set(), [code] if code is not None else []
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return names


def _source(obj) -> Optional[str]:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return None  # no source shipped: the patch's own check on live objects decides


def has_params(module: str, path: str, *names: str) -> None:
    fn = resolve(module, path)
    present = _params(fn)
    for name in names:
        if name not in present:
            raise _Missing(f"{module}.{path}(..., {name}=)")


def has_fields(module: str, cls: str, *names: str) -> None:
    klass = resolve(module, cls)
    present = {f.name for f in fields(klass)} if is_dataclass(klass) else set(dir(klass))
    for name in names:
        if name not in present:
            raise _Missing(f"{module}.{cls}.{name}")


def sets_attributes(module: str, cls: str, *names: str) -> None:
    """``cls.__init__`` assigns ``self.<name>`` for each name (instance attributes)."""
    src = _source(resolve(module, cls).__init__)
    if src is None:
        return
    for name in names:
        if f"self.{name}" not in src:
            raise _Missing(f"{module}.{cls} instance attribute {name}")


def looks_up(module: str, path: str, name: str) -> None:
    """``path`` looks ``name`` up at call time (so replacing the attribute reaches it)."""
    if name not in _code_names(resolve(module, path)):
        raise _Missing(f"{module}.{path} calling {name} by name")


def any_of(*probes: Callable[[], None]) -> Callable[[], None]:
    def probe():
        missing = []
        for p in probes:
            try:
                p()
                return
            except _Missing as exc:
                missing.append(str(exc))
        raise _Missing(" or ".join(missing))
    return probe


@dataclass(frozen=True)
class Feature:
    patch: str                      # cpu, ddp, p2p, timing, guard, trainer
    what: str                       # what it is used for (documentation)
    probe: Callable[[], None]       # raises _Missing naming the absent piece


# ---------------------------------------------------------------------- the features

def _bucket_group_methods():
    for name in ("start_grad_sync", "finish_grad_sync"):
        resolve(_PPG, f"_ParamAndGradBucketGroup.{name}")


def _module_communicate():
    has_params(_P2P, "_communicate", *_COMMUNICATE_PARAMS, "config")
    looks_up(_P2P, "send_backward", "_communicate")


def _schedules_take(*names, groups: str):
    def probe():
        for sched in _SCHEDULES[1:]:
            has_params(_SCHED, sched, *names)
        resolve(_PG_CONFIG, groups)
    return probe


def _schedules_call_p2p_module():
    """0.13.x: each pipelined schedule reaches ``p2p_communication`` by name, directly or
    through one of the schedules module's own wrappers (``send_forward`` ...)."""
    module = resolve(_SCHED)
    for sched in _SCHEDULES[1:]:
        names = _code_names(resolve(_SCHED, sched))
        for name in list(names):
            helper = getattr(module, name, None)
            if isinstance(helper, types.FunctionType) and helper.__module__ == _SCHED:
                names |= _code_names(helper)
        if "p2p_communication" not in names:
            raise _Missing(f"{_SCHED}.{sched} calling p2p_communication by name")


def _backward_step_by_name():
    resolve(_SCHED, "backward_step")
    for sched in _SCHEDULES:
        looks_up(_SCHED, sched, "backward_step")


FEATURES = (
    # CPU shims (patches/cpu.py): the CPU RNG tracker replaces the CUDA one.
    Feature("cpu", "RNG tracker replaced by the CPU one",
            lambda: [resolve(_RANDOM, n) for n in (
                "_CUDA_RNG_STATE_TRACKER", "_CUDA_RNG_STATE_TRACKER_INITIALIZED",
                "_MODEL_PARALLEL_RNG_TRACKER_NAME", "_DATA_PARALLEL_RNG_TRACKER_NAME",
                "_EXPERT_PARALLEL_RNG_TRACKER_NAME")]),
    Feature("cpu", "get_cuda_rng_tracker returns the module's tracker",
            lambda: looks_up(_RANDOM, "get_cuda_rng_tracker", "_CUDA_RNG_STATE_TRACKER")),
    # DP gradient compression (patches/ddp.py).
    Feature("ddp", "per-bucket-group grad sync replaced", _bucket_group_methods),
    Feature("ddp", "bucket-group state the patch reads and writes",
            lambda: sets_attributes(_PPG, "_ParamAndGradBucketGroup", "buckets", "ddp_config",
                                    "grad_reduce_handle", "param_gather_dispatched")),
    Feature("ddp", "bucket scaling and buffers",
            lambda: (has_params(_PPG, "_ParamAndGradBucket.__init__", "gradient_scaling_factor"),
                     sets_attributes(_PPG, "_ParamAndGradBucket", "grad_data", "params_list",
                                     "gradient_scaling_factor"))),
    Feature("ddp", "the DDP config switches the patch follows",
            lambda: has_fields(_DDP_CONFIG, "DistributedDataParallelConfig",
                               "overlap_grad_reduce", "average_in_collective",
                               "use_distributed_optimizer")),
    Feature("ddp", "DDP's bucket groups",
            lambda: sets_attributes(_DDP, "DistributedDataParallel", "bucket_groups",
                                    "expert_parallel_bucket_groups")),
    # Pipeline backward-send compression (patches/p2p.py).
    Feature("p2p", "the one method every pipeline transfer goes through",
            any_of(lambda: has_params(_P2P, "P2PCommunicator._communicate",
                                      *_COMMUNICATE_PARAMS),
                   _module_communicate)),
    Feature("p2p", "isend/irecv helpers",
            lambda: [has_params(_P2P, n, *_P2P_OPS_PARAMS)
                     for n in ("_batched_p2p_ops", "_p2p_ops")]),
    Feature("p2p", "a way to hand the schedules a communicator (and process groups)",
            any_of(_schedules_take("p2p_communicator", "pg_collection",
                                   groups="ProcessGroupCollection.use_mpu_process_groups"),
                   _schedules_take("p2p_communicator", "grad_finalize_pgs",
                                   groups="GradFinalizeProcessGroups"),
                   _schedules_call_p2p_module)),
    Feature("p2p", "interleaved schedule order",
            lambda: has_params(_SCHED, "get_schedule_table", "num_microbatches",
                               "num_model_chunks", "microbatch_group_size_per_vp_stage")),
    Feature("p2p", "pipeline config the communicator reads",
            lambda: has_fields(_MP_CONFIG, "ModelParallelConfig", "variable_seq_lengths",
                               "use_ring_exchange_p2p", "batch_p2p_comm", "batch_p2p_sync",
                               "pipeline_dtype", "microbatch_group_size_per_vp_stage")),
    # Stage timing (patches/timing.py): schedules call backward_step by name.
    Feature("timing", "micro-batch backward timed by wrapping it", _backward_step_by_name),
    # The non-finite step guard (patches/nonfinite_step.py): each optimizer's step reaches
    # the norm and the inner step through the instance, so the instance's wrappers see them.
    Feature("guard", "optimizer steps calling the norm and step_with_ready_grads by name",
            lambda: ([resolve(_OPT, f"MegatronOptimizer.{n}") for n in (
                      "get_grad_norm", "clip_grad_norm", "step_with_ready_grads")],
                     [looks_up(_OPT, f"{cls}.step", n)
                      for cls in ("MixedPrecisionOptimizer", "FP32Optimizer")
                      for n in ("clip_grad_norm", "step_with_ready_grads")],
                     [looks_up(_OPT, "ChainedOptimizer.step", n)
                      for n in ("get_grad_norm", "step_with_ready_grads")])),
    # The training loop's calls into megatron-core.
    Feature("trainer", "schedule selection and arguments",
            lambda: (resolve(_SCHED, "get_forward_backward_func"),
                     [has_params(_SCHED, s, *_SCHEDULE_PARAMS) for s in _SCHEDULES])),
    Feature("trainer", "gradient finalization",
            lambda: resolve("megatron.core.distributed", "finalize_model_grads")),
)


def missing_features(patches=None) -> list:
    """``[(patch, what is missing), ...]`` of the given patches (all by default)."""
    out = []
    for feature in FEATURES:
        if patches is not None and feature.patch not in patches:
            continue
        try:
            feature.probe()
        except _Missing as exc:
            out.append((feature.patch, str(exc)))
    return out


def megatron_core_version() -> str:
    """The installed release, without the ``+<git hash>`` that 0.19+ append when their
    files sit inside a git checkout."""
    from megatron.core import package_info

    return package_info.__version__.split("+")[0]


def missing_message(version: str, missing: list) -> str:
    names = "; ".join(f"{what} (the {patch} patch)" for patch, what in missing)
    return (f"megatron-core {version} lacks what megatron_edgc patches: {names}; "
            f"supported versions: {', '.join(SUPPORTED_MEGATRON_CORE_VERSIONS)}")


def require(*patches: str) -> None:
    """Raise :class:`UnsupportedMegatronVersion` (one line) if a feature of ``patches`` is
    missing from the installed megatron-core."""
    missing = missing_features(patches or None)
    if missing:
        raise UnsupportedMegatronVersion(missing_message(megatron_core_version(), missing))


_warned: set = set()


def check_megatron_version(allow_untested: bool = False) -> str:
    """Every feature of every patch present, or one-line :class:`UnsupportedMegatronVersion`;
    a complete version outside the supported ones warns once (unless ``allow_untested``)."""
    try:
        version = megatron_core_version()
    except ImportError as exc:  # e.g. 0.18+ on a machine without triton
        raise UnsupportedMegatronVersion(
            f"megatron-core does not import ({type(exc).__name__}: {exc}); supported versions: "
            f"{', '.join(SUPPORTED_MEGATRON_CORE_VERSIONS)}") from exc
    require()
    if version not in SUPPORTED_MEGATRON_CORE_VERSIONS and not allow_untested \
            and version not in _warned:
        _warned.add(version)
        print(f"warning: megatron-core {version} is untested with megatron_edgc (tested: "
              f"{', '.join(SUPPORTED_MEGATRON_CORE_VERSIONS)}); every feature its patches "
              f"need is present, so it runs (--allow-untested-megatron silences this)",
              file=sys.stderr, flush=True)
    return version


# ---------------------------------------------------------------------- forms

def grad_sync_takes_force_all_reduce() -> bool:
    """``_ParamAndGradBucketGroup.start/finish_grad_sync(force_all_reduce=...)``: 0.16.x;
    0.13.x-0.15.x take no argument."""
    return "force_all_reduce" in _params(resolve(_PPG, "_ParamAndGradBucketGroup.start_grad_sync"))


def instances_overlap_waits_on_current_stream() -> bool:
    """With ``num_distributed_optimizer_instances`` > 1 and ``overlap_grad_reduce``,
    megatron-core runs the reductions on a communication stream; before Megatron-LM PR
    #3693 (issue #3670, wrong gradients) that stream waited for, and was waited on by, the
    *default* stream instead of the current one. Fixed where ``finish_grad_sync`` waits on
    ``torch.cuda.current_stream()`` (0.17.x+; 0.13.x-0.16.x have the bug)."""
    source = _source(resolve(_PPG, "_ParamAndGradBucketGroup.finish_grad_sync")) or ""
    return "current_stream().wait_stream" in source


def refuse_instances_overlap(instances: int, overlap: bool, on_gpu: bool) -> Optional[str]:
    """Why ``--overlap-grad-reduce`` with ``instances`` distributed-optimizer instances must
    not run here, or None: on a GPU, with a megatron-core whose instance streams are wrong
    (:func:`instances_overlap_waits_on_current_stream`). On CPU every stream is the one
    null stream, so the wrong wait cannot reorder anything."""
    if instances > 1 and overlap and on_gpu and not instances_overlap_waits_on_current_stream():
        return (f"with --num-distributed-optimizer-instances {instances}, megatron-core "
                f"{megatron_core_version()} syncs its communication stream with the default "
                f"stream instead of the current one (Megatron-LM issue #3670, fixed in "
                f"0.17): drop --overlap-grad-reduce or use megatron-core >= 0.17")
    return None


def schedule_form(fn=None) -> str:
    """How a pipeline schedule takes a communicator: ``"pg_collection"`` (0.15.x, 0.16.x:
    ``p2p_communicator=`` and ``pg_collection=``), ``"grad_finalize_pgs"`` (0.14.x:
    ``p2p_communicator=`` and ``grad_finalize_pgs=``) or ``"module"`` (0.13.x: no
    argument; the schedules call ``p2p_communication``'s module-level functions)."""
    if fn is None:
        fn = resolve(_SCHED, _SCHEDULES[1])
    params = _params(fn)
    if "p2p_communicator" in params:
        return "pg_collection" if "pg_collection" in params else "grad_finalize_pgs"
    return "module"
