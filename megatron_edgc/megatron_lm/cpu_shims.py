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
* without Apex or Transformer Engine, ``DistributedOptimizer.sharded_state_dict`` reads
  ``step`` from torch Adam's state before its own dummy initialisation when *loading* a
  ``torch_dist`` checkpoint, and asserts on the still-empty state (core_v0.16.1 and
  core_v0.19.0 alike; the unmodified ``pretrain_gpt.py`` fails the same way): the dummy
  initialisation runs first; and its ``load_state_dict`` gives every parameter's state one
  shared ``step`` tensor, which torch Adam then increments once per parameter per step:
  each state gets its own copy of the saved step.

Test and laptop use only: with CUDA present nothing here runs. Every patch checks that the
function it replaces exists and fails with one line naming it otherwise.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch

from megatron_edgc.patches.cpu import UnsupportedMegatronVersion, apply_cpu_shims

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


def _dummy_optimizer_state_before_loading(sharded_state_dict):
    signature = inspect.signature(sharded_state_dict)

    @functools.wraps(sharded_state_dict)
    def wrapper(self, *args, **kwargs):
        is_loading = signature.bind(self, *args, **kwargs).arguments.get("is_loading", False)
        if is_loading and not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        return sharded_state_dict(self, *args, **kwargs)
    return wrapper


def _own_step_per_parameter_after_loading(load_state_dict):
    @functools.wraps(load_state_dict)
    def wrapper(self, state_dict, *args, **kwargs):
        out = load_state_dict(self, state_dict, *args, **kwargs)
        groups = state_dict.get("optimizer", {}).get("param_groups", [])
        steps = {g["step"] for g in groups if "step" in g}
        if len(steps) == 1:
            step = steps.pop()
            for state in self.optimizer.state.values():
                if "step" in state:
                    state["step"] = torch.tensor(float(step), dtype=state["step"].dtype)
        return out
    return wrapper


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
    from megatron.core.optimizer import distrib_optimizer

    if not getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True):
        optimizer = distrib_optimizer.DistributedOptimizer
        _require(optimizer, "_init_optimizer_states_with_dummy_values")
        optimizer.sharded_state_dict = _dummy_optimizer_state_before_loading(
            _require(optimizer, "sharded_state_dict"))
        optimizer.load_state_dict = _own_step_per_parameter_after_loading(
            _require(optimizer, "load_state_dict"))
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    torch.cuda.set_rng_state = lambda *args, **kwargs: None
    _applied = True
    return True
