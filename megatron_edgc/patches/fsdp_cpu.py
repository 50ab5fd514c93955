"""Megatron-FSDP (megatron-core's ``distributed/fsdp``) on CPU processes with gloo.

On top of :func:`megatron_edgc.patches.cpu.apply_cpu_shims` (CUDA devices mapped to the
CPU, null streams and events, ``torch.cuda.synchronize`` a no-op), which already carries
Megatron-FSDP's streams, its ``cuda:<device>`` defaults and its ``device="cuda"`` tensors,
Megatron-FSDP needs (0.16.1 read; docs/megatron-fsdp-cpu.md lists each with its error):

* a CPU device mesh: the adapter builds its ``DeviceMesh`` with ``device_type="cuda"``;
  any mesh derived from it (``DeviceMesh._flatten``, as Megatron-FSDP's uneven DTensor
  gather makes) calls ``torch.cuda.set_device`` and fails without CUDA (training itself
  makes none);
* full-length placements on a parameter replicated over the HSDP mesh: for an unsharded
  parameter (inner ``no_shard``) ``_get_fsdp_tensor_spec`` returns ``[Replicate()]`` for a
  2-D (outer, inner) mesh; torch 2.13's sharding propagation refuses the optimizer's
  in-place ops on it (a torch-version matter, not a CPU one: see the doc's GPU checklist);
  the placement is completed with ``Replicate()`` over every mesh dimension.

Not shimmed but to set in the configuration on CPU: ``gradient_reduce_div_fusion=False``
(its ``_make_nccl_premul_sum`` is NCCL's), ``average_in_collective=False`` (gloo refuses
``ReduceOp.AVG``), ``nccl_ub=False`` and ``fsdp_double_buffer=False`` (``torch.cuda.MemPool``
and NCCL user-buffer registration). Applied once, before the model is wrapped, only when
CUDA is absent; checked by feature (the names patched must exist, or one line says which
is missing).
"""

from __future__ import annotations

import functools

import torch

from megatron_edgc.patches.features import UnsupportedMegatronVersion, _Missing, resolve

_ADAPTER = "megatron.core.distributed.fsdp.mcore_fsdp_adapter"
_BUFFER = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"
_applied = False


def missing() -> list:
    """What the shims patch and megatron-core lacks (empty: all present)."""
    out = []
    for module, path in ((_ADAPTER, "DeviceMesh.from_group"), (_BUFFER, "_get_fsdp_tensor_spec"),
                         (_BUFFER, "make_fsdp_dtensor")):
        try:
            resolve(module, path)
        except _Missing as exc:
            out.append(str(exc))
    try:
        from megatron_edgc.patches.features import looks_up

        looks_up(_BUFFER, "make_fsdp_dtensor", "_get_fsdp_tensor_spec")
    except _Missing as exc:
        out.append(str(exc))
    return out


class _CpuDeviceMesh:
    """The adapter's ``DeviceMesh`` name: ``from_group`` builds a CPU mesh (shim 1)."""

    def __init__(self, device_mesh_cls):
        self._cls = device_mesh_cls

    def from_group(self, *args, **kwargs):
        if kwargs.get("device_type") == "cuda":
            kwargs["device_type"] = "cpu"
        return self._cls.from_group(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._cls, name)


def _full_placements(original):
    """``_get_fsdp_tensor_spec`` with one placement per mesh dimension (shim 2)."""

    @functools.wraps(original)
    def spec(*args, **kwargs):
        from torch.distributed.tensor import Replicate

        device_mesh, placements = original(*args, **kwargs)
        missing_dims = device_mesh.ndim - len(placements)
        if missing_dims > 0 and all(p.is_replicate() for p in placements):
            placements = [Replicate()] * device_mesh.ndim
        return device_mesh, placements

    spec.__edgc_cpu_shim__ = True
    return spec


def apply_fsdp_cpu_shims() -> bool:
    """Install the Megatron-FSDP CPU shims if CUDA is absent; returns whether they are
    active. The general CPU shims (:func:`~megatron_edgc.patches.cpu.apply_cpu_shims`) must
    be applied as well."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    absent = missing()
    if absent:
        raise UnsupportedMegatronVersion(
            "megatron-core lacks what the Megatron-FSDP CPU shims patch: " + "; ".join(absent))
    import importlib

    adapter = importlib.import_module(_ADAPTER)
    buffer = importlib.import_module(_BUFFER)
    adapter.DeviceMesh = _CpuDeviceMesh(adapter.DeviceMesh)
    if not getattr(buffer._get_fsdp_tensor_spec, "__edgc_cpu_shim__", False):
        buffer._get_fsdp_tensor_spec = _full_placements(buffer._get_fsdp_tensor_spec)
    _applied = True
    return True
