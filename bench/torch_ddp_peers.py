#!/usr/bin/env python
"""The peers a user of PyTorch DDP runs instead of EDGC, on the same model and data.

    python bench/torch_ddp_peers.py --hook powersgd --hook-rank 32 --data-parallel-size 4 \
        --pipeline-model-parallel-size 1 [any pretrain_gpt2_edgc.py flag]
    python bench/torch_ddp_peers.py --hook powersgd-bf16 ...  # the same in bf16_compress_wrapper
    python bench/torch_ddp_peers.py --hook allreduce ...      # torch DDP, plain all-reduce
    python bench/torch_ddp_peers.py --hook bf16 ...           # default_hooks.bf16_compress_hook
    python bench/torch_ddp_peers.py --hook quantize ...       # quantization_perchannel_hook (uint8)
    python bench/torch_ddp_peers.py --hook local-sgd --local-sgd-period 8 ...
    python bench/torch_ddp_peers.py --hook diloco --diloco-sync-every 8 ...  # torchft (extra: bench)

``--hook``: ``powersgd``: PyTorch's ``powerSGD_hook`` at ``--hook-rank`` (error feedback,
warm start, ``--hook-start-iter`` iterations of plain all-reduce first, its minimum 2);
``powersgd-bf16``: the same hook inside ``bf16_compress_wrapper`` (PyTorch's wrapper: the
bucket cast to bf16, the hook's factors and its warm-up all-reduce in bf16, the result
cast back; EDGC's factors are bf16 too);
``bf16``: ``bf16_compress_hook`` (half the bytes, all-reduce); ``quantize``:
``quantization_perchannel_hook``'s algorithm (:func:`quantize_perchannel_hook`: uint8 per
512-element channel plus an fp32 scale and zero point each, exchanged with all-gathers:
every rank receives every other rank's payload);
``local-sgd``: periodic averaging as PyTorch ships it, ``post_localSGD_hook`` with a
subgroup of one rank (each DP rank steps alone: on a real cluster the subgroup is a site)
after ``--hook-start-iter`` iterations of global all-reduce, and ``PostLocalSGDOptimizer``
with a ``PeriodicModelAverager`` that all-reduces the parameters every
``--local-sgd-period`` steps. ``--hook-rank 0`` (the old spelling) is ``allreduce``;
``diloco``: DiLoCo (Douillard et al., 2023) through torchft's own ``DiLoCo``, ``Manager``
and ``ProcessGroupGloo``: no DDP, each DP rank its own torchft replica group stepping the
inner AdamW alone, and every ``--diloco-sync-every`` (H) steps the pseudo-gradient
(global − local weights) averaged across the replicas and applied by the outer Nesterov
SGD (``--diloco-outer-lr`` 0.7, ``--diloco-outer-momentum`` 0.9, the paper's);
``--diloco-fragments F`` with ``--diloco-fragment-sync-delay`` is Streaming DiLoCo (the
model in F fragments synced in turn, each sync overlapping that many inner steps). The
replicas meet through a real ``torchft_lighthouse``: rank 0 starts one on its host
(reached at ``MASTER_ADDR``: local processes, torchrun, the benchmark's namespaces) and
stops it at the end; ``--lighthouse ADDR`` names one already running.

Same model (megatron-core ``GPTModel``, same init seeds), same data stream, same loss,
the same learning-rate schedule (megatron-core's ``OptimizerParamScheduler``) and Adam
with decoupled weight decay on the same parameters (no decay on biases and norms), clipping
at ``--clip-grad``: only the data-parallel engine differs. Pure DP layout (TP = PP = 1).
Train it in fp32 (the CPU default) to compare with the trainer: with ``--bf16`` the
parameters are bf16 and torch's AdamW steps them in bf16, without the fp32 main weights
megatron-core keeps; ``torch.autocast`` instead fails in megatron-core's linear layers on
CPU (their backward is a custom autograd function: "expected m1 and m2 to have the same
dtype").

Times each iteration as the trainer does, with its clock (``IterationRecords``: ``iter_ms``
from the first work to after the optimizer and LR steps) over the same work: the loss's
all-reduce over DP inside (what an iteration that logs its loss pays; megatron-core's and
Megatron-LM's loops reduce it every iteration), the telemetry's reduction (the bytes sent)
outside, as the trainer reduces its telemetry at the log interval (issue 93).

Writes the same metrics JSONL and summary as ``pretrain_gpt2_edgc.py`` (iteration, loss,
iter_ms, ``grad_sync_ms`` = last gradient bucket handed to the hook → DDP's backward
returns with reduced gradients, ``dp_bytes_sent_job`` = the payload the hooks put into
collectives (PowerSGD's own counters, the bucket's bytes in its wire dtype, the averaged
parameters), val loss), so the benchmarks read both alike. Launch as the trainer: plain
(local processes), torchrun or srun.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


HOOKS = ("powersgd", "powersgd-bf16", "allreduce", "bf16", "quantize", "local-sgd", "diloco")
#: the hooks that are PyTorch's powerSGD_hook (its state, start iteration and counters)
POWERSGD = ("powersgd", "powersgd-bf16")
CHANNEL = 512   # quantization_perchannel_hook's default bucket_size


def quantize_perchannel_hook(process_group, bucket):
    """PyTorch's ``quantization_perchannel_hook``, the same algorithm written out: its own
    callback fails on gloo with torch 2.13 (``IndexError: too many indices`` on the value of
    its all-gather future). Per channel of 512 elements: min-max affine uint8 (scale and
    zero point all-gathered first), the uint8 payloads all-gathered, each rank's dequantized
    and summed locally; the mean is returned, as DDP's hooks do."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(process_group)
    flat = bucket.buffer()
    pad = (-flat.numel()) % CHANNEL
    chans = torch.nn.functional.pad(flat.float(), (0, pad)).view(-1, CHANNEL)
    lo = chans.amin(dim=1).clamp(max=0.0)
    hi = chans.amax(dim=1).clamp(min=0.0)
    scale = ((hi - lo) / 255.0).clamp(min=1e-12)
    zero = torch.round(-lo / scale)
    sz = torch.stack([scale, zero])
    all_sz = [torch.empty_like(sz) for _ in range(world)]
    dist.all_gather(all_sz, sz, group=process_group)
    q = torch.clamp(torch.round(chans / scale[:, None]) + zero[:, None], 0, 255).to(torch.uint8)
    all_q = [torch.empty_like(q) for _ in range(world)]
    dist.all_gather(all_q, q, group=process_group)
    total = torch.zeros_like(chans)
    for (s_r, z_r), q_r in zip(all_sz, all_q):
        total += (q_r.float() - z_r[:, None]) * s_r[:, None]
    out = (total.view(-1)[:flat.numel()] / world).to(flat.dtype)
    fut = torch.futures.Future()
    fut.set_result(out)
    return fut


