"""Runs a training script (the trainer or bench/torch_ddp_peers.py) with its timed
iterations and collectives logged (issue 93): ``python timed_span_probe.py LOG_DIR
SCRIPT [ARGS...]``. Each rank appends to ``LOG_DIR/rank<R>.jsonl`` one line per
``IterationRecords.begin`` / ``end`` (the span both front-ends time) and per
``torch.distributed.all_reduce`` (its element count, dtype and group size); the workers
are forked (CPU), so the patches made here hold in them."""

import json
import os
import runpy
import sys

import torch.distributed as dist

from megatron_edgc.runtime import frontend

log_dir, script, *rest = sys.argv[1:]


def log(event: dict) -> None:
    rank = dist.get_rank() if dist.is_initialized() else -1
    with open(os.path.join(log_dir, f"rank{rank}.jsonl"), "a") as fh:
        fh.write(json.dumps(event) + "\n")


def logged(name, fn):
    """``fn`` logged where it stamps the clock: ``begin`` as it starts, ``end`` as it
    returns (what ``end`` runs before its stamp is inside the span)."""
    def wrapper(self, *args, **kwargs):
        if name == "begin":
            log({"event": name})
        out = fn(self, *args, **kwargs)
        if name == "end":
            log({"event": name})
        return out
    return wrapper


frontend.IterationRecords.begin = logged("begin", frontend.IterationRecords.begin)
frontend.IterationRecords.end = logged("end", frontend.IterationRecords.end)
_all_reduce = dist.all_reduce


def all_reduce(tensor, *args, **kwargs):
    group = kwargs.get("group", args[1] if len(args) > 1 else None)
    log({"event": "all_reduce", "numel": tensor.numel(), "dtype": str(tensor.dtype),
         "group_size": dist.get_world_size(group)})
    return _all_reduce(tensor, *args, **kwargs)


dist.all_reduce = all_reduce
sys.argv = [script, *rest]
runpy.run_path(script, run_name="__main__")
