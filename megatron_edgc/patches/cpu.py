"""Run megatron-core (0.13.1 ... 0.19.2, see ``features.py``) on CPU processes with gloo.

megatron-core assumes CUDA in a handful of places (listed with file:line in
shared/FINDINGS.md): tensors created with ``device='cuda'`` or
``device=torch.cuda.current_device()``, ``param.type() == 'torch.cuda.FloatTensor'``
checks, ``torch.cuda.synchronize()``, streams (0.19's ``start_grad_sync`` waits on
``torch.cuda.current_stream()``) and the CUDA RNG tracker. Without CUDA we make the
CPU play the accelerator: factory functions map a CUDA device to the CPU, ``Tensor.type()``
names CPU tensors as their CUDA counterparts, synchronize is a no-op, every stream is a
null stream (CPU work is already ordered) and the RNG tracker forks CPU generator states. Applied once, before the model and optimizer are built, and
only when CUDA is absent; with CUDA nothing here runs.
"""

from __future__ import annotations

import contextlib
import functools

import torch

# The version/feature check lives in features.py; these names stay importable from here.
from megatron_edgc.patches.features import (  # noqa: F401
    SUPPORTED_MEGATRON_CORE_VERSIONS, UnsupportedMegatronVersion, check_megatron_version,
    megatron_core_version)

_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn", "randint",
              "empty_strided", "as_tensor", "linspace")
_TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")
_applied = False


def _is_cuda_device(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # an ordinal means a CUDA device
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)

    wrapper.__edgc_cpu_shim__ = True
    return wrapper


def _cpu_device_method(original, device_first: bool):
    """A ``Tensor`` method with a CUDA device (``torch.cuda.current_device()``, ``"cuda"``)
    kept on the CPU: megatron-core's MoE router moves its weight there in every forward
    (``.to``) and the alltoall dispatcher allocates its output there (``.new_empty``).
    ``device_first``: the first positional argument may be the device (``to``)."""
    if getattr(original, "__edgc_cpu_shim__", False):
        return original

    @functools.wraps(original)
    def method(self, *args, **kwargs):
        if device_first and args and _is_cuda_device(args[0]):
            args = ("cpu",) + args[1:]
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return original(self, *args, **kwargs)

    method.__edgc_cpu_shim__ = True
    return method


def _cuda_named_type(original):
    @functools.wraps(original)
    def type_(self, *args, **kwargs):
        name = original(self, *args, **kwargs)
        if not args and not kwargs and isinstance(name, str) and name.startswith("torch.") \
                and not name.startswith("torch.cuda."):
            return "torch.cuda." + name[len("torch."):]
        return name

    return type_


class NullEvent:
    """Stands in for a CUDA event on CPU (the MoE alltoall dispatcher synchronizes one)."""

    def synchronize(self):
        return None

    def wait(self, *args, **kwargs):
        return None

    def query(self):
        return True


class NullStream:
    """Stands in for a CUDA stream on CPU, where every operation is already ordered."""

    def wait_stream(self, *args, **kwargs):
        return None

    def synchronize(self):
        return None

    def record_event(self, *args, **kwargs):
        return NullEvent()

    def wait_event(self, *args, **kwargs):
        return None


class CpuRNGStatesTracker:
    """Megatron's ``CudaRNGStatesTracker`` with CPU generator states.

    ``fork(name)`` swaps the default CPU generator to the named stream (e.g. the
    model-parallel stream that gives each TP rank its own dropout mask) and back.
    """

    def __init__(self):
        self.states_ = {}
        self.seeds_ = set()

    def is_initialized(self):
        return True

    def reset(self):
        self.states_, self.seeds_ = {}, set()

    def get_states(self):
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states):
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name, seed):
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        orig = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)


def install_cpu_rng_tracker() -> CpuRNGStatesTracker:
    from megatron.core.tensor_parallel import random as mp_random

    tracker = CpuRNGStatesTracker()
    mp_random._CUDA_RNG_STATE_TRACKER = tracker
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return tracker


def model_parallel_cpu_manual_seed(seed: int, tp_rank: int, ep_rank: int = 0,
                                   etp_rank: int = 0) -> None:
    """CPU counterpart of ``model_parallel_cuda_manual_seed`` (same stream offsets)."""
    from megatron.core.tensor_parallel import random as mp_random

    tracker = mp_random.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME,
                seed + 2718 + 100 + ep_rank * 1000 + etp_rank)


def _moe_cpu_shims() -> None:
    """megatron-core's MoE on CPU (0.16.1 read; each name is checked before it is touched):

    * the router tests ``te_general_gemm is not None`` but, without Transformer Engine,
      ``moe_utils`` never defines the name: it is defined as None (the torch path runs);
    * the alltoall dispatcher moves its split sizes to the host with
      ``maybe_move_tensor_to_cpu(..., as_numpy=True)``, which only converts CUDA tensors;
      ``all_to_all_single`` takes no tensor as split sizes: host tensors become numpy too,
      as CUDA ones do.
    """
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    if not getattr(moe_utils, "HAVE_TE", True) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    original = getattr(moe_utils, "maybe_move_tensor_to_cpu", None)
    if original is None or getattr(original, "__edgc_cpu_shim__", False):
        return

    @functools.wraps(original)
    def maybe_move_tensor_to_cpu(tensor, as_numpy: bool = False, record_stream: bool = False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu.__edgc_cpu_shim__ = True
    moe_utils.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    if getattr(token_dispatcher, "maybe_move_tensor_to_cpu", None) is original:
        token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


def apply_cpu_shims(allow_untested: bool = False) -> bool:
    """Install the shims if CUDA is absent; returns whether they are active."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    check_megatron_version(allow_untested)
    for name in _FACTORIES:
        fn = getattr(torch, name)
        if not getattr(fn, "__edgc_cpu_shim__", False):
            setattr(torch, name, _cpu_factory(fn))
    torch.Tensor.type = _cuda_named_type(torch.Tensor.type)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.Tensor.to = _cpu_device_method(torch.Tensor.to, device_first=True)
    for name in _TENSOR_FACTORIES:
        setattr(torch.Tensor, name, _cpu_device_method(getattr(torch.Tensor, name), False))
    torch.cuda.current_device = lambda: 0
    torch.cuda.synchronize = lambda *args, **kwargs: None
    null = NullStream()
    torch.cuda.Stream = lambda *args, **kwargs: null
    torch.cuda.current_stream = lambda *args, **kwargs: null
    torch.cuda.default_stream = lambda *args, **kwargs: null  # partial distributed optimizer
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()
    install_cpu_rng_tracker()
    _moe_cpu_shims()
    _applied = True
    return True