class TimedHook:
    """Wraps a DDP comm hook: stamps each bucket's hand-over and counts the payload the
    hook puts into collectives (PowerSGD's own element counters; the bucket in its wire
    dtype otherwise: fp32, bf16, or uint8 plus two fp32 per 512-element channel)."""

    def __init__(self, hook, state, kind: str):
        self.hook, self.state, self.kind = hook, state, kind
        self.last_ready = None
        self.bytes_sent = 0

    def reset(self) -> None:
        self.last_ready = None
        self.bytes_sent = 0

    def __call__(self, state, bucket):
        self.last_ready = time.perf_counter()
        powersgd = self.kind in POWERSGD
        before = state.total_numel_after_compression if powersgd else None
        local = self.kind == "local-sgd" and state.iter >= state.start_localSGD_iter
        fut = self.hook(state, bucket)
        buf = bucket.buffer()
        wire = 2 if self.kind == "powersgd-bf16" else buf.element_size()   # the wrapper's bf16
        if powersgd and state.total_numel_after_compression != before:
            self.bytes_sent += (state.total_numel_after_compression - before) * wire
        elif self.kind in ("bf16", "powersgd-bf16"):   # the wrapper's bf16 all-reduce first
            self.bytes_sent += buf.numel() * 2
        elif self.kind == "quantize":
            channels = -(-buf.numel() // CHANNEL)
            self.bytes_sent += channels * CHANNEL + channels * 2 * 4
        elif local:
            pass   # a subgroup of one rank: nothing leaves it
        else:  # plain all-reduce (dense hook, PowerSGD/local SGD before their start)
            self.bytes_sent += buf.numel() * buf.element_size()
        return fut


def model_fragments(model, count: int) -> list:
    """``count`` modules that hold every parameter of a ``GPTModel`` once, in layer order
    (Streaming DiLoCo's fragments; ``[model]`` for one)."""
    import torch.nn as nn

    if count == 1:
        return [model]
    model = getattr(model, "module", model)   # a bf16 model's Float16Module
    pieces = [model.embedding, *model.decoder.layers, model.decoder.final_layernorm]
    if getattr(model, "output_layer", None) is not None:
        pieces.append(model.output_layer)
    if count > len(pieces):
        raise ValueError(f"--diloco-fragments: at most {len(pieces)} for this model")
    bounds = [round(i * len(pieces) / count) for i in range(count + 1)]
    fragments = [nn.ModuleList(pieces[a:b]) for a, b in zip(bounds, bounds[1:])]
    held = [id(p) for f in fragments for p in f.parameters()]
    assert sorted(held) == sorted(id(p) for p in model.parameters()), "fragments miss weights"
    return fragments


def address_towards(peer: str) -> str:
    """This machine's address on its route to ``peer`` (no packet is sent)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(peer), 9))
        return s.getsockname()[0]


class DiLoCoEngine:
    """torchft's DiLoCo on one DP rank: its own replica group (of one process), its own
    store, a ``Manager`` meeting the others at the lighthouse, ``DiLoCo`` hooked on the
    inner optimizer's step. Counts the bytes each outer sync puts into its all-reduce (the
    synced fragment's fp32 pseudo-gradient) and, with ``--diloco-dump``, records the
    weights around each sync for the tests."""

    def __init__(self, model, optimizer, opts, dp_rank: int, dp_size: int, device):
        from datetime import timedelta

        import torch
        import torch.distributed as dist
        from torchft import Manager, ProcessGroupGloo
        from torchft.local_sgd import DiLoCo

        self.model, self.optimizer = model, optimizer
        self.fragments = model_fragments(model, opts.diloco_fragments)
        self.fragment_bytes = [sum(p.numel() * 4 for p in f.parameters())
                               for f in self.fragments]
        timeout = timedelta(seconds=opts.diloco_timeout_s)
        # the other replicas reach this one's store and manager at the address its route to
        # rank 0 leaves from ("localhost" would name each host, or namespace, its own)
        host = address_towards(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        self.store = dist.TCPStore(host, 0, 1, is_master=True, wait_for_workers=False)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=dp_size, hostname=host,
            load_state_dict=self._load, state_dict=self._state, use_async_quorum=False,
            replica_id=f"dp{dp_rank}", store_addr=host, store_port=self.store.port,
            rank=0, world_size=1, lighthouse_addr=opts.lighthouse, timeout=timeout,
            quorum_timeout=timeout, connect_timeout=timeout,
            # every replica starts from the same seeded weights; torchft's step-0 sync
            # would otherwise copy a peer's weights at the first quorum, which DiLoCo
            # holds only after H inner steps: one replica's training would be lost
            init_sync=False)
        self.outer = [torch.optim.SGD(f.parameters(), lr=opts.diloco_outer_lr,
                                      momentum=opts.diloco_outer_momentum,
                                      # torch's Nesterov needs momentum: momentum 0 with
                                      # outer lr 1 is plain averaging (LocalSGD's)
                                      nesterov=opts.diloco_outer_momentum > 0)
                      for f in self.fragments]
        self.dump = opts.diloco_dump
        self.record = {"initial": self._weights(), "syncs": []} if self.dump else None
        self._local = None
        if self.dump:   # registered before DiLoCo's: sees the local weights before a sync
            optimizer.register_step_post_hook(lambda *_: setattr(self, "_local",
                                                                 self._weights()))
        self.diloco = DiLoCo(self.manager, self.fragments, optimizer, self.outer,
                             sync_every=opts.diloco_sync_every, backup_device=device,
                             pin_memory=device.type == "cuda",
                             fragment_sync_delay=opts.diloco_fragment_sync_delay)
        self.diloco.__enter__()
        self._synced = self.manager.current_step()
        #: outer rounds, and those torchft discarded (``should_commit`` false: the round's
        #: pseudo-gradient is dropped and the local weights restored)
        self.rounds = self.discarded = 0
        should_commit = self.manager.should_commit

        def counted(*args, **kwargs):
            ok = should_commit(*args, **kwargs)
            self.rounds += 1
            self.discarded += not ok
            return ok
        self.manager.should_commit = counted

    def _weights(self) -> dict:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def _state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}

    def _load(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])

    def bytes_after_step(self) -> int:
        """After an inner step: the bytes its outer sync sent (0 where it synced nothing)."""
        step = self.manager.current_step()
        sent = sum(self.fragment_bytes[s % len(self.fragments)]
                   for s in range(self._synced, step))
        if step != self._synced and self.record is not None:
            self.record["syncs"].append({"local": self._local, "after": self._weights()})
        self._synced = step
        return sent

    def close(self, path: str) -> None:
        import torch

        self.diloco.__exit__(None, None, None)
        if self.record is not None:
            torch.save(self.record, path)
        self.manager.shutdown(wait=False)


def worker(cfg, opts, rank: int, world_size: int, local_rank: int) -> int:
    import numpy
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from torch.distributed.algorithms.ddp_comm_hooks import (default_hooks, post_localSGD_hook,
                                                             powerSGD_hook)
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer
    from torch.nn.parallel import DistributedDataParallel

    from megatron_edgc.model_shapes import padded_vocab_size
    from megatron_edgc.runtime.frontend import IterationRecords
    from megatron_edgc.runtime.telemetry import MetricsWriter
    from megatron_edgc.training.data import MicroBatchStream, build_gpt_datasets
    from megatron_edgc.training.loop import init_worker, shutdown_worker, summarize
    from megatron_edgc.training.model import layer_spec, transformer_config
    from megatron_edgc.training.tokenizer import build_tokenizer

    init_worker(cfg, rank, world_size, local_rank)
    stack = contextlib.ExitStack()   # DiLoCo's lighthouse on rank 0, until every rank is done
    try:
        parallel_state.initialize_model_parallel(1, 1)
        on_gpu = torch.cuda.is_available()
        device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
        t, m, e = cfg.training, cfg.model, cfg.edgc
        # The trainer's seeds (stage 0, TP rank 0), so the initial weights are the same.
        import random

        random.seed(t.seed)
        numpy.random.seed(t.seed)
        torch.manual_seed(t.seed)
        if on_gpu:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(t.seed)
        else:
            from megatron_edgc.patches.cpu import model_parallel_cpu_manual_seed

            model_parallel_cpu_manual_seed(t.seed, 0)
        tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.vocab_file)
        vocab = padded_vocab_size(tokenizer.vocab_size, m.make_vocab_size_divisible_by, 1)
        bf16 = bool(cfg.training.bf16)
        model = GPTModel(config=transformer_config(cfg, bf16, on_gpu),
                         transformer_layer_spec=layer_spec(), vocab_size=vocab,
                         max_sequence_length=m.max_position_embeddings, pre_process=True,
                         post_process=True, share_embeddings_and_output_weights=True,
                         position_embedding_type="learned_absolute").to(device)
        if bf16:
            # as Megatron-LM's get_model (and the trainer): every parameter in bf16, the
            # local spec's torch LayerNorm included (built in fp32, it fed the next linear
            # fp32 activations: "expected m1 and m2 to have the same dtype")
            from megatron.core.transformer.module import Float16Module

            model = Float16Module(model.config, model)
        dp_group = parallel_state.get_data_parallel_group()
        # Megatron's bucketing (default bucket: max(40M, 1M x DP) elements). It also keeps
        # PyTorch's hook working on gloo: with several buckets its chained all-reduces of P
        # and Q interleave differently per rank (measured: "Received data size doesn't
        # match expected size" with DDP's default 1 MiB first bucket).
        bucket_elems = cfg.parallel.bucket_size or max(40_000_000,
                                                       1_000_000 * dist.get_world_size(dp_group))
        kind = opts.hook
        # DiLoCo: no DDP, every rank steps alone between its outer syncs
        ddp = None if kind == "diloco" else DistributedDataParallel(
            model, device_ids=[local_rank] if on_gpu else None, process_group=dp_group,
            bucket_cap_mb=bucket_elems * 4 / 2**20)
        net = model if ddp is None else ddp
        hook = None
        if kind == "diloco":
            pass
        elif kind in POWERSGD:
            state = powerSGD_hook.PowerSGDState(
                process_group=dp_group, matrix_approximation_rank=opts.hook_rank,
                start_powerSGD_iter=opts.hook_start_iter,
                min_compression_rate=e.min_compression_rate, use_error_feedback=True,
                warm_start=True, random_seed=t.seed)
            hook = TimedHook(powerSGD_hook.powerSGD_hook if kind == "powersgd" else
                             default_hooks.bf16_compress_wrapper(powerSGD_hook.powerSGD_hook),
                             state, kind)
        elif kind == "local-sgd":
            # each rank its own subgroup: between averagings nothing crosses the DP links
            own, _ = dist.new_subgroups(group_size=1)
            state = post_localSGD_hook.PostLocalSGDState(
                process_group=dp_group, subgroup=own, start_localSGD_iter=opts.hook_start_iter)
            hook = TimedHook(post_localSGD_hook.post_localSGD_hook, state, kind)
        else:
            state = dp_group
            hook = TimedHook({"allreduce": default_hooks.allreduce_hook,
                              "bf16": default_hooks.bf16_compress_hook,
                              "quantize": quantize_perchannel_hook}[kind],
                             state, kind)

        if ddp is not None:
            def timed_hook(hook_state, bucket):  # DDP wants a function (it reads its names)
                return hook(hook_state, bucket)

            ddp.register_comm_hook(state, timed_hook)

        decay = [p for p in model.parameters() if p.dim() > 1]
        no_decay = [p for p in model.parameters() if p.dim() <= 1]
        optimizer = torch.optim.AdamW(
            [{"params": decay}, {"params": no_decay, "wd_mult": 0.0}], lr=t.lr,
            betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay)
        averager = None
        if kind == "local-sgd":
            averager = PeriodicModelAverager(period=opts.local_sgd_period,
                                             warmup_steps=opts.hook_start_iter,
                                             process_group=dp_group)
            optimizer = PostLocalSGDOptimizer(optim=optimizer, averager=averager)
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        dp_rank, dp_size = dist.get_rank(dp_group), dist.get_world_size(dp_group)
        diloco = None
        if kind == "diloco":
            if opts.lighthouse is None:   # rank 0 starts one, where every rank reaches it
                box = [None]
                if rank == 0:
                    box[0] = stack.enter_context(lighthouse(
                        dp_size, os.environ.get("MASTER_ADDR", "127.0.0.1")))
                dist.broadcast_object_list(box, src=0)
                opts.lighthouse = box[0]
            if opts.diloco_warmup_iters == 0:
                diloco = DiLoCoEngine(model, optimizer, opts, dp_rank, dp_size, device)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr,
            lr_warmup_steps=t.lr_warmup_iters, lr_decay_steps=t.lr_decay_iters,
            lr_decay_style=t.lr_decay_style, start_wd=t.weight_decay, end_wd=t.weight_decay,
            wd_incr_steps=t.train_iters, wd_incr_style="constant")

        nmb = cfg.num_microbatches
        evals = t.train_iters // cfg.eval.eval_interval + 1
        gbs = t.global_batch_size
        train_ds, valid_ds, _ = build_gpt_datasets(
            cfg, tokenizer, (t.train_iters * gbs, cfg.eval.eval_iters * gbs * evals))
        train = MicroBatchStream(train_ds, t.micro_batch_size, nmb, dp_rank, dp_size)
        valid = MicroBatchStream(valid_ds, t.micro_batch_size, nmb, dp_rank, dp_size)

        def micro_loss(net, batch):
            out = net(batch["tokens"].to(device), batch["position_ids"].to(device), None,
                      labels=batch["labels"].to(device))
            mask = batch["loss_mask"].to(device).float().view(-1)
            return torch.sum(out.float().view(-1) * mask) / mask.sum().clamp(min=1)

        def dp_mean(value: float) -> float:
            v = torch.tensor([value], dtype=torch.float64, device=device)
            dist.all_reduce(v, group=dp_group)
            return v.item() / dp_size

        @torch.no_grad()
        def evaluate() -> float:
            """The validation loss of the global model: where the replicas drift apart
            between syncs (local SGD, DiLoCo) of the replicas' average, the global model
            at an outer-sync boundary; each rank's own weights are restored after."""
            drift = kind in ("local-sgd", "diloco")
            own = [p.detach().clone() for p in model.parameters()] if drift else None
            if drift:
                for p in model.parameters():
                    dist.all_reduce(p.data, group=dp_group)
                    p.data.div_(dp_size)
            net.eval()
            losses = [micro_loss(model, b).item() for k in range(cfg.eval.eval_iters)
                      for b in valid.micro_batches(k)]
            net.train()
            if drift:
                for p, w in zip(model.parameters(), own):
                    p.data.copy_(w)
            return dp_mean(float(numpy.mean(losses)))

        evaluates = eval_schedule(t.train_iters, cfg.eval.eval_interval, *round_of(opts))
        is_logger = rank == 0
        writer = MetricsWriter(cfg.logging.metrics_file, None, is_logger)
        records = IterationRecords([writer], use_cuda=on_gpu)
        history, val_loss, start = [], None, time.perf_counter()
        tokens = gbs * m.seq_length
        bytes_sent = 0
        no_sync = contextlib.nullcontext if ddp is None else ddp.no_sync
        for it in range(t.train_iters):
            if hook is not None:
                hook.reset()
            if on_gpu:
                torch.cuda.synchronize()
            records.begin()   # the trainer's clock and span (module docstring)
            optimizer.zero_grad(set_to_none=True)
            losses = []
            for j, batch in enumerate(train.micro_batches(it)):
                last = j == nmb - 1
                if last:
                    loss = micro_loss(net, batch)
                    (loss / nmb).backward()     # DDP returns once the gradients are reduced
                else:
                    with no_sync():
                        loss = micro_loss(net, batch)
                        (loss / nmb).backward()
                losses.append(loss.detach())
            dense_warmup = kind == "diloco" and it < opts.diloco_warmup_iters
            if dense_warmup:   # DiLoCo's dense warm-up: the gradients averaged in one
                grads = [p.grad for p in model.parameters()]   # all-reduce (DDP's buckets'
                flat = torch.cat([g.view(-1) for g in grads])  # bytes, none of its overlap)
                dist.all_reduce(flat, group=dp_group)
                flat.div_(dp_size)
                for g, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                    g.copy_(reduced)
            if on_gpu:
                torch.cuda.synchronize()
            ready = time.perf_counter()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad)
            if averager is not None:   # this step() averages the parameters (all-reduce)?
                step = averager.step
                if step >= averager.warmup_steps and (step - averager.warmup_steps) \
                        % averager.period == 0:
                    hook.bytes_sent += param_bytes
            optimizer.step()     # DiLoCo: the outer sync runs in its step hook, every H
            if dense_warmup:
                bytes_sent = param_bytes
                if it + 1 == opts.diloco_warmup_iters:   # DiLoCo from the warm-up's weights
                    diloco = DiLoCoEngine(model, optimizer, opts, dp_rank, dp_size, device)
            elif diloco is not None:
                bytes_sent = diloco.bytes_after_step()
            else:
                bytes_sent = hook.bytes_sent
            scheduler.step(increment=1)
            # The loss's all-reduce over DP, inside the timed iteration as in the trainer's
            # (``Trainer._dp_mean_loss`` before ``records.end``): an iteration a user logs
            # pays it (issue 93). Left unread here, read after the clock stopped.
            loss = torch.stack(losses).float().mean()
            dist.all_reduce(loss, group=dp_group)
            if on_gpu:
                torch.cuda.synchronize()
            record = records.end(it + 1, loss=loss.double() / dp_size,
                                 lr=optimizer.param_groups[0]["lr"], grad_norm=grad_norm,
                                 skipped=False, tokens=tokens)
            # telemetry, outside the timed iteration as the trainer's (reduced at its flush)
            sent = torch.tensor([bytes_sent], dtype=torch.float64, device=device)
            dist.all_reduce(sent)
            record.update({"grad_sync_ms": [(ready - hook.last_ready) * 1e3
                                            if hook is not None and hook.last_ready is not None
                                            else float("nan")],
                           "dp_bytes_sent_job": int(sent.item()),
                           "rank_dp": [opts.hook_rank] if kind in POWERSGD and
                           it >= opts.hook_start_iter else None})
            if evaluates(it + 1):
                val_loss = evaluate()
                record["val_loss"] = val_loss
            history += records.flush()   # iter_ms, tokens_per_s, val_ppl; written
            iter_ms = record["iter_ms"]
            if is_logger and ((it + 1) % cfg.logging.log_interval == 0
                              or it + 1 == t.train_iters):
                print(f"iteration {it + 1:6d}/{t.train_iters} | loss {record['loss']:.4f} | "
                      f"{iter_ms:8.1f} ms/iter | grad sync {record['grad_sync_ms'][0]:.1f} ms"
                      f" | dp {record['dp_bytes_sent_job'] / 2**20:.2f} MiB"
                      + (f" | val loss {val_loss:.4f}" if "val_loss" in record else ""),
                      flush=True)
            if t.exit_interval and (it + 1) % t.exit_interval == 0:
                if is_logger:
                    print(f"exiting at iteration {it + 1} (--exit-interval)", flush=True)
                break
        writer.close()
        rounds = discarded = None
        if diloco is not None:
            rounds, discarded = diloco.rounds, diloco.discarded
            diloco.close(os.path.join(opts.diloco_dump or ".", f"diloco_rank{dp_rank}.pt"))
        summary = summarize(history, val_loss, time.perf_counter() - start, cfg)
        if rounds is not None:   # every replica's count: a discarded round anywhere shows
            counts = torch.tensor([rounds, discarded], dtype=torch.float64, device=device)
            dist.all_reduce(counts)
            summary["diloco_rounds"], summary["diloco_discarded_rounds"] = \
                int(counts[0].item()) // dp_size, int(counts[1].item())
        summary["val_on"] = "the replicas' average" if kind in ("local-sgd", "diloco") \
            else "the replicas (identical)"
        summary["engine"] = {
            "powersgd": f"torch DDP + powerSGD_hook r{opts.hook_rank}",
            "powersgd-bf16": f"torch DDP + bf16_compress_wrapper(powerSGD_hook) "
                             f"r{opts.hook_rank}",
            "allreduce": "torch DDP all-reduce", "bf16": "torch DDP + bf16_compress_hook",
            "quantize": "torch DDP + quantization_perchannel_hook (uint8)",
            "local-sgd": f"torch DDP + post-local SGD, average every {opts.local_sgd_period}",
            "diloco": f"torchft DiLoCo, H {opts.diloco_sync_every}, outer Nesterov lr "
                      f"{opts.diloco_outer_lr} momentum {opts.diloco_outer_momentum}"
                      + (f", after {opts.diloco_warmup_iters} dense iterations"
                         if opts.diloco_warmup_iters else "")
                      + (f", {opts.diloco_fragments} fragments, delay "
                         f"{opts.diloco_fragment_sync_delay}" if opts.diloco_fragments > 1
                         else "")}[kind]
        if is_logger and cfg.logging.metrics_file:
            import json

            with open(os.path.splitext(cfg.logging.metrics_file)[0] + ".summary.json",
                      "w") as fh:
                json.dump(summary, fh, indent=2)
            val = "n/a" if val_loss is None else f"{val_loss:.4f}"   # stopped before one
            print(f"summary | {summary['engine']} | val loss {val} | "
                  f"{summary['ms_per_iter']:.1f} ms/iter | grad sync "
                  f"{summary['grad_sync_ms']:.1f} ms", flush=True)
        if diloco is not None:
            dist.barrier()
        return 0
    finally:
        stack.close()
        shutdown_worker()


