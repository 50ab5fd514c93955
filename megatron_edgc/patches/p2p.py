"""Low-rank pipeline backward sends on megatron-core's ``P2PCommunicator`` (EDGC §7).

megatron-core 0.14+'s schedules take a ``p2p_communicator=`` argument and route every
pipeline transfer through its ``_communicate``; :class:`CompressingP2PCommunicator`
overrides that one method (0.13.x's module-level ``_communicate`` is routed to the same
class on :class:`_ModuleLevelP2PCommunicator`: :func:`install_schedule_adapter`). Forward
activations go out untouched. A backward activation gradient ``[seq, micro_batch, hidden]`` is sent, when
compressed, as one fp32 message ``[header | P^ | Q]`` (``compression/activation.py``:
lazy error propagation, warm-started power iteration); the receiver rebuilds ``P^ Qᵀ``
into the tensor the schedule gets. With ``overlap_p2p_comm`` (interleaved schedule) the
rebuild runs in the receive handle's ``wait()``, where the schedule waits anyway.

Which messages are compressed, and at what rank, is a pure function that sender and
receiver evaluate alike: messages on a directed edge are FIFO, so both count them per
iteration (``k``), and message ``k`` is compressed when the shared rank (set on every
rank at the same iteration from the broadcast table) is not ``None`` and — with
``epilogue_only`` — ``k`` falls in the receiving stage's 1F1B cool-down (its last
``num_warmup_microbatches`` backward steps, megatron-core's own count). Every compressed
message carries ``(table version, rank, n, m, k)``; a receiver that expected anything
else raises :class:`PipelineRankMismatch` instead of decoding garbage. (A sender whose
message is larger than the receive buffer aborts in gloo; NCCL has no such check, which
is why the table is broadcast rather than recomputed independently.)

No send or receive waits for the device: the header is built and checked on the device
(the receiver sizes its buffer from its own rank, not from the header), a message whose
header disagrees is decoded as NaN, and :meth:`CompressingP2PCommunicator.check_messages`
reads the step's headers once, after the step's work, and raises there. Non-finite sends
are likewise flagged on the device and read by :meth:`PPSendStats.resolve`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import p2p_communication

from megatron_edgc.compression.activation import ActivationGradSender, decompress
from megatron_edgc.compression.matrices import FLOAT_BYTES  # noqa: F401 (message size unit)
from megatron_edgc.patches import features

logger = logging.getLogger(__name__)

MAGIC = 7351.0
HEADER = 6  # magic, table version, rank, n, m, message index (fp32: exact below 2^24)


class PipelineRankMismatch(RuntimeError):
    """Sender and receiver of a pipeline message disagree on its rank or identity."""


@dataclass
class PPSendStats:
    """This rank's backward sends in one iteration (``events`` filled by :meth:`resolve`)."""

    bytes_sent: int = 0
    bytes_dense: int = 0
    events: list = field(default_factory=list)
    stage: int = 0
    _nonfinite: list = field(default_factory=list)  # (message index, bool device tensor)

    def reset(self) -> None:
        self.bytes_sent = self.bytes_dense = 0
        self.events = []
        self._nonfinite = []

    def add_nonfinite_flag(self, k: int, flag: torch.Tensor) -> None:
        """Backward message ``k``'s non-finite flag (bool, on the device)."""
        self._nonfinite.append((k, flag))

    def resolve(self) -> None:
        """Read the step's non-finite flags into ``events`` (once per step, after its work)."""
        if self._nonfinite:
            flags = torch.stack([flag for _, flag in self._nonfinite]).tolist()
            for (k, _), bad in zip(self._nonfinite, flags):
                if bad:
                    self.events.append(f"non-finite activation gradient in backward message "
                                       f"{k} of stage {self.stage}: sent as such, residual kept")
        self._nonfinite = []


class _DecompressOnWait:
    """A receive handle whose ``wait()`` also rebuilds the gradient (once)."""

    def __init__(self, work, finish: Callable[[], None]):
        self._work, self._finish = work, finish

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
            self._finish()

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


def warmup_microbatches(pp_size: int, stage: int, num_microbatches: int, num_chunks: int,
                        group_size: int) -> int:
    """megatron-core's count of forward passes before a stage's first backward (= the
    length of its cool-down): 1F1B ``p - s - 1``; interleaved ``2 (p - s - 1) + (V - 1) g``."""
    if num_chunks == 1:
        w = pp_size - stage - 1
    else:
        w = (pp_size - stage - 1) * 2 + (num_chunks - 1) * group_size
    return min(w, num_microbatches * num_chunks)


