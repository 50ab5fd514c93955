"""Checkpoint file names and the pre-flight check of ``--load`` (no torch: it runs in the
config validation, before any process group starts)."""

from __future__ import annotations

import os
import re
from typing import Optional

LATEST = "latest_checkpointed_iteration.txt"
_MODEL_FILE = re.compile(r"model_optim_tp(\d+)_pp(\d+)(?:_ep\d+)?\.pt$")


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def model_file_name(tp: int, pp: int, ep: int = 0) -> str:
    """Model + optimizer + schedule of one (TP, PP) rank, written by its DP rank 0; with
    expert parallelism one per EP rank (its experts differ), by its expert-DP rank 0."""
    return f"model_optim_tp{tp:02d}_pp{pp:03d}" + (f"_ep{ep:03d}" if ep else "") + ".pt"


def rank_file_name(rank: int) -> str:
    return f"rank_state_{rank:05d}.pt"


def preflight(root: str, tp: int, pp: int, fresh_ok: bool) -> Optional[str]:
    """What is wrong with resuming from ``root`` on TP x PP, or None.

    ``fresh_ok``: no checkpoint yet is fine (``--load`` = ``--save``, a restartable job).
    The DP size may differ (see checkpoint.py); TP and PP may not.
    """
    latest = os.path.join(root, LATEST)
    if not os.path.isfile(latest):
        return None if fresh_ok else f"{root} holds no checkpoint ({LATEST} is missing)"
    try:
        text = open(latest).read().strip()
    except OSError as exc:
        return f"{latest} cannot be read: {exc.strerror}"
    if not text.isdigit():
        return f"{latest} does not hold an iteration number ({text[:40]!r})"
    path = iteration_dir(root, int(text))
    if not os.path.isdir(path):
        return f"{path} is missing ({LATEST} points to iteration {int(text)})"
    saved = set()
    for name in os.listdir(path):
        m = _MODEL_FILE.match(name)
        if m:
            saved.add((int(m.group(1)), int(m.group(2))))
    wanted = {(t, p) for t in range(tp) for p in range(pp)}
    if saved != wanted:
        tps = 1 + max((t for t, _ in saved), default=-1)
        pps = 1 + max((p for _, p in saved), default=-1)
        return (f"{path} was saved with another layout (TP {tps} x PP {pps}, this run: "
                f"TP {tp} x PP {pp}); only the DP size may change on resume")
    for t, p in sorted(wanted):
        f = os.path.join(path, model_file_name(t, p))
        if os.path.getsize(f) == 0:
            return f"{f} is empty (a corrupted checkpoint)"
    return None