def round_of(opts) -> tuple[int, int]:
    """``(H, first)``: a mode whose replicas drift apart between syncs meets every H
    iterations from iteration ``first`` on (DiLoCo after its dense warm-up, local SGD's
    averager); ``(1, 0)`` for the modes that sync every step."""
    if opts.hook == "diloco":
        return opts.diloco_sync_every, opts.diloco_warmup_iters
    if opts.hook == "local-sgd":
        return opts.local_sgd_period, opts.hook_start_iter
    return 1, 0


def eval_schedule(train_iters: int, interval: int, h: int = 1, first: int = 0):
    """Whether iteration ``it`` (1-based) evaluates: every ``interval`` and at the end;
    where the replicas meet every ``h`` iterations from ``first`` on (issue 80), each
    evaluation moves back to the last outer round's end at or before it, so the global
    model is scored as a sync left it, never as a mid-round average (dense iterations
    before ``first`` keep their evaluations)."""
    points = sorted({*range(interval, train_iters + 1, interval), train_iters})

    def due(it: int) -> bool:
        if it <= first or h == 1:
            return it in points
        if (it - first) % h:
            return False
        nxt = next((p for p in points if p >= it), None)
        return nxt is not None and nxt - it < h
    return due


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, add_help=False,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hook", default=None, choices=HOOKS,
                   help="the DDP engine (default: powersgd, allreduce with --hook-rank 0)")
    p.add_argument("--hook-rank", type=int, default=32,
                   help="PowerSGD matrix_approximation_rank; 0: plain all-reduce hook")
    p.add_argument("--hook-start-iter", type=int, default=2,
                   help="iterations of plain all-reduce first (PowerSGD's minimum: 2)")
    p.add_argument("--local-sgd-period", type=int, default=8,
                   help="local SGD: steps between parameter averagings (>= 1)")
    p.add_argument("--diloco-sync-every", type=int, default=8,
                   help="DiLoCo: inner steps H between outer syncs (>= 1)")
    p.add_argument("--diloco-outer-lr", type=float, default=0.7,
                   help="DiLoCo: the outer Nesterov SGD's learning rate (> 0)")
    p.add_argument("--diloco-outer-momentum", type=float, default=0.9,
                   help="DiLoCo: the outer Nesterov SGD's momentum [0, 1)")
    p.add_argument("--diloco-fragments", type=int, default=1,
                   help="Streaming DiLoCo: fragments synced in turn (1: plain DiLoCo)")
    p.add_argument("--diloco-fragment-sync-delay", type=int, default=0,
                   help="Streaming DiLoCo: inner steps a fragment's sync overlaps")
    p.add_argument("--diloco-warmup-iters", type=int, default=0,
                   help="DiLoCo: iterations of dense gradient averaging first (EDGC's "
                        "warm-up), its time charged to the run; then DiLoCo from there")
    p.add_argument("--diloco-timeout-s", type=float, default=120.0,
                   help="DiLoCo: torchft's quorum and collective timeout")
    p.add_argument("--lighthouse", default=None,
                   help="DiLoCo: a running torchft lighthouse (http://HOST:PORT); default: "
                        "rank 0 starts one and stops it at the end")
    p.add_argument("--diloco-dump", default=None, metavar="DIR",
                   help="DiLoCo: save each rank's weights around every outer sync here")
    opts, rest = p.parse_known_args(argv)
    if opts.hook is None:
        opts.hook = "powersgd" if opts.hook_rank > 0 else "allreduce"
    if opts.local_sgd_period < 1:
        print("error: --local-sgd-period: must be >= 1", file=sys.stderr)
        return 2
    if opts.hook == "diloco":
        problem = diloco_problem(opts)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    from megatron_edgc.config import ConfigError, parse_config
    from megatron_edgc.training.launch import detect_launch_env, spawn_local

    if opts.hook_rank < 0:
        print("error: --hook-rank: must be >= 0", file=sys.stderr)
        return 2
    if opts.hook in POWERSGD and opts.hook_rank < 1:
        print(f"error: --hook-rank: {opts.hook} needs >= 1", file=sys.stderr)
        return 2
    if opts.hook in POWERSGD and opts.hook_start_iter < 2:
        print("error: --hook-start-iter: PyTorch's powerSGD_hook needs >= 2 with error "
              "feedback", file=sys.stderr)
        return 2
    launch = detect_launch_env()
    try:
        cfg = parse_config(rest, world_size=launch.world_size if launch else None)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    par = cfg.parallel
    if par.tensor_model_parallel_size != 1 or par.pipeline_model_parallel_size != 1:
        print("error: --pipeline-model-parallel-size/--tensor-model-parallel-size: torch DDP "
              "is the pure data-parallel baseline, both must be 1", file=sys.stderr)
        return 2
    import megatron_edgc.training.loop  # noqa: F401  (heavy imports once, before fork)

    if launch is not None:
        return worker(cfg, opts, launch.rank, launch.world_size, launch.local_rank)
    return spawn_local(functools.partial(worker, cfg, opts), par.world_size, par.master_port)


