"""The training loop: one worker process of a TP x PP x DP job.

Reads top to bottom like Megatron's ``pretrain``: process groups → seeds → data → model,
DDP, optimizer → (resume) → for each iteration: forward/backward over the micro-batches
with megatron-core's schedule (1F1B, or interleaved with virtual stages), DP gradient
sync, optimizer step, LR step → evaluation → at ``--log-interval`` (and before a checkpoint)
the records of the iterations since the last one, read from the device at once → checkpoint
→ summary. Between two log intervals the host never waits for the device.
"""

from __future__ import annotations

import functools
import json
import math
import os
import random
import sys
import time

import numpy
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_edgc.model_shapes import padded_vocab_size
from megatron_edgc.patches.cpu import apply_cpu_shims, model_parallel_cpu_manual_seed
from megatron_edgc.runtime import device_memory, lost_ranks
from megatron_edgc.runtime.frontend import (IterationRecords, NonFiniteWeights,
                                            check_weights_finite, compute_device,
                                            guard_optimizer, is_logging_rank, log_rank0, lr_at,
                                            print_notes)
from megatron_edgc.runtime.step import CompressionTally, EdgcRuntime
from megatron_edgc.runtime.telemetry import MetricsWriter, format_progress
from megatron_edgc.training import checkpoint as ckpt
from megatron_edgc.training import zeroshot
from megatron_edgc.training.data import (MicroBatchStream, build_gpt_datasets,
                                         split_document_texts)
from megatron_edgc.training.launch import record_failure
from megatron_edgc.training.model import build_model_and_optimizer
from megatron_edgc.training.tokenizer import build_tokenizer


