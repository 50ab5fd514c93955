"""PowerSGD on the outer hop of megatron-core's Megatron-FSDP in HSDP mode (issue 94): the
inner reduction stays Megatron's, the all-reduce across instances is compressed.

Megatron-FSDP 0.16.x with ``num_distributed_optimizer_instances`` > 1 and
``outer_dp_sharding_strategy="no_shard"`` reduces each bucket group in
``GradReducePipeline._bucket_group_gradient_reduce``: inside the instance (an all-reduce,
or a reduce-scatter into this rank's shard), then, on the last micro-batch, one all-reduce
of the gradient buffer the rank holds across instances (``outer_fsdp_group``,
docs/megatron-fsdp-cpu.md). This patch wraps that method on the model's pipeline
*instance*: the original runs with the outer hop off (the inner reduction, its stream, its
queue of events and bucket releases as before); where the outer hop was asked for and
compression is active, the patch runs it on ``outer_fsdp_group_grad_reduce_stream`` after
that stream waits for the reduction's, and the bucket releases Megatron queued wait for
the outer hop's event instead of the inner one's, as Megatron's own outer hop has them
(``wait_for_previous_grad_reduce(0)`` already makes the current stream wait for the outer
stream before the optimizer).

Per bucket (a :class:`OuterBucketPlan`):

* inner ``no_shard``: the buffer is the whole bucket, the same on both inner ranks; each
  parameter's gradient is a whole matrix: PowerSGD over the outer group
  (:class:`~megatron_edgc.compression.powersgd.BucketCompressor`, ``[P | dense | flag]``
  then ``[Q]``), as the DP patch's flat strategy. Every inner rank does it on its own
  copy (Megatron's form: the hop runs once per inner rank).
* inner ``optim_grads_params``: the buffer is this rank's shard of the bucket, whole rows
  of each parameter but at most two partial rows; the DP patch's slow hop without its
  fast hop (:class:`~megatron_edgc.compression.shard_powersgd.ShardCompressor` on the
  pieces of :func:`~megatron_edgc.compression.shard.shard_pieces`: row blocks compressed
  with their matrix's factor, partial rows and vectors dense). The matrix's column-side
  factor is summed over the instance (a reduce-scatter and an all-gather of ``[L]`` on the
  inner group, ``L = Σ m·r`` over the bucket's compressed matrices: the one addition to
  the inner group's traffic), its slice across, then ``[Q_b' | dense | flag]`` across.

The averaging is Megatron's: the gradients were scaled by its ``gradient_scaling_factor``
before the inner reduction; with ``average_in_collective`` (the outer all-reduce an AVG)
the patch, summing, scales the buffer by 1/outer size first.

The state of each bucket is its compressor's (:class:`~megatron_edgc.compression.unit_state.UnitState`:
residuals, warm starts, the skip rule), keyed ``bucket<id>`` and, inside, by parameter
name (``param_to_name``, pieces by their rows): :meth:`FSDPOuterCompression.state_dict`
restores it on the same layout. The per-step calls are the DP patch's
(:class:`~megatron_edgc.patches.ddp.DPGradientCompression`): ``set_iteration``,
``set_loss_scale``, ``prepare_iteration`` before the schedule, ``after_step(applied)``
after the optimizer, ``stats`` (:class:`~megatron_edgc.patches.dp_stats.DPSyncStats`).

Not here yet: the bypass and its link model, the dense fallback, the bf16 dense wire,
EDGC's controller (``set_rank`` takes a static rank or None), ``force_all_reduce``,
expert parameters, ``outer_dp_sharding_strategy="optim"``, inner ``optim``/``optim_grads``,
``overlap_grad_reduce=False`` (Megatron-FSDP's synchronous ``all_reduce_gradients`` path):
each refused by name.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron_edgc.compression.matrices import FACTOR_DTYPES, matrix_shape
from megatron_edgc.compression.low_rank_state import LowRankState
from megatron_edgc.compression.powersgd import BucketCompressor
from megatron_edgc.compression.shard import shard_pieces
from megatron_edgc.compression.shard_powersgd import ShardCompressor, shard_compressor_inputs
from megatron_edgc.patches import features
from megatron_edgc.patches.dp_pipeline import BucketPipeline, Phase, Strategy, all_reduce
from megatron_edgc.patches.dp_plans import shard_hop
from megatron_edgc.patches.dp_stats import DPSyncStats
from megatron_edgc.patches.megatron_buckets import MegatronSyncBytes
from megatron_edgc.patches.timing import IntervalClock

#: megatron-core release series whose ``_bucket_group_gradient_reduce`` this patch was
#: written against (0.19's adds a cast copy for ``grad_comm_dtype``: not yet read).
SUPPORTED_SERIES = ("0.16.",)
INNER_STRATEGIES = ("no_shard", "optim_grads_params")
_BUFFER = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"
_PIPELINE_ATTRIBUTES = ("_bucket_group_gradient_reduce", "grad_reduce_queue", "rs_stream",
                        "outer_fsdp_group_grad_reduce_stream", "get_fsdp_buffer", "buffer")
_GBUF_ATTRIBUTES = ("data", "params", "item_index_map", "is_data_distributed",
                    "shard_bucket_index", "data_parallel_group", "dp_world_size")


def refusal(version: Optional[str] = None) -> Optional[str]:
    """Why this megatron-core cannot take the patch (one line), or None."""
    version = version or features.megatron_core_version()
    if not version.startswith(SUPPORTED_SERIES):
        return (f"megatron-core {version}: the Megatron-FSDP outer-hop compression is written "
                f"against {', '.join(s + 'x' for s in SUPPORTED_SERIES)}'s "
                f"GradReducePipeline._bucket_group_gradient_reduce; refusing this version")
    try:
        cls = features.resolve(_BUFFER, "GradReducePipeline")
    except features._Missing as exc:
        return f"megatron-core {version} lacks {exc} (the Megatron-FSDP outer-hop patch)"
    import inspect

    params = set(inspect.signature(cls._bucket_group_gradient_reduce).parameters)
    if not {"bucket_group", "async_op", "outer_fsdp_group_grad_reduce"} <= params:
        return (f"megatron-core {version}: GradReducePipeline._bucket_group_gradient_reduce "
                f"takes {sorted(params)}, not (bucket_group, async_op, "
                f"outer_fsdp_group_grad_reduce)")
    return None


def _require(obj, names, what: str) -> None:
    for name in names:
        if not hasattr(obj, name):
            raise features.UnsupportedMegatronVersion(
                f"megatron-core {features.megatron_core_version()} lacks {what}.{name} "
                f"(the Megatron-FSDP outer-hop patch)")


@dataclass
class OuterBucketPlan:
    """One Megatron-FSDP bucket's outer hop: ``layout`` is ``((n, m), offset in the
    buffer the rank holds)`` of each compressor entry."""

    key: str
    bucket_id: int
    gbuf: object
    compressor: LowRankState
    layout: list
    outer: object
    inner: object
    inner_size: int
    sharded: bool

    @classmethod
    def build(cls, bucket_id: int, gbuf, names: dict, outer, rank: int,
              settings: dict) -> "OuterBucketPlan":
        _require(gbuf, _GBUF_ATTRIBUTES, "DataParallelBuffer")
        # every parameter of the bucket, in bucket order: (name, (n, m), bucket offset)
        matrices = [(names[p], matrix_shape(tuple(gbuf.item_index_map[i].shape)),
                     gbuf.item_index_map[i].global_data_index)
                    for i, p in enumerate(gbuf.params)]
        inner_size = gbuf.dp_world_size
        if gbuf.is_data_distributed:
            start = gbuf.shard_bucket_index.bucket_data_index
            size = gbuf.shard_bucket_index.size
            assert gbuf.data.numel() == size, (gbuf.data.numel(), size)
            pieces = shard_pieces([(name, offset, shape) for name, shape, offset in matrices],
                                  start, start + size)
            entries, parents = shard_compressor_inputs(pieces, matrices)
            comp = ShardCompressor(entries, parents,
                                   [(name, shape) for name, shape, _ in matrices],
                                   inner_size, rank, **settings)
            layout = [(pc.shape, pc.start - start) for pc in pieces]
        else:
            comp = BucketCompressor([(name, shape) for name, shape, _ in matrices], rank,
                                    **settings)
            layout = [(shape, offset) for _, shape, offset in matrices]
        return cls(f"bucket{bucket_id}", bucket_id, gbuf, comp, layout, outer,
                   gbuf.data_parallel_group, inner_size, gbuf.is_data_distributed)

    def grads(self) -> list:
        """Views of the compressor's entries in the buffer the rank holds (made per step:
        Megatron-FSDP may give the buffer new storage)."""
        data = self.gbuf.data
        return [data[o:o + n * m].view(n, m) for (n, m), o in self.layout]

    @property
    def dense_bytes(self) -> int:
        """What Megatron's outer all-reduce of this bucket carries."""
        return self.gbuf.data.numel() * self.gbuf.data.element_size()

    def strategy(self) -> Strategy:
        return self.shard() if self.sharded else self.flat()

    def flat(self) -> Strategy:
        """Whole matrices across instances: ``[P | dense | flag]``, then ``[Q]``."""
        comp = self.compressor
        bufs, step = comp.start(self.grads())
        yield Phase([all_reduce(b, self.outer, slow_hop=True) for b in bufs])
        bufs = comp.middle(step, bufs)
        yield Phase([all_reduce(b, self.outer, slow_hop=True) for b in bufs])
        comp.finish(step, bufs)
        return step.flags()

    def shard(self) -> Strategy:
        """This rank's shard across instances (the DP patch's slow hop after its fast
        hop, which Megatron-FSDP did): ``[L | flag]`` reduce-scattered inside the instance,
        the slice across, the all-gather inside, then ``[Q_b' | dense | flag]`` across."""
        return (yield from shard_hop(self.compressor, self.grads(), self.inner,
                                     self.inner_size, self.outer))


