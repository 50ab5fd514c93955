"""Never silently off: a job that called :func:`~megatron_edgc.megatron_lm.enable` and
reaches its first gradient sync or optimizer step without EDGC engaged stops there, saying
which loop it saw and what to do.

The plug-in reaches a job through Megatron-LM's ``megatron.training`` (:mod:`.seams`).
megatron-core's own package ships a ``megatron/training`` too, so in a job that trains
through another loop (its own, or Megatron-Bridge's ``megatron.bridge.training.train``)
``enable()`` succeeds and EDGC would then never run. The check is made once, at the first
call of megatron-core's ``DistributedDataParallel.finish_grad_sync`` or of an optimizer's
``step`` (:mod:`megatron_edgc.patches.first_step`), before either runs. It passes where:

* the call comes from inside the wrapped ``train_step`` (the loop is Megatron-LM's);
* the ``--edgc-*`` flags were read by the wrapped ``validate_args``;
* with compression on, the wrapped ``setup_model_and_optimizer`` built the runtime.

Otherwise every rank exits 2, rank 0 printing one line that names the loop (the first
caller on the stack outside megatron-core, torch and this package) and Megatron-Bridge
where it can tell (a frame of ``megatron.bridge`` on the stack: its loop; else the module
imported), with what to do.
"""

from __future__ import annotations

import sys

from megatron_edgc.megatron_lm.state import state as _state

#: Modules whose frames are the machinery between a loop and the checked call, not the loop.
_MACHINERY = ("megatron.core", "megatron_edgc", "torch", "functools", "contextlib")
BRIDGE = "megatron.bridge"
DOCS = "docs/megatron-lm.md#megatron-bridge-and-other-loops"


def _module(frame) -> str:
    return frame.f_globals.get("__name__", "") or ""


def _is(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def the_loop(frame=None) -> tuple:
    """``(the loop's first frame outside the machinery or None, whether a frame of
    Megatron-Bridge is on the stack)``."""
    frame = frame or sys._getframe(1)
    loop, bridge = None, False
    while frame is not None:
        module = _module(frame)
        if loop is None and not _is(module, _MACHINERY):
            loop = frame
        bridge = bridge or _is(module, (BRIDGE,))
        frame = frame.f_back
    return loop, bridge


def _describe(frame) -> str:
    if frame is None:
        return "a caller this check cannot name"
    code = frame.f_code
    name = getattr(code, "co_qualname", code.co_name)
    return f"{_module(frame)}.{name} at {code.co_filename}:{frame.f_lineno}"


def _megatron_lm_setup_missed() -> str | None:
    """Inside Megatron-LM's train_step: what kept EDGC from being set up, or None where it
    runs (or the --edgc-* flags turned it off)."""
    if _state.cfg is None:
        return ("Megatron-LM's validate_args ran before enable() wrapped it, so the --edgc-* "
                "flags were never read: call enable() atop the __main__ block, before "
                "pretrain(...)")
    if _state.compression_on() and _state.runtime is None:
        return ("Megatron-LM's setup_model_and_optimizer did not run through "
                "megatron.training.training (or ran before enable()), so EDGC's runtime was "
                "never built on the model: build the model with pretrain(...), after enable()")
    return None


def message(where: str, frame=None) -> str | None:
    """The one line a job that would run without EDGC stops with (None: EDGC engages)."""
    head = "error: EDGC never engaged: megatron_edgc.megatron_lm.enable() was called"
    if _state.stepping:
        reason = _megatron_lm_setup_missed()
        return None if reason is None else (
            f"{head}, and the job reached {where} inside Megatron-LM's train_step, but "
            f"{reason}; as it stands the job would train dense")
    loop, bridge = the_loop(frame)
    wraps = "it wraps Megatron-LM's megatron.training.training.train_step"
    no_adapter = (f"Megatron-Bridge trains and saves through its own, and this package has no "
                  f"Megatron-Bridge adapter: {DOCS}")
    if bridge:
        where_seen = (f"in Megatron-Bridge's loop, {_describe(loop)}, which the plug-in does "
                      f"not reach ({wraps}; {no_adapter})")
    else:
        imported = f"; Megatron-Bridge is imported: {no_adapter}" if BRIDGE in sys.modules \
            else ""
        where_seen = f"in {_describe(loop)}, a loop the plug-in does not reach ({wraps}{imported})"
    return (f"{head}, but the job reached {where} {where_seen}: the job would train dense. "
            f"Train through Megatron-LM's pretrain(...) with the plug-in's two lines "
            f"(docs/megatron-lm.md) or with this project's trainer, or remove enable() to "
            f"train dense on purpose")


def check_first_step(where: str) -> None:
    """Called once, at the job's first gradient sync or optimizer step
    (:func:`megatron_edgc.patches.first_step.watch`): returns where EDGC engages, else
    every rank exits 2, rank 0 saying why."""
    line = message(where, sys._getframe(1))
    if line is None:
        return
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, file=sys.stderr, flush=True)
    sys.exit(2)
