"""Count the host syncs a piece of code would make on a GPU, on any device.

On a GPU the host waits for the device whenever it needs a tensor's value (``.item()``,
``if tensor:``, ``.tolist()``, ``float(t)``, a copy to the CPU), copies host data to the
device (``torch.tensor(data, device=...)``: a synchronous copy), or asks for a shape that
depends on the data (``nonzero``, boolean-mask indexing). :class:`HostSyncCounter` is a
``TorchFunctionMode`` that records every such call made while it is active, with the
innermost ``megatron_edgc`` source line that made it, so a CPU test can assert that a
step makes none. Copies between devices (``.to``, ``copy_``, ``.cuda()``) are counted
when source and target devices differ, which on a CPU-only machine never happens.
"""

from __future__ import annotations

import os
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


def _caller() -> str:
    """``file:line function`` of the innermost frame in megatron_edgc (its CPU shims of
    torch's factories aside), else of the innermost one outside torch."""
    frames = traceback.extract_stack()[:-2]  # without this function and its caller
    frames = [f for f in frames if f.filename != CPU_SHIMS]
    ours = [f for f in frames if f.filename.startswith(PACKAGE)]
    outside = [f for f in frames if not f.filename.startswith(TORCH)]
    f = (ours or outside or frames)[-1]
    return f"{os.path.relpath(f.filename, os.path.dirname(PACKAGE))}:{f.lineno} {f.name}"


class HostSyncCounter(TorchFunctionMode):
    """``with HostSyncCounter() as syncs: ...``; ``syncs.calls`` lists ``(name, where)``.

    ``torch.cuda.synchronize`` is counted too (it is no torch function: patched while
    the counter is active)."""

    def __init__(self):
        super().__init__()
        self.calls: list = []

    def __enter__(self):
        self._synchronize = torch.cuda.synchronize

        def synchronize(*args, **kwargs):
            self.calls.append(("torch.cuda.synchronize", _caller()))
            return self._synchronize(*args, **kwargs)

        torch.cuda.synchronize = synchronize
        return super().__enter__()

    def __exit__(self, *exc):
        torch.cuda.synchronize = self._synchronize
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_host_sync(func, args, kwargs):
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", str(func))
            self.calls.append((name, _caller()))
        return func(*args, **kwargs)
