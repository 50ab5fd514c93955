"""PowerSGD on megatron-core's data-parallel gradient sync (EDGC §1).

megatron-core (0.13.1 ... 0.16.1) reduces gradients per bucket group in
``_ParamAndGradBucketGroup.start_grad_sync`` (scale by ``gradient_scaling_factor``, then
all-reduce, or reduce-scatter for the distributed optimizer, async with
``overlap_grad_reduce``) and waits in ``finish_grad_sync``. With compression on, this
module replaces those two methods on each bucket-group *instance*:

* start: scale as Megatron does, then for each bucket compute ``P = (G + E) Q`` and launch
  one SUM all-reduce of ``[P... | dense rest | non-finite flag]`` (with bf16 factors two:
  ``[P...]`` in bf16 and ``[dense rest | flag]`` in fp32, the flag riding with ``P`` in a
  bucket without a dense rest) — asynchronously when
  ``overlap_grad_reduce`` is on, so each bucket goes out as soon as it is ready;
* finish: per bucket, wait, orthonormalize and launch the ``Q`` all-reduce (async, so one
  bucket's ``Q`` travels while the next is orthonormalized); then, as the ``Q``s land,
  write the decompressed average into the bucket's ``grad_data`` — on every rank, so with
  the distributed optimizer each rank simply reads its shard of it (the all-reduce
  replaces the reduce-scatter).

Everything after (the tied-embedding sync between first and last stage, gradient
clipping, the optimizer) sees an ordinary reduced gradient — or, where some rank's bucket
held a NaN/Inf, a bucket with NaN in it, which the optimizer's own non-finite handling
acts on (error feedback is left untouched, see ``compression/powersgd.py``).

Neither method waits for the device: under ``overlap_grad_reduce`` the start runs inside
backward, where a host sync would stall the queueing of backward kernels. The non-finite
decision is taken on the device (every rank holds the same summed flag, so every rank
issues the same collectives), and the step's times and non-finite count are collected as
CUDA events and device tensors and resolved by :meth:`DPSyncStats.resolve`, once per step
after the step's work (``runtime/step.py``).

With compression off nothing is patched, and training is bit-identical to plain
megatron-core. Before ``start_iter`` (and whenever the rank table says "dense") the
original methods run.
"""

from __future__ import annotations

import logging
import time
import types
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_edgc.compression.bypass import LinkModel, compression_saving_s
from megatron_edgc.compression.powersgd import FLOAT_BYTES, BucketCompressor, matrix_shape
from megatron_edgc.compression.shard import shard_pieces
from megatron_edgc.compression.shard_powersgd import ShardCompressor, shard_compressor_inputs
from megatron_edgc.patches import features
from megatron_edgc.patches.dp_stats import DPSyncStats
from megatron_edgc.patches.timing import IntervalClock

logger = logging.getLogger(__name__)

#: Attributes of a live bucket group / bucket the patch reads or writes.
_GROUP_ATTRIBUTES = ("buckets", "ddp_config", "grad_reduce_handle", "param_gather_dispatched")
_BUCKET_ATTRIBUTES = ("grad_data", "params_list", "gradient_scaling_factor")


def _require_attributes(obj, names, what: str) -> None:
    for name in names:
        if not hasattr(obj, name):
            raise features.UnsupportedMegatronVersion(
                f"megatron-core {features.megatron_core_version()} lacks {what}.{name} "
                f"(the ddp patch); supported versions: "
                f"{', '.join(features.SUPPORTED_MEGATRON_CORE_VERSIONS)}")


class _PendingSync:
    """The in-flight first collective of a bucket group; ``wait()`` completes the sync."""

    def __init__(self, finish: Callable[[], None]):
        self._finish = finish

    def wait(self) -> None:
        self._finish()


def _bucket_grad_bytes(bucket) -> int:
    return bucket.grad_data.numel() * bucket.grad_data.element_size()


def reduction_group(bucket_group):
    """The process group megatron-core reduces ``bucket_group`` on: the one it was built
    with (``_ParamAndGradBucketGroup.__init__``), kept as
    ``intra_distributed_optimizer_instance_group`` with the distributed optimizer and as
    ``data_parallel_group`` without. DDP builds dense buckets on the DP×CP group and
    expert-parallel ones (MoE) on the expert-data-parallel group."""
    if bucket_group.ddp_config.use_distributed_optimizer:
        name = "intra_distributed_optimizer_instance_group"
    else:
        name = "data_parallel_group"
    _require_attributes(bucket_group, (name,), "_ParamAndGradBucketGroup")
    return getattr(bucket_group, name)


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


