"""Resuming megatron-core's distributed optimizer when it runs on torch's Adam/AdamW.

Without Apex or Transformer Engine (``distrib_optimizer.HAVE_APEX_OR_TE`` false: a CPU, or
a GPU without either), megatron-core's ``DistributedOptimizer`` falls back to torch's
Adam/AdamW, which keeps ``step`` per parameter. Loading a ``torch_dist`` checkpoint then
breaks twice (core_v0.16.1 and core_v0.19.0 alike; the unmodified ``pretrain_gpt.py``
fails the same way; docs/megatron-lm-seams.md §6):

* ``sharded_state_dict(is_loading=True)`` reads ``step`` from torch Adam's still-empty
  state (``state_dict``: ``assert len(steps) == 1``) before its own dummy initialisation:
  the dummy initialisation runs first;
* ``load_state_dict`` gives every parameter's state one shared ``step`` tensor, which torch
  Adam increments once per parameter per step (the bias correction jumps): each state gets
  its own tensor of the saved step (the param groups').

Both run at load only, never in the step. With Apex's or TE's Adam nothing is patched.
"""

from __future__ import annotations

import functools
import inspect

import torch

from megatron_edgc.patches.features import UnsupportedMegatronVersion, megatron_core_version

_DISTRIB_OPT = "megatron.core.optimizer.distrib_optimizer"


def uses_torch_adam() -> bool:
    """megatron-core's distributed optimizer runs on torch's Adam/AdamW fallback."""
    from megatron.core.optimizer import distrib_optimizer

    return not getattr(distrib_optimizer, "HAVE_APEX_OR_TE", True)


def _dummy_state_before_loading(sharded_state_dict):
    signature = inspect.signature(sharded_state_dict)

    @functools.wraps(sharded_state_dict)
    def wrapper(self, *args, **kwargs):
        is_loading = signature.bind(self, *args, **kwargs).arguments.get("is_loading", False)
        if is_loading and not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        return sharded_state_dict(self, *args, **kwargs)
    return wrapper


def _own_step_per_parameter(load_state_dict):
    @functools.wraps(load_state_dict)
    def wrapper(self, state_dict, *args, **kwargs):
        out = load_state_dict(self, state_dict, *args, **kwargs)
        groups = state_dict.get("optimizer", {}).get("param_groups", [])
        steps = {g["step"] for g in groups if "step" in g}
        if len(steps) == 1:  # the saved step, as megatron-core's state_dict wrote it
            step = float(steps.pop())
            for state in self.optimizer.state.values():
                if "step" in state:
                    old = state["step"]
                    state["step"] = torch.tensor(step, dtype=old.dtype, device=old.device)
        return out
    return wrapper


_WRAPPERS = {"sharded_state_dict": _dummy_state_before_loading,
             "load_state_dict": _own_step_per_parameter}


def apply_torch_adam_resume_fix() -> bool:
    """Patch ``DistributedOptimizer`` where it runs on torch's Adam (idempotent); returns
    whether the patch is in force. A megatron-core lacking a method it patches or calls
    fails with one line naming it."""
    if not uses_torch_adam():
        return False
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for name in (*_WRAPPERS, "_init_optimizer_states_with_dummy_values"):
        if not callable(getattr(DistributedOptimizer, name, None)):
            raise UnsupportedMegatronVersion(
                f"megatron-core {megatron_core_version()} lacks {_DISTRIB_OPT}."
                f"DistributedOptimizer.{name} (the torch-Adam resume patch)")
    for name, wrap in _WRAPPERS.items():
        current = getattr(DistributedOptimizer, name)
        if not getattr(current, "__edgc_wrapped__", False):
            wrapped = wrap(current)
            wrapped.__edgc_wrapped__ = True
            setattr(DistributedOptimizer, name, wrapped)
    return True
