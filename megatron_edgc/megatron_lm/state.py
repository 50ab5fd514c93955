"""What the plug-in holds in a Megatron-LM process between the wrapped calls."""

from __future__ import annotations

from typing import Optional

from megatron_edgc.config import RunConfig


class PluginState:
    def __init__(self):
        self.cfg: Optional[RunConfig] = None    # validated from the --edgc-* flags
        self.runtime = None                     # EdgcRuntime, when compression is on
        self.records = None                     # IterationRecords (JSONL, TensorBoard)
        self.stashed: Optional[tuple] = None    # (extensions, changed layout names) read at load
        self.originals: dict = {}               # (module, name) -> the wrapped function
        self.guard = None                       # NonFiniteStepGuard on Megatron's optimizer
        self.first_iteration: Optional[int] = None   # this process's first train_step
        self.skipped = 0                        # steps not applied (the guard's, the scaler's)
        self.stepping = False                   # inside the wrapped train_step (loop_check)

    def compression_on(self) -> bool:
        cfg = self.cfg
        return cfg is not None and (cfg.edgc.mode != "off" or cfg.edgc.pp_compression != "off")


state = PluginState()
