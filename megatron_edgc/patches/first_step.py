"""One call at a job's first gradient sync or optimizer step, whatever loop runs it.

A front-end that reaches a job only through some of its functions (the plug-in wraps five
of Megatron-LM's ``megatron.training``) cannot see a loop that never calls them: a training
loop of one's own, or Megatron-Bridge's, builds megatron-core's DDP and optimizer and steps
them itself. Every megatron-core loop passes two points, whoever wrote it:

* ``DistributedDataParallel.finish_grad_sync`` (``finalize_model_grads`` calls it on every
  model chunk, before the optimizer step; a loop of one's own may call it directly);
* the optimizer's ``step``: each megatron-core optimizer class that defines one
  (``MixedPrecisionOptimizer``, ``FP32Optimizer``, ``ChainedOptimizer``, ...; read from the
  classes at :func:`watch`, so a release's new ones are included), for a loop whose data
  parallelism is not megatron-core's DDP.

:func:`watch` wraps both on the class (never an instance: no optimizer exists yet) and
calls ``check(where)`` at the first call of either, before the original runs: no
collective of the step has begun and no weight has moved. After ``check`` returns the
wrappers only read one module flag (no host sync, no work) until :func:`unwatch` restores
the classes. ``check`` may stop the job (raise ``SystemExit``): every rank reaches the
same point without communicating, so every rank stops alike.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

#: The call made at the first sync or step (None: disarmed).
_check: Optional[Callable[[str], None]] = None
#: (class, method name, the original) of every wrapper installed.
_installed: list = []


def _targets() -> list:
    """``(class, name, what it is called in a message)`` of the two points."""
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
    from megatron.core.optimizer import MegatronOptimizer

    found = [(DistributedDataParallel, "finish_grad_sync",
              "its first gradient sync (megatron-core's DistributedDataParallel."
              "finish_grad_sync)")]
    seen, todo = set(), list(MegatronOptimizer.__subclasses__())
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.add(cls)
        todo.extend(cls.__subclasses__())
        if "step" in cls.__dict__:
            found.append((cls, "step", f"its first optimizer step (megatron-core's "
                                       f"{cls.__name__}.step)"))
    return sorted(found, key=lambda t: (t[0].__module__, t[0].__qualname__, t[1]))


def _wrap(original, where: str):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if _check is not None:
            _first(where)
        return original(*args, **kwargs)
    wrapper.__edgc_first_step__ = True
    return wrapper


def _first(where: str) -> None:
    global _check
    check, _check = _check, None   # disarmed first: a check that steps does not recurse
    check(where)


def watch(check: Callable[[str], None]) -> None:
    """Call ``check(where)`` once, at the first ``finish_grad_sync`` of megatron-core's DDP
    or ``step`` of a megatron-core optimizer, before it runs; ``where`` names which. Again
    after a call: the wrappers stay, ``check`` is replaced and armed anew."""
    global _check
    if not _installed:
        for cls, name, where in _targets():
            original = cls.__dict__[name]
            setattr(cls, name, _wrap(original, where))
            _installed.append((cls, name, original))
    _check = check


def armed() -> bool:
    """Whether the first sync or step is still to come."""
    return _check is not None


def unwatch() -> None:
    """Disarm and restore every class (in-process tests)."""
    global _check
    _check = None
    while _installed:
        cls, name, original = _installed.pop()
        if getattr(cls.__dict__.get(name), "__edgc_first_step__", False):
            setattr(cls, name, original)
