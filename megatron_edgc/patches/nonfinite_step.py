"""The non-finite step guard: a reduced gradient that is not finite never reaches the weights.

megatron-core skips an optimizer step only where a loss scaler finds an inf/NaN (fp16:
``MixedPrecisionOptimizer.prepare_grads`` returns ``found_inf``). Without one (bf16, fp32)
``step`` never skips, and gradient clipping compares against a NaN norm (``clip_coeff <
1.0`` is False) and does nothing: a non-finite reduced gradient is written into the
weights, the run continues NaN and exits 0 (core 0.13.1 ... 0.19.x,
``optimizer.py`` ``MixedPrecisionOptimizer.step`` / ``FP32Optimizer.step`` /
``ChainedOptimizer.step``, ``clip_grads.py``).

:class:`NonFiniteStepGuard` patches the one optimizer instance the front-end steps (the
outermost: a ``ChainedOptimizer`` over several, or a single ``Float16Optimizer…``,
``DistributedOptimizer`` or ``FP32Optimizer``), never its class:

* ``clip_grad_norm`` / ``get_grad_norm`` (called by megatron-core's ``step`` where
  ``clip_grad`` > 0; ``ChainedOptimizer.step`` always calls ``get_grad_norm``): the norm
  they return is recorded. megatron-core has already read it on the host (a Python float,
  ``.item()`` in ``get_grad_norm_fp32``), all-reduced over the optimizer's grad-stats group
  (the model-parallel group; the whole instance with the distributed optimizer) — and the DP
  replicas hold the same reduced gradient — so every rank sees the same norm and decides
  the same. No host sync of the guard's own.
* ``step_with_ready_grads``: with a non-finite recorded norm (or a non-finite norm of a
  separate grad-norm group, 0.19's ``grad_norms_by_group``) it is a no-op returning False:
  no ``optimizer.step()`` (no parameter, no optimizer-state change), no main-to-model copy,
  no param all-gather of the distributed optimizer — skipped on every rank alike, as
  megatron-core's own fp16 skip does. The step then returns ``update_successful=False``,
  which both front-ends count as a skipped iteration (Megatron-LM's ``skipped_iter``), and
  rank 0 says ``iteration N: non-finite gradient (grad norm nan): step skipped, weights
  unchanged``.
* ``step``: forgets the last step's norm, and returns the guard's norm where megatron-core
  computed none.

The two cases with a read of the guard's own:

* ``clip_grad == 0`` (with a single optimizer): megatron-core computes no norm, so the
  guard calls ``get_grad_norm()`` once per step: the same norm, reduced over the same
  groups, read on the host. This is the one case where the guard adds a sync.
* megatron-core 0.17+ with Transformer Engine's ``multi_tensor_scale_tensor_impl`` keeps
  the norm on the device (a tensor): the guard reads it (Megatron-LM's ``train_step``
  reads it right after the step anyway, ``reduce_max_stat_across_model_parallel_group``).

fp16 with its loss scaler keeps its own behaviour: a found inf returns before the norm and
before ``step_with_ready_grads`` (the scaler backs off; the guard neither sees nor logs it).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from megatron_edgc.patches import features

#: What the guard wraps on the optimizer instance.
PATCHED_METHODS = ("step", "step_with_ready_grads", "get_grad_norm", "clip_grad_norm")

_UNSET = object()


def _as_float(value) -> Optional[float]:
    """A norm as megatron-core returns it (float, None, or a 0-dim/1-element device tensor
    on 0.17+ with TE: read here) as a float; None stays None."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return float(value.detach().reshape(-1)[0].item())
    return float(value)


class NonFiniteStepGuard:
    """Skips the optimizer step whose reduced gradient is not finite (see the module).

    ``optimizer``: the megatron-core optimizer the front-end calls ``step()`` on;
    ``iteration()``: the 1-based number of the iteration being stepped (for the log line);
    ``log``: where the line goes (the front-end prints it on rank 0).
    ``skipped``: the iterations this guard skipped, in order (the same list on every rank).
    """

    def __init__(self, optimizer, iteration: Callable[[], int],
                 log: Callable[[str], None] = lambda line: print(line, flush=True)):
        features.require("guard")
        self.optimizer = optimizer
        self.iteration = iteration
        self.log = log
        self.skipped: list = []
        self.own_reads = 0          # steps on which the guard read a norm of its own
        self._norm = _UNSET         # the norm recorded since the step began
        self._own_norm = None       # the guard's own norm of this step (clip_grad == 0)
        self._originals: dict = {}

    # ------------------------------------------------------------------ install

    def install(self) -> "NonFiniteStepGuard":
        """Patch the optimizer instance (idempotent: one guard per optimizer)."""
        opt = self.optimizer
        present = getattr(opt, "__dict__", {}).get("_edgc_nonfinite_guard")
        if present is not None:
            return present
        for name in PATCHED_METHODS:
            self._originals[name] = getattr(opt, name)
        opt.get_grad_norm = self._recording(self._originals["get_grad_norm"])
        opt.clip_grad_norm = self._recording(self._originals["clip_grad_norm"])
        opt.step_with_ready_grads = self._step_with_ready_grads
        opt.step = self._step
        opt._edgc_nonfinite_guard = self
        return self

    def uninstall(self) -> None:
        """Restore the class's methods on the instance."""
        opt = self.optimizer
        for name in self._originals:
            opt.__dict__.pop(name, None)
        opt.__dict__.pop("_edgc_nonfinite_guard", None)
        self._originals = {}

    # ------------------------------------------------------------------ wrappers

    def _recording(self, original):
        def recorded(*args, **kwargs):
            norm = original(*args, **kwargs)
            self._norm = norm
            return norm
        recorded.__wrapped__ = original
        return recorded

    def _step(self, *args, **kwargs):
        self._norm, self._own_norm = _UNSET, None
        out = self._originals["step"](*args, **kwargs)
        if self._own_norm is not None and isinstance(out, tuple) and len(out) == 3:
            update_ok, _, num_zeros = out   # megatron-core computed none (clip_grad == 0)
            out = (update_ok, self._own_norm, num_zeros)
        return out

    def _step_with_ready_grads(self, *args, **kwargs) -> bool:
        norm, self._norm = self._norm, _UNSET
        if norm is _UNSET:   # clip_grad == 0: megatron-core computed no norm
            norm = self._originals["get_grad_norm"]()
            self.own_reads += 1
            self._own_norm = _as_float(norm)
        # the main norm, and 0.19's separate grad-norm groups' (host floats where clipped)
        groups = getattr(self.optimizer, "grad_norms_by_group", None) or {}
        bad = [v for v in [_as_float(norm)] + [_as_float(g) for g in groups.values()]
               if v is not None and not math.isfinite(v)]
        if not bad:
            return self._originals["step_with_ready_grads"](*args, **kwargs)
        it = self.iteration()
        self.skipped.append(it)
        self.log(f"iteration {it}: non-finite gradient (grad norm {bad[0]:g}): step skipped, "
                 f"weights unchanged")
        return False


def install_nonfinite_guard(optimizer, iteration: Callable[[], int],
                            log: Callable[[str], None]) -> NonFiniteStepGuard:
    """The guard on ``optimizer`` (the one already there, if any)."""
    return NonFiniteStepGuard(optimizer, iteration, log).install()