def megatron_fsdp_sync_bytes(model, num_microbatches: int) -> tuple:
    """``(inner, outer)``: the bytes one rank places into Megatron-FSDP's own gradient
    reduction of ``model`` (the adapter or its ``MegatronFSDP``) per step, inside the
    instance and across instances (0.16.x, docs/megatron-fsdp-cpu.md): inner ``no_shard``
    all-reduces each whole bucket once (on the last micro-batch); ``optim_grads_params``
    reduce-scatters it on every micro-batch; the outer hop all-reduces the buffer the rank
    holds (the bucket, or its shard) once."""
    fsdp = model if hasattr(model, "grad_reduce_pipeline") else model.module
    buffer = fsdp.param_and_grad_buffer
    inner = outer = 0
    for group in buffer.parameter_groups:
        gbuf = group.main_grad_buffer
        if gbuf is None:
            continue
        size = gbuf.data.element_size()
        whole = gbuf.bucket_index.size * size
        inner += whole * (num_microbatches if gbuf.is_data_distributed else 1)
        outer += gbuf.data.numel() * size
    if buffer.dist_index.get_outer_fsdp_group() is None:
        outer = 0
    return inner, outer


def hsdp_sync_bytes(chunks, num_microbatches: int) -> MegatronSyncBytes:
    """:class:`~megatron_edgc.patches.megatron_buckets.MegatronSyncBytes` of Megatron-FSDP
    HSDP's ``chunks`` (:func:`megatron_fsdp_sync_bytes`; no expert buckets)."""
    pairs = [megatron_fsdp_sync_bytes(c, num_microbatches) for c in chunks]
    inner, outer = (sum(v) for v in zip(*pairs)) if pairs else (0, 0)
    return MegatronSyncBytes(dp=inner + outer, expert=0, slow_hop=outer, has_experts=False,
                             fsdp_inner=inner)