# megatron-core 0.13.x: the module-level ``_communicate(..., config=)`` every transfer goes
# through (captured before the schedule adapter may route it elsewhere).
_MODULE_COMMUNICATE = getattr(p2p_communication, "_communicate", None)


class _ModuleLevelP2PCommunicator:
    """``P2PCommunicator`` for megatron-core 0.13.x, which has none: the same attributes
    (``pp_group``, ``config``, global ``prev_rank`` / ``next_rank``), and ``_communicate``
    delegating to the module-level function."""

    def __init__(self, pp_group, config):
        self.pp_group, self.config = pp_group, config
        size, rank = pp_group.size(), pp_group.rank()
        self.next_rank = dist.get_global_rank(pp_group, (rank + 1) % size)
        self.prev_rank = dist.get_global_rank(pp_group, (rank - 1) % size)

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next,
                     tensor_shape, wait_on_reqs=True):
        return _MODULE_COMMUNICATE(
            tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev,
            recv_prev=recv_prev, recv_next=recv_next, tensor_shape=tensor_shape,
            config=self.config, wait_on_reqs=wait_on_reqs)


# megatron-core 0.14+: the class the schedules take; 0.13.x: the stand-in above.
_P2PBase = getattr(p2p_communication, "P2PCommunicator", None) or _ModuleLevelP2PCommunicator

_SCHEDULES = ("forward_backward_no_pipelining",
              "forward_backward_pipelining_without_interleaving",
              "forward_backward_pipelining_with_interleaving")


@contextlib.contextmanager
def _module_level_route(communicator):
    """0.13.x: the module-level ``_communicate`` sends through ``communicator`` meanwhile."""
    original = p2p_communication._communicate

    def communicate(*, config, **kwargs):
        return communicator._communicate(**kwargs)

    p2p_communication._communicate = communicate
    try:
        yield
    finally:
        p2p_communication._communicate = original


def _grad_finalize_pgs():
    """0.14.x: the ``grad_finalize_pgs`` its schedules build when given none (their own
    default, from ``parallel_state``), for a call that passes a communicator."""
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import GradFinalizeProcessGroups

    pgs = GradFinalizeProcessGroups()
    pgs.tp = parallel_state.get_tensor_model_parallel_group()
    pgs.cp = parallel_state.get_context_parallel_group()
    pgs.embd = parallel_state.get_embedding_group(check_initialized=False)
    pgs.pos_embd = parallel_state.get_position_embedding_group(check_initialized=False)
    pgs.pp = parallel_state.get_pipeline_model_parallel_group()
    pgs.dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True,
                                                       partial_data_parallel=False)
    return pgs