def _matrix_entries(name: str, param, stacked: dict) -> list:
    """``(entry name, (n, m), param, expert index or None)`` of the matrices ``param``
    holds: one, or one per expert of a stacked parameter."""
    if param in stacked:
        experts, n, m = stacked[param]
        return [(f"{name}.expert{e}", (n, m), param, e) for e in range(experts)]
    return [(name, matrix_shape(param.shape), param, None)]


def _in_buffer(param) -> torch.Tensor:
    """A parameter's gradient in its bucket's ``grad_data``: its ``main_grad``, or where
    megatron-core 0.19+ accumulates it apart in fp32
    (``param_name_patterns_for_fp32_local_accumulation``) the slice it copies it into."""
    copy = getattr(param, "main_grad_copy_in_grad_buffer", None)
    return param.main_grad if copy is None else copy


def _copy_extra_main_grads(bucket, into_buffer: bool) -> None:
    """megatron-core 0.19+: the fp32 ``main_grad``s kept apart from the bucket, copied into
    it before the reduction and back after (as its own start/finish_grad_sync do)."""
    for param in getattr(bucket, "params_with_extra_main_grads", ()):
        copy = getattr(param, "main_grad_copy_in_grad_buffer", None)
        if copy is None:
            continue
        if into_buffer:
            copy.copy_(param.main_grad)
        else:
            param.main_grad.copy_(copy)


