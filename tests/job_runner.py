"""Run one training job in a fresh interpreter and dump every rank's results.

    python tests/job_runner.py OUT_DIR [--inject-nan-at ITER] [--count-host-syncs]
                               [pretrain flags...]

``--inject-nan-at ITER`` writes a NaN into DP rank 1's first gradient of iteration ITER
(0-based) just before the DP sync (a test of the non-finite guard).
``--inject-nan-grad-at ITER``: the same, into DP rank 1's first parameter's gradient before
``finalize_model_grads`` (so before a DP sync without --overlap-grad-reduce), in any
``--edgc-mode``, off included (a test of the non-finite step guard).
``--fail-factorizations-at I,J,...``: every Cholesky factorization of iterations I, J
(0-based) on every rank fails as cuSOLVER's do, with a NaN factor (a test of the
orthonormalization's stand-in basis and the dense fallback).
``--inject-overflow-at ITER``: an Inf (an fp16 overflow) in DP rank 1's first gradient of
the first bucket group's first bucket of iteration ITER (0-based), written before the DP
sync; every rank captures, per compressed bucket and shape group, the step's ``M = G + E``
(in the step's units), ``E`` and ``Q`` before the step, ``E`` as the sync left it, and
``E`` and ``Q`` after the optimizer's outcome (``overflow_capture``: a test of the skip
rule, docs/reliability.md).
``EDGC_TEST_CPU_BF16_VOTES=1,0,...`` (environment): rank i's own timing of an unset
``--bf16`` on a CPU finds bf16 faster where its entry is 1 (a test of the agreement).
``--count-host-syncs`` counts the host syncs (``tests/host_sync.py``) of the patched DP
bucket-group sync and of the compressed pipeline sends and receives, per iteration, into
each rank's result (``host_syncs``: ``(iteration, site, call, source line)``).

A fresh process matters: workers are forked after the imports, which is only safe
before the forking process has run torch operations (OpenMP thread pools do not survive
a fork), and the pytest process has.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_edgc.config import parse_config  # noqa: E402
from megatron_edgc.training.launch import spawn_local  # noqa: E402


def main() -> int:
    out_dir, argv = sys.argv[1], sys.argv[2:]
    inject_at, inject_grad_at, count_syncs = None, None, False
    if argv[:1] == ["--inject-nan-at"]:
        inject_at, argv = int(argv[1]), argv[2:]
    if argv[:1] == ["--inject-nan-grad-at"]:
        inject_grad_at, argv = int(argv[1]), argv[2:]
    fail_at = ()
    if argv[:1] == ["--fail-factorizations-at"]:
        fail_at, argv = {int(i) for i in argv[1].split(",")}, argv[2:]
    overflow_at = None
    if argv[:1] == ["--inject-overflow-at"]:
        overflow_at, argv = int(argv[1]), argv[2:]
    if argv[:1] == ["--count-host-syncs"]:
        count_syncs, argv = True, argv[1:]
    from megatron.core import parallel_state

    from megatron_edgc.patches import ddp

    from megatron_edgc.training.loop import Trainer, init_worker, shutdown_worker

    cfg = parse_config(argv)
    os.makedirs(out_dir, exist_ok=True)
    if os.environ.get("EDGC_TEST_STALE_UNITS"):
        stale_residual_units()

    votes = os.environ.get("EDGC_TEST_CPU_BF16_VOTES")

    def target(rank, world, local):
        if votes:   # each rank's timed CPU precision (1: bf16 faster), for the agreement
            from megatron_edgc.config import host

            vote = bool(int(votes.split(",")[rank]))
            host.measure = lambda *shape: host.CpuPrecision(
                vote, f"rank {rank} timed {'bf16' if vote else 'fp32'} faster (test)")
        init_worker(cfg, rank, world, local)
        if inject_at is not None:
            original = ddp.DPGradientCompression._start

            def poisoned_start(self, group):
                if self.iteration == inject_at and parallel_state.get_data_parallel_rank() == 1:
                    group.buckets[0].params_list[0].main_grad.view(-1)[0] = float("nan")
                return original(self, group)

            ddp.DPGradientCompression._start = poisoned_start
        try:
            trainer = Trainer(cfg)
            if inject_grad_at is not None:
                poison_grad_before_finalize(trainer, inject_grad_at)
            if fail_at:
                fail_factorizations(trainer, fail_at)
            syncs = count_host_syncs(trainer) if count_syncs else []
            capture = inject_overflow(trainer, overflow_at) if overflow_at is not None else []
            summary = trainer.run()
            if cfg.parallel.use_megatron_fsdp:   # no DDP buckets: the weights it holds
                torch.save(fsdp_result(trainer, summary), os.path.join(out_dir,
                                                                       f"rank{rank}.pt"))
                return 0
            params = {f"{i}.{name}": p.detach().clone()
                      for i, chunk in enumerate(trainer.bundle.chunks)
                      for name, p in chunk.named_parameters()}
            torch.save({"tp": parallel_state.get_tensor_model_parallel_rank(),
                        "pp": parallel_state.get_pipeline_model_parallel_rank(),
                        "dp": parallel_state.get_data_parallel_rank(),
                        "ep": parallel_state.get_expert_model_parallel_rank(),
                        "params": params, "summary": summary, "host_syncs": syncs,
                        "overflow_capture": capture,
                        "n_buckets": sum(len(g.buckets) for c in trainer.bundle.chunks
                                         for g in c.bucket_groups),
                        "bucket_shapes": [[tuple(p.shape) for p in b.params_list]
                                          for c in trainer.bundle.chunks
                                          for g in c.bucket_groups for b in g.buckets],
                        "bucket_offsets": [
                            [(p.main_grad.data_ptr() - b.grad_data.data_ptr())
                             // b.grad_data.element_size() for p in b.params_list]
                            for c in trainer.bundle.chunks
                            for g in c.bucket_groups for b in g.buckets],
                        "bucket_numel": [b.grad_data.numel() for c in trainer.bundle.chunks
                                         for g in c.bucket_groups for b in g.buckets],
                        "instance_rank": getattr(trainer.bundle.chunks[0].bucket_groups[0],
                                                 "intra_distributed_optimizer_instance_rank",
                                                 None),
                        "instance_size": getattr(trainer.bundle.chunks[0].bucket_groups[0],
                                                 "intra_distributed_optimizer_instance_size",
                                                 None),
                        "expert_bucket_shapes": [
                            [tuple(p.shape) for p in b.params_list]
                            for c in trainer.bundle.chunks
                            for g in c.expert_parallel_bucket_groups for b in g.buckets],
                        "compression": trainer.dp_compression.state_dict()
                        if trainer.dp_compression is not None else None,
                        "controller": trainer.edgc.controller.state_dict()
                        if trainer.edgc is not None else None,
                        "edgc": trainer.edgc.state_dict() if trainer.edgc is not None else None,
                        "pp_compression": trainer.p2p.state_dict()
                        if trainer.p2p is not None else None,
                        "grad_buffers": [b.grad_data.detach().clone()
                                         for c in trainer.bundle.chunks
                                         for g in c.bucket_groups for b in g.buckets]},
                       os.path.join(out_dir, f"rank{rank}.pt"))
            return 0
        finally:
            shutdown_worker()

    return spawn_local(target, cfg.parallel.world_size)


def fsdp_result(trainer, summary) -> dict:
    """A Megatron-FSDP run's result: its coordinates (the inner rank: this rank's shard),
    the local pieces of its optimizer's main weights by name, the summary and the outer-hop
    compression's state."""
    from megatron.core import parallel_state

    buffer = trainer.bundle.chunks[0].param_and_grad_buffer
    params = {name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
              for name, p in buffer.optimizer_named_parameters}
    return {"tp": parallel_state.get_tensor_model_parallel_rank(),
            "pp": parallel_state.get_pipeline_model_parallel_rank(),
            "dp": parallel_state.get_data_parallel_rank(),
            "inner_dp": parallel_state.get_data_parallel_rank(with_context_parallel=True,
                                                        partial_data_parallel=True),
            "params": params, "summary": summary,
            "compression": trainer.dp_compression.state_dict()
            if trainer.dp_compression is not None else None}


