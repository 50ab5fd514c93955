"""One compressed bucket step, captured and replayed phase by phase (``--edgc-debug-dump``,
``scripts/replay_step.py``; issue 50).

A capture holds what a :class:`~megatron_edgc.compression.powersgd.BucketCompressor` step
read — each shape group's gradients ``G`` (before the error feedback is added), residual
``E`` (net of the loss scale), warm start ``Q``, rank, dtypes, the step's loss scale
``s`` (1 without a scaler: ``M = G + s·E``) — and the two summed factors it received from its
collectives. From that one rank's capture, :func:`replay` reruns the step on any device
with no collective, phase by phase, the orthonormalization stage by stage, so the first
phase whose output is not finite can be named where the failure happened (a GPU) and
compared with another device (the CPU).
"""

from __future__ import annotations

from typing import Sequence

import torch

from megatron_edgc.compression.kernels import split_factors
from megatron_edgc.compression.orthonormal import orthonormalize

_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}


def _copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


class StepCapture:
    """The inputs of one step of ``comp`` over ``grads`` (copies, made before ``start``),
    then the summed buffers of its two collectives (:meth:`summed`); :attr:`record` is
    what :func:`replay` reads (CPU tensors)."""

    def __init__(self, comp, grads: Sequence[torch.Tensor], **about):
        self.comp = comp
        self._p_sums: list = []   # each group's summed P, on the step's device
        scale = comp.loss_scale
        self.record = dict(about, factor_dtype=str(comp.factor_dtype),
                           ef_dtype=str(comp.ef_dtype), groups=[],
                           loss_scale=1.0 if scale is None else _copy(scale.float().view(1)))
        for key, g in comp.groups.items():
            self.record["groups"].append(dict(
                key=key, names=list(g.names), n=g.n, m=g.m, rank=comp._rank_for(g),
                grad=_copy(torch.stack([grads[i] for i in g.indices])),
                residual=_copy(g.residual), q=_copy(g.q)))

    def summed(self, phase: str, reduced: Sequence[torch.Tensor]) -> None:
        """The summed buffers of ``phase`` (``"p"``: ``[P | dense | flag]``, ``"q"``:
        ``[Q]``), split into each group's factor."""
        first, second = self.comp.layouts()
        layout = first if phase == "p" else second
        buf, _, flag = layout.unpack([_copy(b) for b in reduced])
        shapes = [(len(g.indices), g.n if phase == "p" else g.m, self.comp._rank_for(g))
                  for g in self.comp.groups.values()]
        for group, factor in zip(self.record["groups"], split_factors(buf[:layout.factors],
                                                                      shapes)):
            group[f"{phase}_sum"] = factor
        if flag is not None:
            self.record["flagged_by_a_rank"] = bool(flag.any())
        if phase == "p":
            self._p_sums = split_factors(reduced[0][:layout.factors], shapes)

    def stood_in_factors(self) -> dict:
        """The summed ``P`` of each matrix whose basis stands in when orthonormalized again
        on the step's device, with what that device did (``[n, r]`` each, fp32, on the
        CPU): small enough to bring back from a GPU whose whole capture is gigabytes
        (:func:`replay_factors` reruns them, batched and one at a time)."""
        out = dict({k: self.record[k] for k in ("iteration", "rank", "bucket")}, groups=[])
        for group, p in zip(self.record["groups"], self._p_sums):
            stood_in: list = []
            orthonormalize(p, stood_in=stood_in)
            which = stood_in[0].nonzero().view(-1).cpu()
            if which.numel():
                out["groups"].append(dict(key=group["key"], n=p.shape[1], rank=p.shape[2],
                                          batch=p.shape[0], indices=which.tolist(),
                                          p=_copy(p[which.to(p.device)])))
        out["device"] = str(self._p_sums[0].device) if self._p_sums else "cpu"
        return out


def replay(record: dict, device="cpu") -> list:
    """``[(group key, phase, finite)]`` of every phase of the captured step rerun on
    ``device``, in order: the inputs, ``M = G + s·E`` (``s``: the step's loss scale), this
    rank's ``P``, the captured sum,
    the orthonormalization's four stages, this rank's ``Q``, the captured sum, the residual
    and the decompressed gradient."""
    out = []
    factor_dtype = _DTYPES[record["factor_dtype"]]
    scale = record.get("loss_scale", 1.0)   # a capture of before issue 71: 1
    scale = scale.to(device) if isinstance(scale, torch.Tensor) else scale
    for g in record["groups"]:
        def see(phase, x, key=g["key"]):
            out.append((key, phase, bool(torch.isfinite(x).all())))

        grad, residual, q = (g[name].to(device) for name in ("grad", "residual", "q"))
        see("input: gradient G", grad)
        see("input: residual E", residual)
        see("input: warm start Q", q)
        m = grad.float() + residual.float() * scale
        see("M = G + s·E", m)
        p = torch.bmm(m, q.float())
        see("P = M Q (this rank)", p)
        see("P on the wire (factor dtype)", p.to(factor_dtype))
        if "p_sum" not in g:
            continue
        p_sum = g["p_sum"].to(device).float()
        see("P summed (captured)", p_sum)
        p_hat = orthonormalize(p_sum,
                               trace=lambda stage, x: see(f"orthonormalize {stage}", x))
        q_local = torch.bmm(m.transpose(1, 2), p_hat)
        see("Q = Mᵀ P^ (this rank)", q_local)
        q_sent = q_local.to(factor_dtype).float()
        see("(M - P^ Qᵀ)/s (the new residual)",
            torch.baddbmm(m, p_hat, q_sent.transpose(1, 2), alpha=-1) / scale)
        if "q_sum" not in g:
            continue
        q_sum = g["q_sum"].to(device).float()
        see("Q summed (captured)", q_sum)
        see("P^ (ΣQ)ᵀ (the decompressed gradient)", torch.bmm(p_hat, q_sum.transpose(1, 2)))
    return out


def replay_factors(record: dict, device="cpu") -> list:
    """``[(group key, how, matrices stood in, of how many, the smallest eigenvalue of the
    unit-column Gram in fp64)]`` of :meth:`StepCapture.stood_in_factors`' matrices
    orthonormalized again on ``device``: batched as the step does, and one matrix at a
    time (cuSOLVER's batched Cholesky against its single-matrix one)."""
    out = []
    for g in record["groups"]:
        p = g["p"].to(device)
        x = p.double() / torch.linalg.vector_norm(p.double(), dim=1, keepdim=True).clamp_min(
            1e-300)
        smallest = float(torch.linalg.eigvalsh(x.transpose(1, 2) @ x)[:, 0].min())
        for how, parts in (("batched", [p]), ("one at a time", list(p.split(1)))):
            stood_in: list = []
            for part in parts:
                orthonormalize(part, stood_in=stood_in)
            out.append((g["key"], how, int(torch.cat(stood_in).sum()), p.shape[0], smallest))
    return out