class Trainer:
    """State of one worker; ``run()`` trains and returns the summary (logging rank)."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.device = compute_device()
        self.on_gpu = self.device.type == "cuda"
        # the run's first line: its precision (an unset --bf16 on a CPU: timed on every
        # rank, or the checkpoint's a resume continues, agreed before the model is built)
        ck = cfg.checkpoint
        cfg.resolve_cpu_precision(resumed=ckpt.saved_precision(ck.load) if ck.load else None)
        log_rank0(cfg.precision_note)
        self.bf16 = cfg.bf16_resolved
        p = cfg.parallel
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=p.tensor_model_parallel_size,
            pipeline_model_parallel_size=p.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=p.expert_model_parallel_size,
            num_distributed_optimizer_instances=p.num_distributed_optimizer_instances)
        device_memory.mark("after the model-parallel groups")
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.is_last_stage = parallel_state.is_pipeline_last_stage()
        self.is_logger = is_logging_rank()
        self._seed(cfg.training.seed)

        self.tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.vocab_file)
        self.vocab_size = padded_vocab_size(self.tokenizer.vocab_size,
                                            cfg.model.make_vocab_size_divisible_by,
                                            p.tensor_model_parallel_size)
        self.bundle = build_model_and_optimizer(cfg, self.vocab_size, self.bf16, self.on_gpu)
        device_memory.mark("after the model and optimizer")
        # a step whose reduced gradient is not finite is skipped (any --edgc-mode, off too)
        self.guard = guard_optimizer(self.bundle.optimizer, lambda: self.iteration + 1)
        self._wire_model_config()
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.activation_shape = (cfg.model.seq_length, cfg.training.micro_batch_size,
                                 cfg.model.hidden_size)
        self.runtime = EdgcRuntime(
            cfg, self.bundle.chunks, self.bundle.config, dp_group=self.dp_group,
            pp_group=parallel_state.get_pipeline_model_parallel_group(), stage=self.stage,
            num_stages=p.pipeline_model_parallel_size, num_microbatches=cfg.num_microbatches,
            activation_shape=self.activation_shape, device=self.device,
            lr_at=functools.partial(lr_at, self.bundle.scheduler),
            optimizer=self.bundle.optimizer)
        self.bundle.config.finalize_model_grads_func = self.runtime.timed_finalize(
            finalize_model_grads)
        self.dp_compression, self.p2p, self.edgc = \
            self.runtime.dp_compression, self.runtime.p2p, self.runtime.edgc

        t, e = cfg.training, cfg.eval
        gbs = t.global_batch_size
        evals = t.train_iters // e.eval_interval + 1
        train_ds, valid_ds, test_ds = build_gpt_datasets(
            cfg, self.tokenizer, (t.train_iters * gbs, e.eval_iters * gbs * evals))
        self._held_out = {"test": test_ds, "validation": valid_ds}  # last-word examples
        self._last_word_stream = None
        nmb = cfg.num_microbatches
        self.train_stream = MicroBatchStream(train_ds, t.micro_batch_size, nmb, self.dp_rank,
                                             p.data_parallel_size)
        self.valid_stream = MicroBatchStream(valid_ds, t.micro_batch_size, nmb, self.dp_rank,
                                             p.data_parallel_size)
        self.forward_backward = get_forward_backward_func()
        self.iteration = 0
        self.records = IterationRecords([], self.runtime, use_cuda=self.on_gpu)

    # ------------------------------------------------------------------ setup

    def _seed(self, seed: int) -> None:
        # Megatron's scheme: a different stream per pipeline stage, equal over DP.
        seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
        random.seed(seed)
        numpy.random.seed(seed)
        torch.manual_seed(seed)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        if self.on_gpu:
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(seed)
        else:
            model_parallel_cpu_manual_seed(
                seed, tp_rank, parallel_state.get_expert_model_parallel_rank())

    def _wire_model_config(self) -> None:
        """What Megatron-LM's ``train()`` sets on the model config for the schedules."""
        chunks, config = self.bundle.chunks, self.bundle.config
        config.grad_scale_func = self.bundle.optimizer.scale_loss
        config.finalize_model_grads_func = finalize_model_grads
        if self.cfg.parallel.overlap_grad_reduce:
            no_sync = [c.no_sync for c in chunks]
            config.no_sync_func = no_sync[0] if len(chunks) == 1 else no_sync
            if len(chunks) > 1:
                config.grad_sync_func = [c.start_grad_sync for c in chunks]

    # ------------------------------------------------------------------ steps

    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        tokens = batch["tokens"].to(self.device, non_blocking=True)
        labels = batch["labels"].to(self.device, non_blocking=True)
        position_ids = batch["position_ids"].to(self.device, non_blocking=True)
        loss_mask = batch["loss_mask"].to(self.device, non_blocking=True).float()
        output = model(tokens, position_ids, None, labels=labels)

        def loss_func(output_tensor):
            mask = loss_mask.view(-1)
            loss = torch.sum(output_tensor.float().view(-1) * mask) / mask.sum().clamp(min=1)
            return loss, {"lm loss": loss.detach().clone()}

        return output, loss_func

    def _run_schedule(self, stream, index: int, forward_only: bool,
                      forward_step_func=None) -> list:
        """One pass of ``stream.micro_batches(index)`` through megatron-core's schedule."""
        n_chunks = len(self.bundle.chunks)
        iters = [iter(stream.micro_batches(index)) for _ in range(n_chunks)]
        t, m = self.cfg.training, self.cfg.model
        extra = self.runtime.schedule_kwargs()
        return self.forward_backward(
            forward_step_func=forward_step_func or self._forward_step,
            data_iterator=iters if n_chunks > 1 else iters[0],
            model=self.bundle.chunks if n_chunks > 1 else self.bundle.chunks[0],
            num_microbatches=self.cfg.num_microbatches,
            seq_length=m.seq_length, micro_batch_size=t.micro_batch_size,
            decoder_seq_length=m.seq_length, forward_only=forward_only, **extra)

    def _dp_mean_loss(self, losses: list):
        """Mean of the micro-batch losses on the last stage, averaged over DP (a 0-dim
        tensor on the device, unread); NaN elsewhere."""
        if not self.is_last_stage:
            return float("nan")
        value = torch.stack([d["lm loss"].float() for d in losses]).mean().to(self.device)
        dist.all_reduce(value, group=self.dp_group)
        return value.double() / self.cfg.parallel.data_parallel_size

    def train_step(self) -> dict:
        """Iteration ``self.iteration + 1``; returns its record, whose device values and
        job-wide telemetry :meth:`IterationRecords.flush` reads at the log interval."""
        self.records.begin()
        for chunk in self.bundle.chunks:
            chunk.zero_grad_buffer()
        self.bundle.optimizer.zero_grad()
        self.runtime.begin_step(self.iteration)
        losses = self._run_schedule(self.train_stream, self.iteration, forward_only=False)
        update_ok, grad_norm, _ = self.bundle.optimizer.step()
        if update_ok:
            self.bundle.scheduler.step(increment=1)
        t = self.cfg.training
        # the runtime's end_step (the controller decides) runs inside, before the end stamp
        return self.records.end(
            self.iteration + 1, loss=self._dp_mean_loss(losses),
            lr=self.bundle.optimizer.param_groups[0]["lr"], grad_norm=grad_norm,
            skipped=not update_ok, tokens=t.global_batch_size * self.cfg.model.seq_length)

    def _report_device_memory(self) -> None:
        """Once, after the first step: what the process holds outside the allocator."""
        device_memory.mark("after the first step")
        line = device_memory.format_marks()
        if line and self.is_logger:
            print(line, flush=True)

    @torch.no_grad()
    def evaluate(self):
        """The validation loss (a 0-dim tensor on the device, unread, on the last stage;
        NaN elsewhere)."""
        for chunk in self.bundle.chunks:
            chunk.eval()
        values = []
        for k in range(self.cfg.eval.eval_iters):
            values.append(self._dp_mean_loss(self._run_schedule(self.valid_stream, k, True)))
        for chunk in self.bundle.chunks:
            chunk.train()
        if not self.is_last_stage:
            return float("nan")
        return torch.stack(values).mean()

    # ------------------------------------------------------------------ last word

    def _last_word_examples(self, n: int) -> list:
        """``n`` examples from the test split's documents, topped up from the validation
        split's when the test split is too small (neither is ever trained on)."""
        seq = self.cfg.model.seq_length
        test = split_document_texts(self._held_out["test"], self.tokenizer)
        examples = zeroshot.build_last_word_examples(self.tokenizer, test, n, seq)
        if len(examples) < n:
            valid = split_document_texts(self._held_out["validation"], self.tokenizer)
            more = zeroshot.build_last_word_examples(self.tokenizer, valid, n - len(examples),
                                                     seq)
            log_rank0(f"last-word eval: the test split ({len(test)} documents) gives "
                 f"{len(examples)} of {n} examples; taking {len(more)} from the validation "
                 f"split ({len(valid)} documents)")
            examples += more
        if len(examples) < n:
            log_rank0(f"last-word eval: the held-out documents give only {len(examples)} examples "
                 f"(--last-word-examples {n})")
        return examples

    def _last_word_step(self, data_iterator, model):
        batch = next(data_iterator)
        tokens = batch["tokens"].to(self.device, non_blocking=True)
        position_ids = batch["position_ids"].to(self.device, non_blocking=True)
        output = model(tokens, position_ids, None)  # no labels: logits [b, s, vocab / TP]

        def score_func(logits):
            tp = parallel_state.get_tensor_model_parallel_world_size()
            s = zeroshot.score(logits, batch["target_pos"], batch["target_ids"],
                               vocab_size=self.tokenizer.vocab_size,
                               gather=gather_from_tensor_model_parallel_region if tp > 1
                               else None)
            counts = torch.stack([s.correct.sum().double(), s.valid.sum().double(),
                                  s.nll.double().sum()])
            return torch.zeros((), device=logits.device), {"last_word": counts}

        return output, score_func

    @torch.no_grad()
    def last_word_eval(self) -> dict:
        """Zero-shot last-word accuracy on held-out passages (``--last-word-examples``),
        forward-only through megatron-core's schedule; DP ranks split the examples.

        Returns ``last_word_acc``, ``last_word_n`` and ``last_word_nll`` (mean -log p of
        the word, nats) on the last pipeline stage; ``{}`` on the others.
        """
        t = self.cfg.training
        if self._last_word_stream is None:  # built once, identically on every rank
            self._last_word_stream = zeroshot.LastWordStream(
                self._last_word_examples(self.cfg.eval.last_word_examples),
                self.cfg.model.seq_length, self.tokenizer.eod, t.micro_batch_size,
                self.cfg.num_microbatches, self.dp_rank, self.cfg.parallel.data_parallel_size)
        stream = self._last_word_stream
        for chunk in self.bundle.chunks:
            chunk.eval()
        totals = torch.zeros(3, dtype=torch.float64)
        for call in range(stream.num_calls):
            for out in self._run_schedule(stream, call, True, self._last_word_step):
                totals += out["last_word"].cpu()
        for chunk in self.bundle.chunks:
            chunk.train()
        if not self.is_last_stage:
            return {}
        totals = totals.to(self.device)
        dist.all_reduce(totals, group=self.dp_group)
        correct, n, nll = totals.tolist()
        return {"last_word_acc": correct / n if n else None, "last_word_n": int(n),
                "last_word_nll": nll / n if n else None}

    # ------------------------------------------------------------------ loop

    def run(self) -> dict:
        cfg = self.cfg
        t, lg, ck = cfg.training, cfg.logging, cfg.checkpoint
        if ck.load and (not ck.auto_resume or ckpt.read_latest_iteration(ck.load) is not None):
            self.iteration = ckpt.load_checkpoint(ck.load, self.bundle, cfg)
            log_rank0(f"resumed from {ck.load} at iteration {self.iteration}")
        elif ck.load:
            log_rank0(f"no checkpoint in {ck.load} yet: starting from iteration 0")
        print_notes(cfg)
        self.records.writers = [MetricsWriter(lg.metrics_file, lg.tensorboard_dir,
                                              self.is_logger, resume_from=self.iteration)]
        history = []
        first = self.iteration + 1   # this process's first step: the memory line after it
        start_time = time.perf_counter()
        try:
            while self.iteration < t.train_iters:
                record = self.train_step()
                self.iteration += 1
                it = self.iteration
                if it == first:
                    self._report_device_memory()
                if it % cfg.eval.eval_interval == 0 or it == t.train_iters:
                    record["val_loss"] = self.evaluate()   # read with the record
                if it == t.train_iters and cfg.eval.last_word_examples:
                    record.update(self.last_word_eval())
                logs = it % lg.log_interval == 0 or it == t.train_iters
                saves = bool(ck.save and ck.save_interval and it % ck.save_interval == 0)
                exits = bool(t.exit_interval and it % t.exit_interval == 0)
                if logs or saves or exits:   # the only host waits for the device
                    history += self.records.flush()
                if logs and self.is_logger:
                    print(format_progress_line(it, t.train_iters, history[-1]), flush=True)
                if saves:
                    check_weights_finite(self.bundle.chunks, f"at iteration {it}",
                                         self.bundle.weights())
                    ckpt.save_checkpoint(ck.save, it, self.bundle, cfg)
                if exits:
                    log_rank0(f"exiting at iteration {it} (--exit-interval)")
                    break
            last_saved = ck.save_interval and self.iteration % ck.save_interval == 0
            check_weights_finite(self.bundle.chunks, f"at the end (iteration {self.iteration})",
                                 self.bundle.weights())
            if ck.save and not last_saved:
                ckpt.save_checkpoint(ck.save, self.iteration, self.bundle, cfg)
        finally:
            self.records.close()
        val_loss = next((r["val_loss"] for r in reversed(history) if "val_loss" in r), None)
        summary = summarize(history, val_loss, time.perf_counter() - start_time, cfg)
        if self.runtime.dp_compression is not None:
            summary["compression"] = self.runtime.tally.summary()
        if self.runtime.loss_scale_changes is not None:   # fp16's dynamic loss scale
            summary["loss_scale_changes"] = int(self.runtime.loss_scale_changes)
            summary["final_loss_scale"] = float(self.bundle.optimizer.get_loss_scale())
        if self.is_logger:
            print(format_summary(summary), flush=True)
            if lg.metrics_file:
                with open(os.path.splitext(lg.metrics_file)[0] + ".summary.json", "w") as fh:
                    json.dump(summary, fh, indent=2)
        return summary