def poison_grad_before_finalize(trainer, at: int) -> None:
    """A NaN in DP rank 1's first gradient of iteration ``at`` (0-based), written before
    the model config's ``finalize_model_grads_func`` (the DP sync) runs."""
    from megatron.core import parallel_state

    config = trainer.bundle.config
    finalize = config.finalize_model_grads_func

    def poisoned(*args, **kwargs):
        if trainer.iteration == at and parallel_state.get_data_parallel_rank() == 1:
            param = next(trainer.bundle.chunks[0].parameters())
            param.main_grad.view(-1)[0] = float("nan")
        return finalize(*args, **kwargs)

    config.finalize_model_grads_func = poisoned


def stale_residual_units() -> None:
    """``EDGC_TEST_STALE_UNITS=1``: the residuals read in the units they were formed at,
    whatever the loss scale since (the code before issue 63), for a test to show its
    assertion fails there."""
    from megatron_edgc.compression.kernels import ErrorFeedback

    original = ErrorFeedback.begin
    ErrorFeedback.begin = lambda self, loss_scale: original(self, None)


def inject_overflow(trainer, at: int) -> list:
    """``--inject-overflow-at``: the Inf and the captures (module docstring); returns the
    list of ``{"key", "shape", "bucket_finite", "M", "E_before", "Q_before", "E_synced", "E_after",
    "Q_after"}`` the captures go to (fp32 CPU tensors, ``[k, n, m]`` / ``[k, m, r]``)."""
    from megatron.core import parallel_state

    from megatron_edgc.patches import ddp

    dp = trainer.dp_compression
    captures: list = []
    by_plan: dict = {}
    original_start, original_after = dp._start, dp.after_step

    def start(group):
        if dp.iteration == at:
            if group is dp.bucket_groups[0] and parallel_state.get_data_parallel_rank() == 1:
                group.buckets[0].params_list[0].main_grad.view(-1)[0] = float("inf")
            for plan in dp._group_plans[id(group)]:
                comp = plan.compressor
                scaled = plan.bucket.grad_data.float() * ddp.DPGradientCompression._scaling(
                    group, plan)
                grads = plan.grads(scaled)
                # E is kept net of the loss scale: M = G + s·E
                ratio = 1.0 if comp.loss_scale is None else float(comp.loss_scale)
                for shape, g in comp.groups.items():
                    entry = {"key": plan.key, "shape": shape,
                             "bucket_finite": bool(torch.isfinite(scaled).all()),
                             # in E's units (net of the scale)
                             "M": torch.stack([grads[i] for i in g.indices]) / ratio
                             + g.residual.float(),
                             "E_before": g.residual.float().clone(), "Q_before": g.q.clone()}
                    by_plan.setdefault(plan.key, []).append((g, entry))
                    captures.append(entry)
        return original_start(group)

    def after_step(applied):
        if dp.iteration == at:   # the sync left E here (what the code before issue 63 kept)
            for entries in by_plan.values():
                for g, entry in entries:
                    entry["E_synced"] = g.residual.float().clone()
        original_after(applied)
        if dp.iteration == at:
            for entries in by_plan.values():
                for g, entry in entries:
                    entry["E_after"], entry["Q_after"] = g.residual.float().clone(), g.q.clone()

    dp._start, dp.after_step = start, after_step
    return captures