def _bits_digest(data: torch.Tensor, chunk: int = 1 << 24) -> torch.Tensor:
    """An int64 digest of ``data``'s bits (each element's integer view weighted by its
    position mod a prime): equal tensors give equal digests, a flipped bit changes it.
    Chunked, so the temporaries stay at ``chunk`` elements."""
    ints = data.detach().reshape(-1).view({1: torch.int8, 2: torch.int16, 4: torch.int32,
                                           8: torch.int64}[data.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, ints.numel(), chunk):
        part = ints[start:start + chunk].to(torch.int64)
        weight = torch.arange(start, start + part.numel(), device=data.device) % 65521 + 1
        total += (part * weight).sum()
    return total


def _bucket_digest(bucket) -> torch.Tensor:
    """The digest of a bucket's parameters: its slice of the parameter buffer (the
    distributed optimizer's), else each parameter's, weighted by its place."""
    if getattr(bucket, "param_data", None) is not None:
        return _bits_digest(bucket.param_data)
    return sum((i + 1) * _bits_digest(p.data) for i, p in enumerate(bucket.params_list))


@dataclass
class _GroupInfo:
    """A bucket group's reduction: the process group the compressed collectives run on,
    whether it holds expert parameters, and with Megatron's partial distributed optimizer
    (``--num-distributed-optimizer-instances`` > 1) the instance's group, whose dense
    reduce-scatter comes first (``process_group`` is then the inter-instance group: the
    slow hop, where only this rank's shard is compressed)."""

    process_group: object
    size: int
    expert: bool
    intra: object = None
    intra_size: int = 1
    intra_rank: int = 0

    @property
    def slow_hop(self) -> bool:
        return self.intra is not None


def _reduction_info(bucket_group, expert: bool) -> _GroupInfo:
    instances = getattr(bucket_group.ddp_config, "num_distributed_optimizer_instances", 1)
    if instances > 1:
        names = ("intra_distributed_optimizer_instance_group",
                 "intra_distributed_optimizer_instance_size",
                 "intra_distributed_optimizer_instance_rank",
                 "inter_distributed_optimizer_instance_group")
        _require_attributes(bucket_group, names, "_ParamAndGradBucketGroup")
        inter = bucket_group.inter_distributed_optimizer_instance_group
        return _GroupInfo(inter, dist.get_world_size(inter), expert,
                          intra=bucket_group.intra_distributed_optimizer_instance_group,
                          intra_size=bucket_group.intra_distributed_optimizer_instance_size,
                          intra_rank=bucket_group.intra_distributed_optimizer_instance_rank)
    pg = reduction_group(bucket_group)
    return _GroupInfo(pg, dist.get_world_size(pg), expert)


def megatron_sync_bytes(bucket_group) -> tuple:
    """``(bytes, of those across distributed-optimizer instances)`` that megatron-core's own
    sync of ``bucket_group`` places into collectives per iteration: each bucket over its
    group (nothing over a group of one), or with the partial distributed optimizer the
    whole bucket reduce-scattered inside the instance and this rank's shard across."""
    info = _reduction_info(bucket_group, expert=False)
    total = slow = 0
    for bucket in bucket_group.buckets:
        dense = _bucket_grad_bytes(bucket)
        if info.slow_hop:
            shard = dense // info.intra_size
            total, slow = total + dense + shard, slow + shard
        elif info.size > 1:
            total += dense
    return total, slow


def _shard_range(bucket, info: _GroupInfo) -> tuple:
    """This rank's shard of ``bucket`` after the instance's reduce-scatter (megatron-core's
    ``shard_buffer``: equal contiguous parts in intra-instance rank order)."""
    size = bucket.grad_data.numel() // info.intra_size
    return info.intra_rank * size, (info.intra_rank + 1) * size


class DPGradientCompression:
    """Owns one :class:`BucketCompressor` per DDP bucket and patches the bucket groups.

    Each bucket is compressed over the group megatron-core reduces it on
    (:func:`reduction_group`): dense buckets over DP (×CP), MoE experts' over the
    expert-data-parallel group; ``dp_group`` is only this rank's DP group for messages.
    With Megatron's partial distributed optimizer the instance's reduce-scatter stays
    dense and only this rank's shard of each bucket is compressed, across instances
    (:mod:`megatron_edgc.compression.shard`): the math and the error feedback per rank
    are 1/s of the bucket's (s ranks per instance).

    ``rank`` is a static rank or the controller's entry for this pipeline stage, ``None``
    meaning dense (EDGC's warm-up); ``iteration`` is set by the training loop and
    compression runs from ``start_iter`` on. ``entropy_probe``, when set, is shown every
    bucket's local gradient before the sync (the entropy sampler reads it there);
    ``sync_end_hook``, when set, is called as each bucket group's sync completes (DAC's
    timer keeps the last call).

    ``bypass="auto"`` sends a bucket dense when compressing it would not pay
    (:mod:`megatron_edgc.compression.bypass`): the DP link is measured once (or declared
    with ``link``), each bucket's compress + decompress time once per rank, both reduced
    with MAX over the bucket's group so every replica of it takes the same decision.
    """

    def __init__(self, chunks, dp_group, *, rank: Optional[int], min_compression_rate: float,
                 start_iter: int, seed: int, bypass: str = "off",
                 link: Optional[LinkModel] = None, factor_dtype: torch.dtype = torch.float32,
                 ef_dtype: torch.dtype = torch.float32, compress_single_replica: bool = False):
        features.require("ddp")
        # megatron-core 0.16.x: start/finish_grad_sync(force_all_reduce=False) and a
        # first-batch mode; 0.13.x-0.15.x: no argument, no first-batch mode.
        self._takes_force_all_reduce = features.grad_sync_takes_force_all_reduce()
        self.dp_group = dp_group
        self.rank = rank
        self.start_iter = start_iter
        self.iteration = 0
        self.stats = DPSyncStats()  # its clock is set below, from the buckets' device
        self.entropy_probe: Optional[Callable[[str, torch.Tensor], None]] = None
        self.sync_end_hook: Optional[Callable[[], None]] = None  # after each group's sync
        self.compressors: dict[str, BucketCompressor] = {}
        self._bucket_key: dict[int, str] = {}
        self._buckets: dict = {}
        self._bucket_bytes: dict[str, int] = {}
        self.bucket_groups = []
        self.bypass = bypass
        self.link = link     # the dense buckets' link (declared: every group's)
        self._declared_link = link
        self.links: dict = {}  # process group -> LinkModel (measured or declared)
        self._group_of: dict[str, _GroupInfo] = {}  # bucket key -> its reduction
        self._megatron_bytes: dict[int, tuple] = {}  # id(bucket group) -> its own sync's
        self._matrices: dict[str, list] = {}     # bucket key -> [((n, m), bucket offset)]
        self._param_names: dict[str, list] = {}  # bucket key -> [(name, param)]
        self._cost_model: Optional[dict[str, tuple[float, float]]] = None  # bucket -> (a, b)
        self.dense_keys: frozenset = frozenset()       # buckets the bypass sends dense
        self._rank_setting: tuple = (rank, ())         # what the bypass decisions depend on
        self._agreed: dict = {}   # rank setting -> decisions agreed inside the instances
        self.seed = seed
        # buckets reduced over one replica: left to megatron-core unless validating
        self.compress_single_replica = compress_single_replica
        for ci, chunk in enumerate(chunks):
            names = {p: f"chunk{ci}.{n}" for n, p in chunk.module.named_parameters()}
            stacked = stacked_expert_shapes(chunk.module)
            dense_groups = list(chunk.bucket_groups)
            for gi, group in enumerate(dense_groups + chunk.expert_parallel_bucket_groups):
                _require_attributes(group, _GROUP_ATTRIBUTES, "_ParamAndGradBucketGroup")
                info = _reduction_info(group, expert=gi >= len(dense_groups))
                self._megatron_bytes[id(group)] = megatron_sync_bytes(group)
                for bi, bucket in enumerate(group.buckets):
                    _require_attributes(bucket, _BUCKET_ATTRIBUTES, "_ParamAndGradBucket")
                    key = f"chunk{ci}.group{gi}.bucket{bi}"
                    base = bucket.grad_data.data_ptr()
                    size = bucket.grad_data.element_size()
                    # (name, (n, m), offset in the bucket) of every matrix
                    matrices = [(name, shape, (_in_buffer(p).data_ptr() - base) // size
                                 + (e or 0) * shape[0] * shape[1])
                                for p in bucket.params_list
                                for name, shape, _, e in _matrix_entries(names[p], p, stacked)]
                    settings = dict(min_compression_rate=min_compression_rate, seed=seed,
                                    device=bucket.grad_data.device,
                                    factor_dtype=factor_dtype, ef_dtype=ef_dtype)
                    if info.slow_hop:  # this rank's shard: row blocks and dense pieces
                        pieces = shard_pieces([(name, offset, shape)
                                               for name, shape, offset in matrices],
                                              *_shard_range(bucket, info))
                        entries, parents = shard_compressor_inputs(pieces, matrices)
                        self.compressors[key] = ShardCompressor(
                            entries, parents, [(name, shape) for name, shape, _ in matrices],
                            info.intra_size, rank or 1, **settings)
                        matrices = [(pc.name, pc.shape, pc.start) for pc in pieces]
                    else:
                        self.compressors[key] = BucketCompressor(
                            [(name, shape) for name, shape, _ in matrices], rank or 1,
                            **settings)
                    self._matrices[key] = [(shape, offset) for _, shape, offset in matrices]
                    self._param_names[key] = [(names[p], p) for p in bucket.params_list]
                    self._bucket_key[id(bucket)] = key
                    self._buckets[key] = bucket
                    self._bucket_bytes[key] = _bucket_grad_bytes(bucket)
                    self._group_of[key] = info
                self._patch(group)
                self.bucket_groups.append(group)
        devices = {c.device for c in self.compressors.values()}
        self.stats.clock = IntervalClock(use_cuda=any(
            d is not None and torch.device(d).type == "cuda" for d in devices))

    # ------------------------------------------------------------------ control

    @property
    def active(self) -> bool:
        return self.rank is not None and self.iteration >= self.start_iter

    def set_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self.stats.reset()

    def prepare_iteration(self) -> None:
        """Bypass decisions for this iteration's rank (call after the rank is set, outside
        the schedule: the first call per rank runs collectives on each bucket's group)."""
        if self.bypass != "auto" or not self.active:
            self.dense_keys = frozenset()
            return
        for i, (pg, expert) in enumerate(self._process_groups()):
            if pg not in self.links:
                self.links[pg] = self._declared_link or self._measure_link(pg)
                if self._declared_link is None:
                    logger.info("bypass: %s all-reduce %.3g Gbit/s, alpha %.3g ms",
                                "expert-DP" if expert else "DP", self.links[pg].gbit_per_s,
                                self.links[pg].alpha_s * 1e3)
            if i == 0:
                self.link = self.links[pg]
        if self._cost_model is None:
            self._cost_model = self._measure_cost_model()
        costs = {key: max(0.0, a + b * self.rank) for key, (a, b) in self._cost_model.items()}
        dense, savings = set(), {}
        for key, comp in self.compressors.items():
            info = self._group_of[key]
            _, second = comp.collective_bytes()
            # the dense alternative: the bucket, or on the slow hop this rank's shard of it
            savings[key] = compression_saving_s(self.links[info.process_group],
                                                self._bucket_bytes[key] // info.intra_size,
                                                comp.first_collectives(), second)
            if savings[key] <= costs[key]:
                dense.add(key)
        dense = self._agree_inside_instances(dense)
        for key in self.compressors:
            if key not in dense:
                self.stats.predicted_saving_s += savings[key]
                self.stats.predicted_cost_s += costs[key]
        if dense != self.dense_keys:
            self.stats.events.append(
                f"bypass at rank {self.rank}: {len(dense)} of {len(self.compressors)} buckets "
                f"sent dense (link {self.link.gbit_per_s:.3g} Gbit/s)")
        self.dense_keys = frozenset(dense)

    def _agree_inside_instances(self, dense: set) -> frozenset:
        """On the slow hop the ranks of an instance hold different shards, so their savings
        and costs differ; but a compressed bucket also runs collectives inside the
        instance, so every rank of it must decide alike: a bucket goes dense where any
        rank of its instance would send it dense (MAX over the instance). The ranks
        holding the same shard in other instances already agree (same bytes, costs and
        link MAX-reduced over their group). Collectives once per rank setting (the
        decisions depend on nothing else), outside the schedule."""
        intra = {id(i.intra): i.intra for i in self._group_of.values() if i.slow_hop}
        if not intra:
            return frozenset(dense)
        if self._rank_setting not in self._agreed:
            agreed = set(dense)
            device = next(iter(self.compressors.values())).device
            for group in intra.values():
                keys = sorted(k for k, i in self._group_of.items() if i.intra is group)
                flags = torch.tensor([float(k in dense) for k in keys], device=device)
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
                agreed |= {k for k, f in zip(keys, flags.tolist()) if f > 0}
            self._agreed[self._rank_setting] = frozenset(agreed)
        return self._agreed[self._rank_setting]

    def _timed(self, fn) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    def _process_groups(self) -> list:
        """``(process group, expert)`` of each distinct reduction group, in bucket order
        (dense before expert on every rank, so every member issues their collectives in the
        same order)."""
        seen = {}
        for key in self.compressors:
            info = self._group_of[key]
            seen.setdefault(id(info.process_group), (info.process_group, info.expert))
        return list(seen.values())

    def _measure_link(self, group) -> LinkModel:
        """α and β of an all-reduce on ``group``, from 1 KiB and 4 MiB buffers (a
        smaller large size drowns β in α's noise): mean of three back-to-back all-reduces
        (which absorbs the replicas' skew after the barrier), best of two, slowest replica."""
        device = next(iter(self.compressors.values())).device
        sizes = [256, 1 << 20]
        times = []

        def three(buf):
            for _ in range(3):
                dist.all_reduce(buf, group=group)

        for numel in sizes:
            buf = torch.zeros(numel, dtype=torch.float32, device=device)
            dist.all_reduce(buf, group=group)  # connection warm-up
            best = float("inf")
            for _ in range(2):
                dist.barrier(group=group)
                best = min(best, self._timed(lambda: three(buf)) / 3)
            times.append(best)
        worst = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
        return LinkModel.fit([n * FLOAT_BYTES for n in sizes], worst.tolist())

    def _measure_cost_model(self) -> dict:
        """Compress + decompress time of every bucket as ``a + b·rank``: timed at the current
        rank and at half of it (once; EDGC's later ranks are predicted, not re-timed), on
        random gradients with a scratch compressor (the real state is untouched); the
        slowest replica's times (MAX over each bucket's reduction group)."""
        keys = sorted(self.compressors)
        r1 = self.rank
        r2 = r1 // 2 if r1 > 1 else 2
        times = []
        for rank in (r1, r2):
            for key in keys:
                scratch = self.compressors[key].fresh(rank)
                grads = self._scratch_grads(key)

                def once():
                    scratch.local_step(grads)

                once()  # allocates Q and the residual
                times.append(min(self._timed(once), self._timed(once)))
        device = next(iter(self.compressors.values())).device
        for pg, _ in self._process_groups():
            at = [i for i, key in enumerate(keys) if self._group_of[key].process_group is pg]
            at += [len(keys) + i for i in at]
            worst = torch.tensor([times[i] for i in at], dtype=torch.float64, device=device)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=pg)
            for i, t in zip(at, worst.tolist()):
                times[i] = t
        c1, c2 = times[:len(keys)], times[len(keys):]
        model = {}
        for key, t1, t2 in zip(keys, c1, c2):
            b = max(0.0, (t1 - t2) / (r1 - r2))
            model[key] = (t1 - b * r1, b)
        return model

    def _scratch_grads(self, key: str) -> list:
        """Random gradients laid out as bucket ``key``'s (views of one buffer at the same
        offsets), so the timed step takes the strided path the real one takes."""
        bucket = self._buckets[key]
        scratch = torch.randn_like(bucket.grad_data)   # in the buffer's dtype, as the step
        return [scratch[o:o + shape[0] * shape[1]].view(shape)
                for shape, o in self._matrices[key]]

    def _grads(self, key: str) -> list:
        """Views of bucket ``key``'s gradients, one per matrix entry of its compressor
        (a parameter, an expert's block of a stacked one, a piece of this rank's shard)."""
        data = self._buckets[key].grad_data
        return [data[o:o + shape[0] * shape[1]].view(shape) for shape, o in self._matrices[key]]

    def set_rank(self, rank) -> None:
        """A new rank for every bucket (None: dense; the compressor state is kept); a dict
        ``{(n, m): rank}`` sets one rank per matrix shape (the budget controller)."""
        if isinstance(rank, dict):
            shape_ranks, rank = rank, max(rank.values(), default=1)
        else:
            shape_ranks = None
        self.rank = rank
        self._rank_setting = (rank, tuple(sorted((shape_ranks or {}).items())))
        if rank is not None:
            for comp in self.compressors.values():
                comp.set_rank(rank, shape_ranks)

    def shape_counts(self) -> dict:
        """``{(n, m): number of matrices}`` of this rank's buckets (vectors excluded)."""
        counts: dict = {}
        for comp in self.compressors.values():
            for n, m in comp.matrix_shapes():
                if n > 1 and m > 1:
                    counts[(n, m)] = counts.get((n, m), 0) + 1
        return counts

    def track_spectrum(self, on: bool = True) -> None:
        for comp in self.compressors.values():
            comp.track_spectrum = on

    def pop_spectrum(self) -> dict:
        """``{(n, m): (Σ‖M‖², Σ sorted column energies)}`` over all buckets since the last
        call (see :meth:`BucketCompressor._add_spectrum`), then cleared: a float and a CPU
        tensor (read from the device here, once per window)."""
        out: dict = {}
        for comp in self.compressors.values():
            for shape, (total, cols, _) in comp.spectrum.items():
                if shape in out and out[shape][1].numel() == cols.numel():
                    out[shape] = (out[shape][0] + total, out[shape][1] + cols)
                else:
                    out[shape] = (total, cols.clone())
            comp.spectrum = {}
        return {shape: (float(total), cols.cpu()) for shape, (total, cols) in out.items()}

    def bucket_grads(self):
        """(key, grad_data) of every bucket, in a fixed order."""
        for group in self.bucket_groups:
            for bucket in group.buckets:
                yield self._bucket_key[id(bucket)], bucket.grad_data

    def bucket_params(self):
        """(key, [(name, param), ...]) of every bucket, in the order of :meth:`bucket_grads`
        (a stacked-experts parameter once, under its own name)."""
        for group in self.bucket_groups:
            for bucket in group.buckets:
                key = self._bucket_key[id(bucket)]
                yield key, list(self._param_names[key])

    def replica_mismatches(self) -> int:
        """How many of this rank's buckets hold parameters that differ from another
        replica's in the bucket's reduction group (bit-exact: a digest of the parameter
        bits, MIN and MAX over the group). Collectives on every group; a debug check
        (``--edgc-check-replicas``)."""
        mismatches = 0
        groups = [(pg, lambda info, pg=pg: info.process_group is pg)
                  for pg, _ in self._process_groups()]
        intra = {id(i.intra): i.intra for i in self._group_of.values() if i.slow_hop}
        groups += [(g, lambda info, g=g: info.intra is g) for g in intra.values()]
        for pg, member in groups:
            keys = [k for k in self.compressors if member(self._group_of[k])]
            digest = torch.stack([_bucket_digest(self._buckets[k]) for k in keys])
            low, high = digest.clone(), digest
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=pg)
            dist.all_reduce(low, op=dist.ReduceOp.MIN, group=pg)
            mismatches += int((high != low).sum().item())  # a debug check: one sync
        return mismatches

    def state_bytes(self) -> int:
        """Error-feedback residuals and warm-start Q of this rank at the current rank."""
        return sum(c.state_bytes() for c in self.compressors.values())

    def dense_bytes_per_iteration(self) -> int:
        return sum(_bucket_grad_bytes(b) for g in self.bucket_groups for b in g.buckets)

    def compressed_bytes_per_iteration(self) -> int:
        return sum(sum(c.collective_bytes()) for c in self.compressors.values())

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {"rank": self.rank,
                "buckets": {k: c.state_dict() for k, c in self.compressors.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state["rank"] != self.rank:
            self.set_rank(state["rank"])
        for key, comp in self.compressors.items():
            if key not in state["buckets"]:
                logger.warning("no compressor state for %s in the checkpoint: starting fresh", key)
                continue
            bad = comp.load_state_dict(state["buckets"][key])
            if bad:
                logger.warning("compressor state of %s did not fit this model: reset", bad)

    # ------------------------------------------------------------------ the patch

    def _patch(self, group) -> None:
        original_start, original_finish = group.start_grad_sync, group.finish_grad_sync
        owner = self

        def original(fn, force_all_reduce):
            # 0.16.x passes force_all_reduce on; 0.13.x-0.15.x have no such argument (and
            # never ask for it: their callers pass nothing).
            if owner._takes_force_all_reduce:
                return fn(force_all_reduce=force_all_reduce)
            return fn()

        def first_batch(group) -> bool:
            # 0.16.x: with overlap_grad_reduce, the first batch's sync starts in
            # finish_grad_sync (is_first_batch); 0.13.x-0.15.x have no first-batch mode.
            return getattr(group, "is_first_batch", False)

        def start_grad_sync(self, force_all_reduce: Optional[bool] = False):
            if first_batch(self) and self.grad_reduce_handle is not None:
                return  # already dispatched in the first batch (mirrors megatron-core)
            if owner.entropy_probe is not None:
                for bucket in self.buckets:
                    owner.entropy_probe(owner._bucket_key[id(bucket)], bucket.grad_data)
            info = owner._group_info(self)
            if not owner.active or owner._single_replica(info):
                # a group of one replica (DP 1, or expert-DP 1 when EP = DP): nothing goes
                # on a wire, and compressing would only approximate: megatron-core's sync
                owner._count_dense(self, info)
                return original(original_start, force_all_reduce)
            assert self.grad_reduce_handle is None, \
                "Should not have multiple communication calls outstanding at once"
            owner._start(self)

        def finish_grad_sync(self, force_all_reduce: Optional[bool] = False):
            if not owner.active or owner._single_replica(owner._group_info(self)):
                original(original_finish, force_all_reduce)
            else:
                self.param_gather_dispatched = False
                if not self.ddp_config.overlap_grad_reduce or first_batch(self):
                    start_grad_sync(self, force_all_reduce)
                assert self.grad_reduce_handle is not None, "grad sync was not started"
                self.grad_reduce_handle.wait()
                self.grad_reduce_handle = None
            if owner.sync_end_hook is not None:
                owner.sync_end_hook()

        group.start_grad_sync = types.MethodType(start_grad_sync, group)
        group.finish_grad_sync = types.MethodType(finish_grad_sync, group)

    def _single_replica(self, info: _GroupInfo) -> bool:
        return info.size == 1 and not self.compress_single_replica

    def _count_dense(self, group, info: _GroupInfo) -> None:
        """The bytes megatron-core's own sync of ``group`` places into collectives."""
        total, slow = self._megatron_bytes[id(group)]
        self.stats.add_bytes(total - slow, total - slow, info.expert)
        self.stats.add_bytes(slow, slow, info.expert, slow_hop=True)

    def _slow_hop_start(self, comp: ShardCompressor, grads, info: _GroupInfo,
                        async_op: bool, dense_bytes: int) -> tuple:
        """The slow hop's first phase for one bucket (``compression/shard_powersgd.py``):
        ``[P_b at each matrix's place | flag]`` reduce-scattered inside the instance, this
        rank's slice launched across instances. Returns ``(step, sent, handle)``."""
        stats = self.stats
        t0 = stats.clock.stamp()
        p_full, step = comp.start(grads)
        stats.add_time("compress_s", t0)
        sent = handle = None
        if comp.shares_factor():   # the same answer on every rank
            t0 = stats.clock.stamp()
            own = p_full.new_empty(p_full.numel() // info.intra_size)
            dist.reduce_scatter_tensor(own, p_full, group=info.intra)
            stats.add_bytes(p_full.numel() * p_full.element_size(), 0, info.expert)
            sent = comp.to_send(own)
            handle = dist.all_reduce(sent, group=info.process_group, async_op=async_op)
            stats.add_time("comm_s", t0)
        stats.add_bytes(0 if sent is None else sent.numel() * sent.element_size(),
                        dense_bytes, info.expert, slow_hop=True)
        return step, sent, handle

    def _slow_hop_middle(self, comp: ShardCompressor, step, sent, info: _GroupInfo) -> tuple:
        """The second phase, after the slice came back summed: the instance's all-gather of
        ``P``, ``Q_b' = M_b P^``, and ``[Q_b' | dense | flag]`` launched across instances.
        Returns ``(buffers, handles)``."""
        stats = self.stats
        t0 = stats.clock.stamp()
        if sent is None:   # no compressed matrix in the bucket: only the dense rest goes
            p_full = torch.empty(0, device=comp.device)
        else:
            p_full = sent.new_empty(sent.numel() * info.intra_size)
            dist.all_gather_into_tensor(p_full, sent, group=info.intra)
            stats.add_bytes(sent.numel() * sent.element_size(), 0, info.expert)
        stats.add_time("comm_s", t0)
        t0 = stats.clock.stamp()
        bufs = comp.middle(step, p_full)
        stats.add_time("compress_s", t0)
        t0 = stats.clock.stamp()
        handles = [dist.all_reduce(buf, group=info.process_group, async_op=True)
                   for buf in bufs]
        stats.add_bytes(sum(b.numel() * b.element_size() for b in bufs), 0, info.expert,
                        slow_hop=True)
        stats.add_time("comm_s", t0)
        return bufs, handles

    def _group_info(self, group) -> _GroupInfo:
        return self._group_of[self._bucket_key[id(group.buckets[0])]]

    def _start(self, group) -> None:
        stats = self.stats
        stats.compressed = True
        async_op = group.ddp_config.overlap_grad_reduce
        info = self._group_info(group)
        pg = info.process_group
        # average_in_collective: megatron-core reduces with AVG over the group (and over
        # the instance first, with the partial distributed optimizer)
        scale_extra = 1.0 / (info.size * info.intra_size) \
            if group.ddp_config.average_in_collective else 1.0
        launched = []
        for bucket in group.buckets:
            # megatron-core's own part of the sync (its dense path does the same): not
            # counted as compression time
            _copy_extra_main_grads(bucket, into_buffer=True)
            factor = bucket.gradient_scaling_factor * scale_extra
            if factor != 1.0:
                bucket.grad_data *= factor
            t0 = stats.clock.stamp()
            key = self._bucket_key[id(bucket)]
            comp = self.compressors[key]
            data, dense_bytes = bucket.grad_data, _bucket_grad_bytes(bucket)
            if info.slow_hop:
                # the fast hop, dense: the instance's reduce-scatter leaves this rank's
                # shard summed over the instance (in place, as megatron-core does)
                lo, hi = _shard_range(bucket, info)
                data = bucket.grad_data[lo:hi]
                t0 = stats.clock.stamp()
                dist.reduce_scatter_tensor(data, bucket.grad_data, group=info.intra)
                stats.add_time("comm_s", t0)
                stats.add_bytes(dense_bytes, dense_bytes, info.expert)
                dense_bytes = data.numel() * data.element_size()
                t0 = stats.clock.stamp()
            grads = self._grads(key)
            if key in self.dense_keys:  # the bypass: this bucket's compression would not pay
                comp.absorb_residual(grads)
                handle = dist.all_reduce(data, group=pg, async_op=async_op)
                stats.bypassed_buckets += 1
                stats.add_bytes(dense_bytes, dense_bytes, info.expert, info.slow_hop)
                launched.append((key, None, None, None, [handle]))
                continue
            if info.slow_hop:
                stats.add_time("compress_s", t0)
                step, sent, handle = self._slow_hop_start(comp, grads, info, async_op,
                                                          dense_bytes)
                launched.append((key, comp, sent, step, [handle]))
                continue
            bufs, step = comp.start(grads)
            stats.add_time("compress_s", t0)
            t0 = stats.clock.stamp()
            handles = [dist.all_reduce(buf, group=pg, async_op=async_op) for buf in bufs]
            stats.add_time("comm_s", t0)
            stats.add_bytes(sum(buf.numel() * buf.element_size() for buf in bufs),
                            dense_bytes, info.expert, info.slow_hop)
            launched.append((key, comp, bufs, step, handles))

        def finish():
            # Pipelined second phase: as each bucket's P arrives, orthonormalize it and
            # launch its Q all-reduce asynchronously, so bucket k's Q is on the wire while
            # bucket k+1 is orthonormalized; then decompress in bucket order as the Qs land.
            # Every rank issues the same collectives in the same order, whatever the
            # non-finite flags say (they are decided on the device, see powersgd.py).
            in_flight = []
            for key, comp, bufs, step, handles in launched:
                t0 = stats.clock.stamp()
                for handle in handles:
                    if handle is not None:
                        handle.wait()
                stats.add_time("comm_s", t0)
                if comp is None:  # bypassed: the dense all-reduce was the whole sync
                    continue
                if info.slow_hop:  # bufs: the P slice, summed across instances
                    second, q_handles = self._slow_hop_middle(comp, step, bufs, info)
                    in_flight.append((key, comp, step, second, q_handles))
                    continue
                t0 = stats.clock.stamp()
                q_buf = comp.middle(step, bufs)
                stats.add_time("compress_s", t0)
                t0 = stats.clock.stamp()
                q_handles = []
                if q_buf.numel():
                    q_handles.append(dist.all_reduce(q_buf, group=pg, async_op=True))
                    stats.add_bytes(q_buf.numel() * q_buf.element_size(), 0, info.expert)
                stats.add_time("comm_s", t0)
                in_flight.append((key, comp, step, q_buf, q_handles))
            for key, comp, step, q_buf, q_handles in in_flight:
                t0 = stats.clock.stamp()
                for handle in q_handles:
                    handle.wait()
                stats.add_time("comm_s", t0)
                t0 = stats.clock.stamp()
                comp.finish(step, q_buf)
                stats.add_time("compress_s", t0)
                stats.add_nonfinite_flag(key, step.nonfinite)
            for bucket in group.buckets:
                _copy_extra_main_grads(bucket, into_buffer=False)

        group.grad_reduce_handle = _PendingSync(finish)
