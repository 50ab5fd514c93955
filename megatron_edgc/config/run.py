"""RunConfig: every section of one training run, and ``validate()``, the values-only check
of all of them (ranges, then each section's rules, then the rules between sections)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from megatron_edgc.config.edgc import EdgcConfig
from megatron_edgc.config import host
from megatron_edgc.config.knobs import check_ranges
from megatron_edgc.config.rules import check_run_layout, validate_edgc
from megatron_edgc.config.sections import (CheckpointConfig, DataConfig, EvalConfig,
                                           LoggingConfig, ModelConfig, ParallelConfig,
                                           TrainingConfig)


@dataclass
class RunConfig:
    """Everything one training run needs; sections map to YAML sections."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    edgc: EdgcConfig = field(default_factory=EdgcConfig)
    config_file: Optional[str] = None
    allow_untested_megatron: bool = False
    #: The start-up summary's compression lines (filled by :func:`validate_edgc` given the
    #: model's shapes).
    compression_notes: list = field(default_factory=list, repr=False, compare=False)
    #: An unset ``--bf16`` on a CPU: the job's choice (:mod:`megatron_edgc.config.host`),
    #: set by :meth:`resolve_cpu_precision`.
    cpu_precision: Optional[host.CpuPrecision] = field(default=None, repr=False,
                                                       compare=False)

    @property
    def bf16_by_cpu(self) -> bool:
        """Whether ``--bf16`` is left to the CPU: unset, no ``--fp16``, no CUDA."""
        import torch

        return self.training.bf16 is None and not self.training.fp16 and \
            not torch.cuda.is_available()

    def resolve_cpu_precision(self, group=None, resumed: Optional[tuple] = None
                              ) -> Optional[host.CpuPrecision]:
        """Where :attr:`bf16_by_cpu`: this process's choice, and in a job every rank of
        ``group`` (default: the world) takes the same one
        (:func:`~megatron_edgc.config.host.agree`: one all-reduce; call it on every rank
        before the model is built). The choice: ``resumed``, ``(precision, where)`` of the
        checkpoint a resume continues (its run's, whatever this CPU would take), else
        timed at the model's shapes. Once: a resolved choice is kept."""
        if self.bf16_by_cpu and self.cpu_precision is None:
            if resumed is not None:
                mine = host.CpuPrecision(resumed[0] == "bf16", f"{resumed[0]}, as the run it "
                                                               f"resumes ({resumed[1]})")
            else:
                m, t = self.model, self.training
                tokens = m.seq_length * t.micro_batch_size
                ffn = (m.ffn_hidden_size or 4 * m.hidden_size) // \
                    self.parallel.tensor_model_parallel_size
                mine = host.measure(tokens, m.hidden_size, ffn)
            self.cpu_precision = host.agree(mine, group)
        return self.cpu_precision

    @property
    def bf16_resolved(self) -> bool:
        """``--bf16`` as the run takes it: set, as set; unset, on with CUDA, and on a CPU
        as :meth:`resolve_cpu_precision` chose (resolved here if not yet, in this process
        alone: a job resolves it on every rank first)."""
        if self.training.fp16:
            return False
        if self.training.bf16 is not None:
            return self.training.bf16
        if not self.bf16_by_cpu:
            return True
        return self.resolve_cpu_precision().bf16

    @property
    def precision_note(self) -> str:
        """The start-up line that says the run's precision and why."""
        import torch

        precision = self.precision
        if torch.cuda.is_available() or precision == "fp16":
            how = "set" if self.training.bf16 is not None or self.training.fp16 else "CUDA"
            return f"precision: {precision} ({how})"
        if self.training.bf16 is None:
            return f"precision: {precision} (unset --bf16 on a CPU: " \
                   f"{self.resolve_cpu_precision().why})"
        native, what = host.cpu_bf16()
        advice = "" if native or precision != "bf16" else "; fp32 (--no-bf16) runs faster here"
        return f"precision: {precision} (set; {what}{advice})"

    @property
    def fp16_grads_in_fp32(self) -> bool:
        """fp16: the gradient buffers in fp32 (``--accumulate-allreduce-grads-in-fp32``);
        unset means on where EDGC compresses (docs/method.md, "A step's outcome")."""
        setting = self.training.accumulate_allreduce_grads_in_fp32
        if not self.training.fp16:
            return False
        return self.edgc.mode != "off" if setting is None else setting

    @property
    def precision(self) -> str:
        """The run's mixed precision: ``fp16`` (with a loss scaler), ``bf16`` or ``fp32``."""
        return "fp16" if self.training.fp16 else "bf16" if self.bf16_resolved else "fp32"

    @property
    def num_microbatches(self) -> int:
        return self.training.global_batch_size // (
            self.training.micro_batch_size * self.parallel.data_parallel_size)

    def sections(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if dataclasses.is_dataclass(value):
                yield f.name, value

    def validate(self, world_size: Optional[int] = None) -> "RunConfig":
        """Check every value and the cross-section rules; fill derived defaults. Reads no
        file (the run's files: :func:`~megatron_edgc.config.run_inputs.check_run_inputs`).

        ``world_size`` is the launcher's (torchrun/srun) or None for a plain local launch.
        """
        for _, section in self.sections():
            check_ranges(section)
        self.model.resolve()
        self.parallel.resolve(world_size)
        self.training.resolve()
        self.data.resolve()
        self.checkpoint.resolve()
        validate_edgc(self)
        check_run_layout(self)
        return self

    def to_dict(self) -> dict:
        return {name: dataclasses.asdict(section) for name, section in self.sections()}