def diloco_problem(opts):
    """The first bad DiLoCo flag, as the line to print; None when they are fine."""
    try:
        import torchft  # noqa: F401
    except ImportError:
        return "--hook diloco: needs torchft, the optional extra: pip install -e '.[bench]'"
    if opts.diloco_sync_every < 1:
        return f"--diloco-sync-every: must be >= 1 (got {opts.diloco_sync_every})"
    if opts.diloco_outer_lr <= 0:
        return f"--diloco-outer-lr: must be > 0 (got {opts.diloco_outer_lr})"
    if opts.diloco_warmup_iters < 0:
        return f"--diloco-warmup-iters: must be >= 0 (got {opts.diloco_warmup_iters})"
    if not 0 <= opts.diloco_outer_momentum < 1:
        return f"--diloco-outer-momentum: must be in [0, 1) (got {opts.diloco_outer_momentum})"
    if opts.diloco_fragments < 1 or opts.diloco_sync_every % opts.diloco_fragments:
        return (f"--diloco-fragments: must be >= 1 and divide --diloco-sync-every "
                f"{opts.diloco_sync_every} (got {opts.diloco_fragments})")
    per = opts.diloco_sync_every // opts.diloco_fragments
    if not 0 <= opts.diloco_fragment_sync_delay < per:
        return (f"--diloco-fragment-sync-delay: must be in [0, {per}) (H / fragments; got "
                f"{opts.diloco_fragment_sync_delay})")
    return None


@contextlib.contextmanager
def lighthouse(min_replicas: int, host: str):
    """A ``torchft_lighthouse`` for ``min_replicas`` replica groups on a free port of this
    machine, its address as ``host`` names it while the block runs; stopped after."""
    import shutil
    import socket
    import subprocess

    exe = shutil.which("torchft_lighthouse") or os.path.join(os.path.dirname(sys.executable),
                                                             "torchft_lighthouse")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--min_replicas", str(min_replicas), "--bind",
                             f"0.0.0.0:{port}", "--quorum_tick_ms", "100",
                             "--join_timeout_ms", "10000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"torchft_lighthouse did not start (exit {proc.poll()})")
                time.sleep(0.1)
        yield f"http://{host}:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
