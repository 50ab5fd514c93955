"""Count the host syncs a piece of code would make on a GPU, on any device.

On a GPU the host waits for the device whenever it needs a tensor's value (``.item()``,
``if tensor:``, ``.tolist()``, ``float(t)``, a copy to the CPU), copies host data to the
device (``torch.tensor(data, device=...)``: a synchronous copy), or asks for a shape that
depends on the data (``nonzero``, boolean-mask indexing). :class:`HostSyncCounter` is a
``TorchFunctionMode`` that records every such call made while it is active, with the
innermost ``megatron_edgc`` source line that made it, so a CPU test can assert that a
step makes none. Copies between devices (``.to``, ``copy_``, ``.cuda()``) are counted
when source and target devices differ, which on a CPU-only machine never happens.
``also`` counts further callables (the trainer test counts ``IntervalClock.wait``, a device
synchronize on a GPU and nothing on the CPU).

Run as a script it trains with this project's trainer, the counter active over the whole
run on every rank, each sync tagged with the iteration it falls in and with whose code made
it (``megatron_edgc``'s, or megatron-core's own):

    python tests/host_sync.py OUT_DIR [pretrain flags...]   # OUT_DIR/syncs_rank{R}.json
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
from torch.overrides import TorchFunctionMode

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "megatron_edgc")
TORCH = os.path.dirname(torch.__file__)
CPU_SHIMS = os.path.join(PACKAGE, "patches", "cpu.py")

#: Tensor methods that hand a value to the host.
TO_HOST = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu,
           torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
           torch.Tensor.__index__, torch.Tensor.__complex__, torch.Tensor.__format__,
           torch.Tensor.__array__}
#: Functions whose output shape depends on the data.
DATA_DEPENDENT = {torch.nonzero, torch.Tensor.nonzero, torch.masked_select,
                  torch.Tensor.masked_select, torch.unique, torch.Tensor.unique,
                  torch.unique_consecutive, torch.argwhere, torch.repeat_interleave,
                  torch.Tensor.repeat_interleave}
#: Factories from host data: on a GPU, a synchronous host-to-device copy (the builtins:
#: the CPU shims of ``patches/cpu.py`` wrap ``torch.tensor`` in a function of their own).
FROM_HOST = {torch._C._VariableFunctions.tensor, torch._C._VariableFunctions.as_tensor}
#: Copies that cross devices when the target device differs from the source's.
COPIES = {torch.Tensor.to, torch.Tensor.copy_, torch.Tensor.cuda}


def _device_of(args, kwargs):
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, (torch.device, str)) and not isinstance(value, bool):
            try:
                return torch.device(value)
            except (RuntimeError, TypeError):
                continue
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def _crosses_devices(func, args, kwargs) -> bool:
    if func is torch.Tensor.cuda:
        return args[0].device.type != "cuda"
    if func is torch.Tensor.copy_:
        return args[0].device != args[1].device
    target = _device_of(args[1:], kwargs)
    return target is not None and target != args[0].device


def _bool_index(args) -> bool:
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _where(func, args, kwargs) -> bool:
    return func is torch.where and len(args) + len(kwargs) == 1  # where(cond) = nonzero


def is_host_sync(func, args, kwargs) -> bool:
    if func in TO_HOST or func in DATA_DEPENDENT or _where(func, args, kwargs):
        return True
    if func in FROM_HOST:
        return kwargs.get("device") is not None  # host data placed on a device
    if func in COPIES:
        return _crosses_devices(func, args, kwargs)
    if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
        return _bool_index(args)
    return False


def _frames() -> list:
    """The stack without this module's frames and the CPU shims of torch's factories."""
    here = os.path.abspath(__file__)
    return [f for f in traceback.extract_stack()
            if f.filename != CPU_SHIMS and os.path.abspath(f.filename) != here]


def _caller(frames: list) -> str:
    """``file:line function`` of the innermost frame in megatron_edgc, else of the
    innermost one outside torch."""
    ours = [f for f in frames if f.filename.startswith(PACKAGE)]
    outside = [f for f in frames if not f.filename.startswith(TORCH)]
    f = (ours or outside or frames)[-1]
    return f"{os.path.relpath(f.filename, os.path.dirname(PACKAGE))}:{f.lineno} {f.name}"


def _maker(frames: list) -> str:
    """Whose code made the call: ``megatron_edgc`` when the innermost frame outside torch
    is this package's, else that frame's file (megatron-core's, a test's)."""
    outside = [f for f in frames if not f.filename.startswith(TORCH)]
    if not outside:
        return "torch"
    return "megatron_edgc" if outside[-1].filename.startswith(PACKAGE) else outside[-1].filename


class HostSyncCounter(TorchFunctionMode):
    """``with HostSyncCounter() as syncs: ...``; ``syncs.calls`` lists ``(name, where)``.

    ``torch.cuda.synchronize`` is counted too (it is no torch function: patched while
    the counter is active), and so is each ``(owner, attribute)`` of ``also``.
    ``syncs.syncs`` holds the same calls as dicts with ``maker`` (:func:`_maker`) and
    ``tag`` (what ``tag()`` returned at the call)."""

    def __init__(self, also: tuple = (), tag=lambda: None):
        super().__init__()
        self.calls: list = []
        self.syncs: list = []
        self._also = [(owner, name) for owner, name in also]
        self._tag = tag
        self._saved: list = []

    def _count(self, name: str) -> None:
        frames = _frames()
        where = _caller(frames)
        self.calls.append((name, where))
        self.syncs.append({"call": name, "where": where, "maker": _maker(frames),
                           "tag": self._tag()})

    def _patch(self, owner, attr: str, name: str) -> None:
        original = getattr(owner, attr)
        counter = self

        def counted(*args, **kwargs):
            counter._count(name)
            return original(*args, **kwargs)

        self._saved.append((owner, attr, original))
        setattr(owner, attr, counted)

    def __enter__(self):
        self._patch(torch.cuda, "synchronize", "torch.cuda.synchronize")
        for owner, attr in self._also:
            self._patch(owner, attr, f"{owner.__name__}.{attr}")
        return super().__enter__()

    def __exit__(self, *exc):
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved = []
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_host_sync(func, args, kwargs):
            self._count(getattr(func, "__qualname__", None)
                        or getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


# ---------------------------------------------------------------------- a trainer job


def main(out_dir: str, argv: list) -> int:
    """Train with ``argv``; every rank writes the host syncs of its whole run, each tagged
    with the 1-based iteration it falls in (0: before the first; an iteration runs from
    the start of its step to the start of the next one, so its records, evaluation,
    checkpoint and log line are its own)."""
    sys.path.insert(0, os.path.dirname(PACKAGE))
    from megatron_edgc.config import parse_config
    from megatron_edgc.patches.timing import IntervalClock
    from megatron_edgc.training.launch import spawn_local
    from megatron_edgc.training.loop import Trainer, init_worker, shutdown_worker

    cfg = parse_config(argv)
    os.makedirs(out_dir, exist_ok=True)

    def target(rank, world, local):
        init_worker(cfg, rank, world, local)
        try:
            trainer = Trainer(cfg)
            current = [0]
            step = trainer.train_step

            def tagged_step():
                current[0] = trainer.iteration + 1
                return step()

            trainer.train_step = tagged_step
            with HostSyncCounter(also=[(IntervalClock, "wait")],
                                 tag=lambda: current[0]) as counter:
                trainer.run()
            with open(os.path.join(out_dir, f"syncs_rank{rank}.json"), "w") as fh:
                json.dump({"rank": rank, "syncs": counter.syncs}, fh)
            return 0
        finally:
            shutdown_worker()

    return spawn_local(target, cfg.parallel.world_size)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