def outer_compression(cfg, chunks, ef_dtype: torch.dtype, ef_note: str,
                      log: Callable[[str], None]) -> "FSDPOuterCompression":
    """The runtime's Megatron-FSDP (HSDP) compression: PowerSGD on the outer hop at the
    run's static rank (the config's rules refuse what it does not do: EDGC's controller,
    the bypass, the bf16 dense wire; not here yet: the dense fallback), its start-up line
    logged."""
    e, p = cfg.edgc, cfg.parallel
    comp = FSDPOuterCompression(
        chunks[0], rank=e.rank, start_iter=e.start_iter, seed=cfg.training.seed,
        min_compression_rate=e.min_compression_rate,
        factor_dtype=FACTOR_DTYPES[e.factor_dtype], ef_dtype=ef_dtype)
    log(f"EDGC: error-feedback state {comp.state_bytes() / 2**20:.1f} MiB per rank "
        f"at rank {e.rank} ({ef_note} residual, {e.factor_dtype} factors); "
        f"Megatron-FSDP HSDP ({p.data_parallel_sharding_strategy} inside "
        f"{p.num_distributed_optimizer_instances} instances): compressing the outer "
        f"hop only, {len(comp.plans)} buckets (no dense fallback yet)")
    return comp


class FSDPOuterCompression:
    """PowerSGD with error feedback on the outer hop of one Megatron-FSDP model (module
    docstring). ``model``: megatron-core's ``FullyShardedDataParallel`` (the adapter) or
    its ``MegatronFSDP``. ``rank``: a static rank, None for dense (Megatron's own outer
    all-reduce); compression runs from ``start_iter`` on. ``compress_all``: every matrix
    compressed whatever its shape (tests at full rank)."""

    def __init__(self, model, *, rank: Optional[int], start_iter: int = 0, seed: int = 0,
                 min_compression_rate: float = 2.0, factor_dtype: torch.dtype = torch.float32,
                 ef_dtype: torch.dtype = torch.float32, compress_all: bool = False):
        reason = refusal()
        if reason:
            raise features.UnsupportedMegatronVersion(reason)
        fsdp = model if hasattr(model, "grad_reduce_pipeline") else model.module
        _require(fsdp, ("grad_reduce_pipeline", "param_and_grad_buffer", "ddp_config"),
                 "MegatronFSDP")
        pipeline, buffer, cfg = fsdp.grad_reduce_pipeline, fsdp.param_and_grad_buffer, \
            fsdp.ddp_config
        _require(pipeline, _PIPELINE_ATTRIBUTES, "GradReducePipeline")
        outer = buffer.dist_index.get_outer_fsdp_group()
        problems = []
        if outer is None or not getattr(pipeline, "outer_fsdp_group_grad_reduce", False):
            problems.append("not HSDP (num_distributed_optimizer_instances = 1: no outer hop)")
        if cfg.outer_dp_sharding_strategy != "no_shard":
            problems.append(f"outer_dp_sharding_strategy={cfg.outer_dp_sharding_strategy!r} "
                            f"(only 'no_shard': the outer hop an all-reduce)")
        if cfg.data_parallel_sharding_strategy not in INNER_STRATEGIES:
            problems.append(f"data_parallel_sharding_strategy="
                            f"{cfg.data_parallel_sharding_strategy!r} (tested: "
                            f"{', '.join(INNER_STRATEGIES)})")
        if not cfg.overlap_grad_reduce:
            problems.append("overlap_grad_reduce=False (Megatron-FSDP's synchronous "
                            "all_reduce_gradients path, not the pipeline this patch wraps)")
        if any(g.is_expert_param for g in buffer.parameter_groups):
            problems.append("expert parameters (their own data-parallel group)")
        if problems:
            raise ValueError("Megatron-FSDP outer-hop compression: " + "; ".join(problems))
        import torch.distributed as dist

        self.model, self.pipeline, self.ddp_config = fsdp, pipeline, cfg
        self.outer_group, self.outer_size = outer, dist.get_world_size(outer)
        self.rank, self.start_iter, self.iteration, self.seed = rank, start_iter, 0, seed
        self.stats = DPSyncStats()
        self.sync_end_hook: Optional[Callable[[], None]] = None
        names = {p: n for p, n in buffer.param_to_name.items()}
        settings = dict(min_compression_rate=min_compression_rate, seed=seed,
                        factor_dtype=factor_dtype, ef_dtype=ef_dtype,
                        compress_all=compress_all)
        self.plans: dict[int, OuterBucketPlan] = {}
        for bucket_id in range(buffer.num_buckets):
            if buffer.parameter_groups[bucket_id].main_grad_buffer is None:
                continue
            gbuf = pipeline.get_fsdp_buffer(bucket_id)
            self.plans[bucket_id] = OuterBucketPlan.build(
                bucket_id, gbuf, names, outer, rank or 1,
                dict(settings, device=gbuf.data.device, dense_dtype=gbuf.data.dtype))
        devices = {p.gbuf.data.device for p in self.plans.values()}
        self.stats.clock = IntervalClock(use_cuda=any(d.type == "cuda" for d in devices))
        self._prepared = False
        self._original = pipeline._bucket_group_gradient_reduce
        self._patch()

    # ------------------------------------------------------------------ views

    @property
    def active(self) -> bool:
        return self.rank is not None and self.iteration >= self.start_iter

    @property
    def compressors(self) -> dict:
        return {plan.key: plan.compressor for plan in self.plans.values()}

    def state_bytes(self) -> int:
        return sum(p.compressor.state_bytes() for p in self.plans.values())

    def dense_outer_bytes(self) -> int:
        """Bytes Megatron's outer all-reduce carries per step on this rank."""
        return sum(p.dense_bytes for p in self.plans.values())

    def wire_bytes(self) -> list:
        """``[(key, [bytes of each collective across instances])]`` of a compressed step."""
        return [(p.key, p.compressor.wire_bytes()) for p in self.plans.values()]

    # ------------------------------------------------------------------ control

    def set_iteration(self, iteration: int) -> None:
        self.iteration = iteration
        self.stats.reset()

    def set_loss_scale(self, scale: Optional[torch.Tensor]) -> None:
        for plan in self.plans.values():
            plan.compressor.loss_scale = scale

    def set_rank(self, rank: Optional[int]) -> None:
        """A new static rank for every bucket (None: Megatron's dense hop; the state is
        kept)."""
        if rank != self.rank:
            self._prepared = False
        self.rank = rank
        if rank is not None:
            for plan in self.plans.values():
                plan.compressor.set_rank(rank)

    def prepare_iteration(self) -> None:
        """Before the schedule: every bucket's warm start allocated (never inside
        backward)."""
        if self.active and not self._prepared:
            for plan in self.plans.values():
                plan.compressor.prepare()
            self._prepared = True

    def after_step(self, applied: bool) -> None:
        """After the optimizer: the one rule settles each bucket's step
        (:meth:`~megatron_edgc.compression.unit_state.UnitState.settle`)."""
        for plan in self.plans.values():
            plan.compressor.after_step(applied)

    def observe_link(self, stats: list) -> None:
        """The DP patch's link refit (its bypass): none here (no bypass on the outer hop)."""

    def observe_failures(self, stats: list, iteration: int) -> None:
        """The DP patch's dense fallback: none here (not yet)."""

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {"rank": self.rank, "outer_size": self.outer_size,
                "buckets": {p.key: p.compressor.state_dict() for p in self.plans.values()}}

    def load_state_dict(self, state: dict) -> list:
        """Restore every bucket's state; returns the keys (bucket, or bucket: names) that
        did not fit this layout (reset to fresh)."""
        self._prepared = False
        if state["rank"] != self.rank:
            self.set_rank(state["rank"])
        bad = []
        for plan in self.plans.values():
            saved = state["buckets"].get(plan.key)
            if saved is None:
                bad.append(plan.key)
                continue
            bad += [f"{plan.key}: {name}" for name in plan.compressor.load_state_dict(saved)]
        return bad

    def restore(self) -> None:
        """Megatron-FSDP's own method back on the pipeline (the state is kept)."""
        self.pipeline.__dict__.pop("_bucket_group_gradient_reduce", None)

    # ------------------------------------------------------------------ the patch

    def _patch(self) -> None:
        owner, original = self, self._original

        def bucket_group_gradient_reduce(self, bucket_group, async_op: bool = False,
                                         outer_fsdp_group_grad_reduce: bool = False):
            if not (outer_fsdp_group_grad_reduce and owner.active):
                if outer_fsdp_group_grad_reduce:
                    owner._count_dense(bucket_group)
                return original(bucket_group, async_op=async_op,
                                outer_fsdp_group_grad_reduce=outer_fsdp_group_grad_reduce)
            # Megatron's inner reduction, its event and the buckets' releases queued
            done = original(bucket_group, async_op=async_op, outer_fsdp_group_grad_reduce=False)
            inner_stream = self.rs_stream if self.rs_stream is not None \
                else torch.cuda.current_stream()
            stream = self.outer_fsdp_group_grad_reduce_stream
            stream.wait_stream(inner_stream)
            with torch.cuda.stream(stream):
                owner._compress(bucket_group)
                event = stream.record_event()
            if async_op:   # the releases wait for the outer hop, as Megatron's own do
                n = len(bucket_group)
                self.grad_reduce_queue[-n:] = [(event, free, b) for _, free, b
                                               in self.grad_reduce_queue[-n:]]
            else:
                event.wait()
            return done

        self.pipeline._bucket_group_gradient_reduce = types.MethodType(
            bucket_group_gradient_reduce, self.pipeline)

    def _count_dense(self, bucket_group) -> None:
        for b in bucket_group:
            nbytes = self.plans[b].dense_bytes
            self.stats.add_bytes(nbytes, nbytes, False, slow_hop=True)
            self.stats.collectives += 1

    def _compress(self, bucket_group) -> None:
        stats = self.stats
        stats.compressed = True
        scale = 1.0 / self.outer_size if self.ddp_config.average_in_collective else 1.0
        pipeline = BucketPipeline(stats)
        for b in bucket_group:
            plan = self.plans[b]
            if scale != 1.0:
                plan.gbuf.data.mul_(scale)
            stats.add_bytes(0, plan.dense_bytes, False, slow_hop=True)
            stats.buckets += 1
            pipeline.start(plan.key, False, plan.strategy(), dense=False)
        pipeline.finish()
        if self.sync_end_hook is not None:
            self.sync_end_hook()