def summarize(history: list, val_loss, wall_s: float, cfg) -> dict:
    """Final figures; ms/iter excludes the first iterations (warm-up of caches)."""
    steady = history[min(3, max(0, len(history) - 1)):] if history else []
    ms = [r["iter_ms"] for r in steady]
    return {
        "iterations": history[-1]["iteration"] if history else 0,
        # steps not taken: a non-finite gradient (the guard), an fp16 overflow (the scaler)
        "skipped_iterations": sum(bool(r.get("skipped")) for r in history),
        "first_loss": history[0]["loss"] if history else None,
        "final_loss": float(numpy.mean([r["loss"] for r in history[-10:]])) if history else None,
        "val_loss": val_loss,
        "val_ppl": math.exp(min(val_loss, 50.0)) if val_loss is not None else None,
        "ms_per_iter": float(numpy.mean(ms)) if ms else None,
        "tokens_per_s": float(numpy.mean([r["tokens_per_s"] for r in steady])) if steady else None,
        "dp_bytes_per_iter": float(numpy.mean([r["dp_bytes_sent_job"] for r in history]))
        if history else None,
        "pp_bytes_per_iter": float(numpy.mean([r["pp_bytes_sent_job"] for r in history]))
        if history and "pp_bytes_sent_job" in history[0] else None,
        "dp_sync_end_spread_ms": float(numpy.mean([r["dp_sync_end_spread_ms"] for r in steady]))
        if steady and "dp_sync_end_spread_ms" in steady[0] else None,
        # the slowest stage's "last backward done → gradients ready", per iteration
        "grad_sync_ms": float(numpy.mean([numpy.nanmax(r["grad_sync_ms"]) for r in steady]))
        if steady and "grad_sync_ms" in steady[0] else None,
        "last_word_acc": history[-1].get("last_word_acc") if history else None,
        "last_word_n": history[-1].get("last_word_n") if history else None,
        "last_word_nll": history[-1].get("last_word_nll") if history else None,
        "wall_s": wall_s,
        "layout": f"TP{cfg.parallel.tensor_model_parallel_size}·"
                  f"PP{cfg.parallel.pipeline_model_parallel_size}·"
                  f"DP{cfg.parallel.data_parallel_size}",
    }