def _adapt_schedule(fn):
    params = set(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def adapted(*args, **kwargs):
        if "pg_collection" not in params:
            kwargs.pop("pg_collection", None)       # the mpu groups: the schedule's default
        communicator = kwargs.get("p2p_communicator")
        if "p2p_communicator" not in params:         # 0.13.x
            kwargs.pop("p2p_communicator", None)
            if communicator is not None:
                with _module_level_route(communicator):
                    return fn(*args, **kwargs)
        elif communicator is not None and "grad_finalize_pgs" in params \
                and kwargs.get("grad_finalize_pgs") is None:   # 0.14.x
            kwargs["grad_finalize_pgs"] = _grad_finalize_pgs()
        return fn(*args, **kwargs)

    adapted.__edgc_schedule_adapter__ = True
    return adapted


class _MpuProcessGroups:
    """0.13.x, 0.14.x: stands in for ``ProcessGroupCollection`` (0.15+), which the training
    loops use as ``ProcessGroupCollection.use_mpu_process_groups()`` next to the
    communicator; the adapted schedules drop it (the mpu groups are their default)."""

    @classmethod
    def use_mpu_process_groups(cls, required_pgs=None):
        return cls()


def install_schedule_adapter() -> str:
    """Let megatron-core's schedules take ``p2p_communicator=`` and ``pg_collection=`` as
    0.15+ does (the training loops pass both): 0.14.x gets ``grad_finalize_pgs`` instead,
    0.13.x routes its module-level transfers to the communicator for the call; both get a
    stand-in ``process_groups_config.ProcessGroupCollection``. Nothing is touched on 0.15+.
    ``get_forward_backward_func`` reads the module's attributes, so call this before it.
    Returns the schedules' form (``features.schedule_form``)."""
    from megatron.core import process_groups_config
    from megatron.core.pipeline_parallel import schedules

    form = features.schedule_form()
    if form == "pg_collection":
        return form
    if not hasattr(process_groups_config, "ProcessGroupCollection"):
        process_groups_config.ProcessGroupCollection = _MpuProcessGroups
    for name in _SCHEDULES:
        fn = getattr(schedules, name)
        if not getattr(fn, "__edgc_schedule_adapter__", False):
            setattr(schedules, name, _adapt_schedule(fn))
    return form


def _device() -> torch.device:
    """The device the pipeline's messages are on (megatron-core's: the current GPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")


class CompressingP2PCommunicator(_P2PBase):
    """Megatron's communicator with backward sends compressed at the shared PP rank.

    ``rank`` None means dense (warm-up, or compression off until ``set_rank``).
    ``begin_iteration`` must be called before each training schedule (it resets the
    message counters that pair sends with receives).
    """

    #: this iteration's loss scale (fp16's scaler, float ``[1]`` on the device; None
    #: without one): each sender keeps its residual net of it
    loss_scale: Optional[torch.Tensor] = None

    def __init__(self, pp_group, config, *, num_microbatches: int, num_chunks: int = 1,
                 epilogue_only: bool = False, seed: int = 0, timer=None):
        features.require("p2p")
        install_schedule_adapter()
        super().__init__(pp_group, config)
        if config.variable_seq_lengths or config.use_ring_exchange_p2p \
                or getattr(config, "mtp_standalone", False):
            raise ValueError("pipeline compression needs fixed shapes and isend/irecv "
                             "(no variable_seq_lengths, ring exchange or MTP stages)")
        self.pp_size, self.stage = pp_group.size(), pp_group.rank()
        self.num_microbatches, self.num_chunks = num_microbatches, num_chunks
        self.epilogue_only, self.seed, self.timer = epilogue_only, seed, timer
        self.rank: Optional[int] = None
        self.table_version = 0
        self.stats = PPSendStats(stage=self.stage)
        self._headers: dict = {}   # (device, version, r, n, m) -> the header without k
        self._received: list = []  # this step's (k, expected header, received header)
        self.entropy_probe: Optional[Callable[[torch.Tensor], None]] = None
        self.senders: dict[int, ActivationGradSender] = {}
        self.send_count = self.recv_count = 0
        group = config.microbatch_group_size_per_vp_stage or self.pp_size
        self._group_size = group
        # The model chunk behind each backward message this stage sends (for the
        # per-chunk residual): the schedule's backward order, minus chunk 0 of stage 0.
        if num_chunks == 1:
            self._send_chunk = None
        else:
            from megatron.core.pipeline_parallel.schedules import get_schedule_table

            table = get_schedule_table(num_microbatches, num_chunks, group)
            order = [num_chunks - 1 - chunk for _, chunk in table]
            self._send_chunk = [c for c in order if not (self.stage == 0 and c == 0)]

    # ------------------------------------------------------------------ control

    def set_rank(self, rank: Optional[int], version: int) -> None:
        """The PP rank from the shared table (same call, same iteration, on every rank)."""
        self.rank, self.table_version = rank, version
        if rank is not None:
            for sender in self.senders.values():
                sender.set_rank(rank)

    def begin_iteration(self) -> None:
        """Before each run of a schedule: counters restart, each sender marks anew."""
        self.send_count = self.recv_count = 0
        self.stats.reset()
        self._received = []
        for sender in self.senders.values():
            sender.begin_iteration()

    def after_step(self, applied: bool) -> None:
        """The iteration's outcome, from the report the DP units take: a step not applied
        rolls every sender back to the iteration's start (docs/reliability.md)."""
        for sender in self.senders.values():
            sender.after_step(applied)

    def messages_per_iteration(self, receiver: int) -> int:
        """Backward messages per iteration on the edge into stage ``receiver``."""
        sender = (receiver + 1) % self.pp_size
        if self.num_chunks == 1:
            return self.num_microbatches if sender > 0 else 0
        chunks = self.num_chunks - 1 if sender == 0 else self.num_chunks
        return self.num_microbatches * chunks

    def compressed(self, k: int, receiver: int) -> bool:
        """Whether message ``k`` of this iteration into stage ``receiver`` is compressed."""
        if self.rank is None:
            return False
        if not self.epilogue_only:
            return True
        cooldown = warmup_microbatches(self.pp_size, receiver, self.num_microbatches,
                                       self.num_chunks, self._group_size)
        return k >= self.messages_per_iteration(receiver) - cooldown

    # ------------------------------------------------------------------ messages

    def _sender(self, k: int) -> ActivationGradSender:
        chunk = 0 if self._send_chunk is None else self._send_chunk[k % len(self._send_chunk)]
        if chunk not in self.senders:
            self.senders[chunk] = self._new_sender(chunk, self.rank)
        return self.senders[chunk]

    def prepare(self, shape, device) -> None:
        """Every sender's warm start and residual for messages of ``shape`` at the rank in
        force, before the schedule: the first compressed send seeds nothing inside
        backward (a message of another shape still re-seeds there)."""
        if self.rank is None:
            return
        chunks = set(self._send_chunk) if self._send_chunk is not None else \
            ({0} if self.stage > 0 else set())
        n, m = math.prod(shape[:-1]), shape[-1]
        for chunk in sorted(chunks):
            if chunk not in self.senders:
                self.senders[chunk] = self._new_sender(chunk, self.rank)
            self.senders[chunk].prepare(n, m, device)

    def _new_sender(self, chunk: int, rank: int) -> ActivationGradSender:
        sender = ActivationGradSender(rank, seed=self.seed,
                                      name=f"pp-stage{self.stage}-chunk{chunk}")
        sender.marks = True   # driven iteration by iteration from its first
        return sender

    def _header(self, r: int, n: int, m: int, k: int, device) -> torch.Tensor:
        """``[MAGIC, table version, r, n, m, k]`` in fp32, made on ``device`` (a tensor from
        host data would wait for the stream); the first five cached for the table in force."""
        key = (str(device), self.table_version, r, n, m)
        if key not in self._headers:
            self._headers = {c: v for c, v in self._headers.items() if c[1] == key[1]}
            self._headers[key] = torch.cat([torch.full((1,), float(v), device=device)
                                            for v in (MAGIC, self.table_version, r, n, m)])
        return torch.cat([self._headers[key], torch.full((1,), float(k), device=device)])

    def _pack(self, grad: torch.Tensor, k: int) -> torch.Tensor:
        n, m = grad.numel() // grad.shape[-1], grad.shape[-1]
        sender = self._sender(k)
        sender.loss_scale = self.loss_scale
        p_hat, q = sender.compress(grad.detach())
        r = p_hat.shape[1]
        self.stats.add_nonfinite_flag(k, torch.isfinite(p_hat).all().logical_not())
        return torch.cat([self._header(r, n, m, k, grad.device), p_hat.reshape(-1),
                          q.reshape(-1)])

    def _unpack_into(self, buf: torch.Tensor, out: torch.Tensor, k: int, r: int) -> None:
        """Rebuild ``P^ Qᵀ`` into ``out``, all NaN where the header is not the expected one
        (compared on the device; :meth:`check_messages` raises at the step's end)."""
        n, m = out.numel() // out.shape[-1], out.shape[-1]
        mismatch = (buf[:HEADER] != self._header(r, n, m, k, buf.device)).any()  # NaN too
        self._received.append((k, [int(MAGIC), self.table_version, r, n, m, k],
                               buf[:HEADER].clone()))
        p_hat = buf[HEADER:HEADER + n * r].view(n, r)
        q = buf[HEADER + n * r:].view(m, r).masked_fill(mismatch, float("nan"))
        with torch.no_grad():
            out.copy_(decompress(p_hat, q, out.shape, out.dtype))

    def take_received(self) -> list:
        """The step's received headers, unread, handed over (for :meth:`check_messages` at
        the log interval); the next step's start empty."""
        received, self._received = self._received, []
        return received

    def check_messages(self, received: Optional[list] = None) -> None:
        """Raise :class:`PipelineRankMismatch` for the first received message whose header
        was not the expected one, of ``received`` (:meth:`take_received`) or of the step so
        far (reads the headers: call after the step's work)."""
        if received is None:
            received = self.take_received()
        if not received:
            return
        headers = torch.stack([header for _, _, header in received]).tolist()
        for (k, want, _), values in zip(received, headers):
            if values != want:  # a NaN is unequal to everything
                got = [int(v) if math.isfinite(v) else -1 for v in values]
                raise PipelineRankMismatch(
                    f"stage {self.stage} expected backward message {k} from stage "
                    f"{(self.stage + 1) % self.pp_size} as (version, rank, n, m) = "
                    f"{tuple(want[1:5])}, got {tuple(got[1:5])} as message {got[5]}: "
                    f"the pipeline rank tables disagree")

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next,
                     tensor_shape, wait_on_reqs=True):
        if tensor_send_prev is None and not recv_next:  # forward traffic: megatron's path
            return super()._communicate(
                tensor_send_next=tensor_send_next, tensor_send_prev=tensor_send_prev,
                recv_prev=recv_prev, recv_next=recv_next, tensor_shape=tensor_shape,
                wait_on_reqs=wait_on_reqs)
        config, device = self.config, _device()
        send_start = self.timer.stamp() if self.timer and tensor_send_prev is not None else None
        send_prev = tensor_send_prev
        if tensor_send_prev is not None:
            k = self.send_count
            self.send_count += 1
            if k == 0 and self.entropy_probe is not None:
                self.entropy_probe(tensor_send_prev)
            self.stats.bytes_dense += tensor_send_prev.numel() * tensor_send_prev.element_size()
            if self.compressed(k, receiver=(self.stage - 1) % self.pp_size):
                send_prev = self._pack(tensor_send_prev, k)
            self.stats.bytes_sent += send_prev.numel() * send_prev.element_size()

        def full(shape):
            return torch.empty(shape, requires_grad=True, device=device,
                               dtype=config.pipeline_dtype)

        recv_prev_buf = full(tensor_shape) if recv_prev else None
        recv_next_out = recv_next_buf = finish = None
        if recv_next:
            k = self.recv_count
            self.recv_count += 1
            recv_next_out = recv_next_buf = full(tensor_shape)
            if self.compressed(k, receiver=self.stage):
                n, m = math.prod(tensor_shape[:-1]), tensor_shape[-1]
                r = min(self.rank, n, m)
                recv_next_buf = torch.empty(HEADER + (n + m) * r, dtype=torch.float32,
                                            device=device)
                buf, out = recv_next_buf, recv_next_out

                def finish(buf=buf, out=out, k=k, r=r):
                    self._unpack_into(buf, out, k, r)

        p2p_func = p2p_communication._batched_p2p_ops if config.batch_p2p_comm \
            else p2p_communication._p2p_ops
        reqs = p2p_func(tensor_send_prev=send_prev, tensor_recv_prev=recv_prev_buf,
                        tensor_send_next=tensor_send_next, tensor_recv_next=recv_next_buf,
                        group=self.pp_group, prev_pipeline_rank=self.prev_rank,
                        next_pipeline_rank=self.next_rank)
        # A gloo work must be waited on once only (a second wait blocks for good).
        if isinstance(reqs, dict):
            if finish is not None and "recv_next" in reqs:
                reqs["recv_next"] = _DecompressOnWait(reqs["recv_next"], finish)
                finish = None
            if wait_on_reqs:
                pending = list(reqs.items())
                if send_start is not None and "send_prev" in reqs:
                    reqs["send_prev"].wait()  # the backward send's own time (DAC's t_p2p)
                    pending = [(key, r) for key, r in pending if key != "send_prev"]
                if send_start is not None:
                    self.timer.record_send(send_start, self.timer.stamp())
                for _, req in pending:
                    req.wait()
                reqs = None
            elif send_start is not None:
                self.timer.record_send(send_start, self.timer.stamp())
        else:  # batched: megatron-core requires waiting here
            pending = list(reqs)
            if send_start is not None and pending:
                pending.pop(0).wait()  # send_prev is the first op of the batch
                self.timer.record_send(send_start, self.timer.stamp())
            for req in pending:
                req.wait()
            reqs = []
            if config.batch_p2p_sync and torch.cuda.is_available():
                torch.cuda.synchronize()
        if finish is not None:
            finish()
        return recv_prev_buf, recv_next_out, reqs

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        return {"rank": self.rank, "table_version": self.table_version,
                "senders": {c: s.state_dict() for c, s in self.senders.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.set_rank(state["rank"], state["table_version"])
        self.senders = {}
        for chunk, sender_state in state["senders"].items():
            sender = self._new_sender(chunk, sender_state["rank"])
            sender.load_state_dict(sender_state, _device())   # wherever it was mapped
            self.senders[chunk] = sender

