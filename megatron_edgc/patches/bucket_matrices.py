"""The matrices a DDP bucket holds and where: each parameter's gradient viewed as a matrix,
and MoE's stacked experts (megatron-core's legacy ``GroupedMLP``) split into one matrix per
expert."""

from __future__ import annotations

from megatron_edgc.compression.matrices import matrix_shape
from megatron_edgc.patches.megatron_buckets import grad_in_buffer


def stacked_expert_shapes(module) -> dict:
    """``{parameter: (experts, n, m)}`` of the parameters that stack several MoE experts'
    weights: megatron-core's legacy ``GroupedMLP`` (``--moe-grouped-gemm`` without
    Transformer Engine) keeps ``weight1`` as ``[hidden, E·ffn]`` and ``weight2`` as
    ``[E·ffn, hidden]`` and multiplies ``weight1.view(E, hidden, -1)`` and
    ``weight2.view(E, -1, hidden)``: expert ``e``'s matrix is the ``e``-th contiguous
    block of the parameter, so each is compressed as its own matrix. Transformer Engine's
    grouped MLP and the sequential one keep one parameter per expert already."""
    out = {}
    for sub in module.modules():
        experts = getattr(sub, "num_local_experts", None)
        w1, w2 = getattr(sub, "weight1", None), getattr(sub, "weight2", None)
        if not isinstance(experts, int) or experts < 2 or w1 is None or w2 is None \
                or w1.dim() != 2 or w2.dim() != 2:
            continue
        hidden = w1.shape[0]
        out[w1] = (experts, hidden, w1.numel() // (experts * hidden))
        out[w2] = (experts, w2.numel() // (experts * hidden), hidden)
    return out


def matrix_entries(name: str, param, stacked: dict) -> list:
    """``(entry name, (n, m), param, expert index or None)`` of the matrices ``param``
    holds: one, or one per expert of a stacked parameter."""
    if param in stacked:
        experts, n, m = stacked[param]
        return [(f"{name}.expert{e}", (n, m), param, e) for e in range(experts)]
    return [(name, matrix_shape(param.shape), param, None)]


def bucket_matrices(bucket, names: dict, stacked: dict) -> list:
    """``(name, (n, m), offset in the bucket)`` of every matrix of ``bucket``, in bucket
    order (``names``: parameter -> its name)."""
    base = bucket.grad_data.data_ptr()
    size = bucket.grad_data.element_size()
    return [(name, shape, (grad_in_buffer(p).data_ptr() - base) // size
             + (e or 0) * shape[0] * shape[1])
            for p in bucket.params_list
            for name, shape, _, e in matrix_entries(names[p], p, stacked)]