def format_progress_line(it: int, total: int, record: dict) -> str:
    """The trainer's line at ``--log-interval``: progress, then validation and last-word."""
    line = format_progress(it, total, record)
    if "val_loss" in record:
        line += f" | val loss {record['val_loss']:.4f} | val ppl {record['val_ppl']:.2f}"
    if record.get("last_word_n") is not None:
        line += " | " + format_last_word(record)
    return line


def format_last_word(s: dict) -> str:
    acc = s.get("last_word_acc")
    return f"last-word acc {'n/a' if acc is None else format(100 * acc, '.1f')} % " \
           f"(n={s.get('last_word_n')})"


def format_summary(s: dict) -> str:
    def f(v, spec):
        return "n/a" if v is None else format(v, spec)

    last_word = [format_last_word(s)] if s.get("last_word_n") is not None else []
    return ("summary | " + " | ".join([
        f"{s['layout']}", f"{s['iterations']} iterations",
        f"{s.get('skipped_iterations', 0)} skipped",
        *([f"{s['loss_scale_changes']} loss-scale changes (now {s['final_loss_scale']:g})"]
          if "loss_scale_changes" in s else []),
        f"loss {f(s['first_loss'], '.4f')} -> {f(s['final_loss'], '.4f')}",
        f"val loss {f(s['val_loss'], '.4f')}", f"val ppl {f(s['val_ppl'], '.2f')}",
        *last_word,
        f"{f(s['ms_per_iter'], '.1f')} ms/iter", f"{f(s['tokens_per_s'], '.0f')} tok/s",
        f"grad sync {f(s.get('grad_sync_ms'), '.1f')} ms",
        *([CompressionTally.line(s["compression"])] if s.get("compression") else []),
        f"wall {s['wall_s']:.1f} s"]))


