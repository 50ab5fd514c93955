"""Run Megatron-LM's training loop (``megatron.training``) on CPU processes with gloo.

On top of :func:`megatron_edgc.patches.cpu.apply_cpu_shims` (megatron-core's CUDA
assumptions), Megatron-LM's ``pretrain`` assumes a GPU in a few more places (read from
Megatron-LM core_v0.16.1; docs/megatron-lm-seams.md §2 lists them with file:line):

* ``initialize_megatron`` asserts CUDA unless ``allow_no_cuda=True``;
* ``_initialize_distributed`` and ``_set_random_seed`` skip the model-parallel groups and
  the RNG tracker when ``torch.cuda.device_count()`` is 0: they run as if one device
  existed (``set_device`` does nothing);
* ``_compile_dependencies`` runs ``make`` in megatron-core's dataset folder (the wheel
  ships the built helper, not its Makefile) and nvcc: replaced by an import check;
* ``set_jit_fusion_options`` warms up ``torch.compile``d kernels (an Inductor C++ build in
  every process): skipped;
* the rerun machine and the checkpoint
  read ``torch.cuda.get_rng_state()``: an empty CUDA RNG state (streams: ``apply_cpu_shims``);
* ``validate_args`` asks the GPU's architecture with ``--use-megatron-fsdp``
  (``get_device_arch_version``, for Blackwell's stream priorities): none here (0);
* without Apex or Transformer Engine, resuming a ``torch_dist`` checkpoint with the
  distributed optimizer fails (:mod:`megatron_edgc.patches.torch_adam_resume`, which
  ``edgc.enable()`` also applies, on a GPU too; here for the unmodified script).

Test and laptop use only: with CUDA present nothing here runs. Every patch checks that the
function it replaces exists and fails with one line naming it otherwise.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from megatron_edgc.patches.cpu import UnsupportedMegatronVersion, apply_cpu_shims
from megatron_edgc.patches.torch_adam_resume import apply_torch_adam_resume_fix

_applied = False


@contextlib.contextmanager
def _one_pretend_device():
    count, set_device = torch.cuda.device_count, torch.cuda.set_device
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda *args, **kwargs: None
    try:
        yield
    finally:
        torch.cuda.device_count, torch.cuda.set_device = count, set_device


def _require(module, name: str):
    fn = getattr(module, name, None)
    if fn is None:
        raise UnsupportedMegatronVersion(
            f"Megatron-LM's {module.__name__}.{name} is missing: the CPU shims were written "
            f"for Megatron-LM core_v0.13.1 ... core_v0.19.0")
    return fn


def _with_one_pretend_device(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _one_pretend_device():
            return fn(*args, **kwargs)
    return wrapper


def _check_dataset_helpers(*args, **kwargs) -> None:
    """``_compile_dependencies`` on CPU: the dataset index helpers must import."""
    from megatron.core.datasets import helpers_cpp  # noqa: F401  (built into the wheel)


def apply_megatron_lm_cpu_shims(allow_untested: bool = False) -> bool:
    """Install the shims if CUDA is absent; returns whether they are active."""
    global _applied
    if not apply_cpu_shims(allow_untested):
        return False
    if _applied:
        return True
    from megatron.training import initialize, training

    init_megatron = _require(training, "initialize_megatron")
    for name in ("_initialize_distributed", "_set_random_seed", "_compile_dependencies"):
        _require(initialize, name)
    _require(training, "set_jit_fusion_options")
    training.initialize_megatron = functools.partial(init_megatron, allow_no_cuda=True)
    initialize._initialize_distributed = _with_one_pretend_device(
        initialize._initialize_distributed)
    initialize._set_random_seed = _with_one_pretend_device(initialize._set_random_seed)
    initialize._compile_dependencies = _check_dataset_helpers
    training.set_jit_fusion_options = lambda *args, **kwargs: None
    from megatron.training import arguments

    if hasattr(arguments, "get_device_arch_version"):   # no GPU: no architecture
        arguments.get_device_arch_version = lambda: 0
    apply_torch_adam_resume_fix()
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *args, **kwargs: None
    _applied = True
    return True


def megatron_fsdp_on_cpu(args) -> None:
    """``--use-megatron-fsdp`` on CPU processes (the plug-in's ``validate_args`` seam, before
    any process group): the Megatron-FSDP CPU shims
    (:func:`~megatron_edgc.patches.fsdp_cpu.apply_fsdp_cpu_shims`) and the settings gloo
    needs, which Megatron-LM's ``get_model`` copies from ``args`` into the DDP config:
    ``gradient_reduce_div_fusion`` off (NCCL's premul-sum; set here, as
    ``--no-gradient-reduce-div-fusion``); NCCL's user-buffer registration (``--use-nccl-ub``)
    refused by name (docs/megatron-fsdp-cpu.md). Nothing with CUDA present."""
    from megatron_edgc.config import ConfigError
    from megatron_edgc.patches.fsdp_cpu import apply_fsdp_cpu_shims

    if torch.cuda.is_available() or not getattr(args, "use_megatron_fsdp", False):
        return
    if getattr(args, "nccl_ub", False):
        raise ConfigError("--use-nccl-ub", "not on CPU processes with --use-megatron-fsdp "
                                           "(NCCL user-buffer registration)")
    if getattr(args, "gradient_reduce_div_fusion", False):
        args.gradient_reduce_div_fusion = False
        if getattr(args, "rank", 0) == 0:
            print("EDGC: Megatron-FSDP on CPU: --no-gradient-reduce-div-fusion (its fused "
                  "division is NCCL's premul-sum)", flush=True)
    apply_fsdp_cpu_shims()
