#!/usr/bin/env python
"""What holds a one-rank process's GPU memory outside PyTorch's allocator (issue 66).

    python bench/gpu_memory.py [--out FILE.json]

A bare ``torch.distributed`` NCCL job of one rank, in the order the trainer meets them: the
CUDA context, the default process group (NCCL; ``--bind-device`` binds it to the device, as
the trainer did before issue 66), its first collective, megatron-core's model-parallel
groups, a collective on each of them (one NCCL communicator each), a cuBLAS matrix product
(bf16 and fp32) and a batched cuSOLVER Cholesky (the orthonormalization's). Each moment's memory outside the allocator
is :mod:`megatron_edgc.runtime.device_memory`'s (NVML's per-process figure where it
imports); the trainer prints the same moments after its first step, so the two read side
by side. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_edgc.runtime import device_memory  # noqa: E402


def megatron_groups():
    """The model-parallel groups megatron-core made, by name (those that exist here)."""
    from megatron.core import parallel_state as ps

    names = ("data_parallel_group", "tensor_model_parallel_group",
             "pipeline_model_parallel_group", "model_parallel_group", "embedding_group",
             "position_embedding_group", "context_parallel_group",
             "tensor_and_data_parallel_group", "expert_model_parallel_group")
    groups = {}
    for name in names:
        getter = getattr(ps, f"get_{name}", None)
        try:
            group = getter() if getter else None
        except (AssertionError, RuntimeError):
            group = None
        if group is not None and group not in groups.values():
            groups[name] = group
    return groups


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the moments as JSON here")
    ap.add_argument("--bind-device", action="store_true",
                    help="init_process_group(device_id=...): NCCL communicators made eagerly, "
                         "one per group at its creation (the trainer before issue 66)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench/gpu_memory.py needs a CUDA device", file=sys.stderr)
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.cuda.init()
    device_memory.mark("with the CUDA context")
    dist.init_process_group("nccl", rank=0, world_size=1,
                            **({"device_id": device} if args.bind_device else {}))
    device_memory.mark("after the default process group")
    x = torch.ones(1 << 20, device=device)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    device_memory.mark("after its first all-reduce")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    device_memory.mark("after the model-parallel groups")
    groups = megatron_groups()
    for group in groups.values():
        dist.all_reduce(x, group=group)
    torch.cuda.synchronize()
    device_memory.mark(f"after one all-reduce on each of {len(groups)} groups")
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    (a @ a).sum()
    b = torch.randn(24, 1024, 64, device=device)
    torch.bmm(b.transpose(1, 2), b)
    torch.cuda.synchronize()
    device_memory.mark("after cuBLAS products (bf16, fp32 batched)")
    gram = torch.eye(128, device=device, dtype=torch.float64).expand(24, 128, 128).clone()
    torch.linalg.cholesky_ex(gram)
    torch.linalg.cholesky_ex(gram.float())
    torch.cuda.synchronize()
    device_memory.mark("after a batched cuSOLVER Cholesky (fp64, fp32)")
    rows = device_memory.marks()
    gib = 2.0 ** 30
    print(f"{'moment':55s} {'held GiB':>9s} {'reserved':>9s} {'outside':>9s}  source")
    for r in rows:
        print(f"{r['moment']:55s} {r['held'] / gib:9.3f} {r['reserved'] / gib:9.3f} "
              f"{r['outside'] / gib:9.3f}  {r['source']}")
    env = {k: os.environ.get(k) for k in ("NCCL_BUFFSIZE", "NCCL_NVLS_ENABLE",
                                          "NCCL_CUMEM_ENABLE", "CUBLAS_WORKSPACE_CONFIG",
                                          "CUDA_MODULE_LOADING")}
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())), "env": env,
              "bind_device": args.bind_device, "groups": list(groups), "moments": rows}
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=2)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