def init_worker(cfg, rank: int, world_size: int, local_rank: int) -> None:
    """Device, CPU shims (without CUDA) and the default process group of one rank."""
    on_gpu = torch.cuda.is_available()
    if on_gpu:  # more local ranks than GPUs (gloo only: NCCL refuses two ranks on one GPU)
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.cuda.init()
        device_memory.mark("with the CUDA context")
    else:
        apply_cpu_shims(cfg.allow_untested_megatron)
    backend = cfg.parallel.distributed_backend or ("nccl" if on_gpu else "gloo")
    # no device_id, as Megatron-LM's own initialize: bound, every group megatron-core makes
    # got an NCCL communicator at once, used or not (6.5 GB of an H200 outside the allocator
    # for one rank's ~20 groups, bench/gpu_memory.py); unbound, a group gets one at its first
    # collective
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                            store=_restart_safe_store(world_size))
    device_memory.mark("after the default process group")


def _restart_safe_store(world_size: int):
    """Under torchrun's agent store, a store whose keys are scoped to this restart attempt.

    torch 2.13's env:// rendezvous assumes a fresh agent store per attempt, but the c10d
    rendezvous keeps the same one: after ``--max-restarts`` restarts the new workers read
    the dead ones' gloo addresses (measured: "connectFullMesh failed ... Connection refused"
    in the restarted init_process_group). Elsewhere None: the default env:// rendezvous.
    """
    import datetime

    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size, is_master=False,
                          timeout=datetime.timedelta(minutes=10))
    return dist.PrefixStore(f"edgc/attempt_{attempt}", store)


def shutdown_worker() -> None:
    try:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    except Exception:
        pass


def worker_main(cfg, rank: int, world_size: int, local_rank: int) -> int:
    """Entry of one training process (spawned locally, or started by torchrun/srun)."""
    init_worker(cfg, rank, world_size, local_rank)
    lost_ranks.watch()   # torchrun: a rank lost without an error of its own is named
    try:
        Trainer(cfg).run()
        return 0
    except ckpt.CheckpointError as exc:
        record_failure(rank, exc, reported=True)
        if not getattr(exc, "secondary", False):  # the failing rank says it, once
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except NonFiniteWeights as exc:   # every rank raises it (all-reduced): rank 0 says it
        record_failure(rank, exc, reported=True)
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 3
    except BaseException as exc:
        lost_ranks.report(exc)   # first failing rank: names the lost ranks (torchrun)
        raise
    finally:
        shutdown_worker()