def fail_factorizations(trainer, iterations) -> None:
    """Every ``torch.linalg.cholesky_ex`` of the given iterations (0-based) returns a NaN
    factor and info > 0, as cuSOLVER's batched potrf does where a factorization fails."""
    cholesky_ex = torch.linalg.cholesky_ex

    def failing(a, **kwargs):
        out = cholesky_ex(a, **kwargs)
        if trainer.iteration in iterations:
            return type(out)((torch.full_like(out.L, float("nan")), out.info + 1))
        return out

    torch.linalg.cholesky_ex = failing


def count_host_syncs(trainer) -> list:
    """Wrap the patched DP sync of every bucket group and the pipeline message packing in
    a host-sync counter; returns the list the counts go to."""
    from host_sync import HostSyncCounter

    syncs: list = []

    def counted(fn, site):
        def wrapper(*args, **kwargs):
            with HostSyncCounter() as counter:
                out = fn(*args, **kwargs)
            it = trainer.dp_compression.iteration
            syncs.extend((it, site, name, where) for name, where in counter.calls)
            return out
        return wrapper

    for group in trainer.dp_compression.bucket_groups:
        group.start_grad_sync = counted(group.start_grad_sync, "dp start_grad_sync")
        group.finish_grad_sync = counted(group.finish_grad_sync, "dp finish_grad_sync")
    if trainer.p2p is not None:
        trainer.p2p._pack = counted(trainer.p2p._pack, "pp send")
        trainer.p2p._unpack_into = counted(trainer.p2p._unpack_into, "pp receive")
    return syncs


if __name__ == "__main__":
    sys.exit(main())
