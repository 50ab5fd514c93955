"""EDGC in an unmodified Megatron-LM job: two lines in its ``pretrain_gpt.py``.

    import megatron_edgc.megatron_lm as edgc; edgc.enable()   # 1: atop the __main__ block
    pretrain(..., extra_args_provider=edgc.add_args)           # 2: the --edgc-* flags
    # core_v0.19.0 and later: parse_and_validate_args(extra_args_provider=edgc.add_args)

``add_args`` registers every ``--edgc-*`` flag of this project's trainer (same names,
defaults, ranges and errors; :mod:`.flags`); ``enable`` wraps five seams of
``megatron.training``, each looked up by name when ``pretrain`` calls it (:mod:`.seams`;
docs/megatron-lm-seams.md says why these):

* ``validate_args`` (in ``arguments``, and in ``initialize`` where core_v0.16.1 and older
  import it): the EDGC flags are checked after Megatron's own checks and
  before any process group exists; a bad value prints ``error: --edgc-…: …`` and exits 2;
* ``training.setup_model_and_optimizer``: after Megatron built the DDP chunks (and loaded a
  checkpoint) the EDGC runtime (:class:`~megatron_edgc.runtime.step.EdgcRuntime`, the one
  this project's trainer uses) is built on them;
* ``training.train_step``: the runtime runs around each step — ranks in force before the
  forward/backward, the compressing PP communicator passed to the schedule, the
  controller's decision after the optimizer step; at Megatron-LM's ``--log-interval`` the
  records since the last one (this project's trainer's, ``iter_ms`` included) are read
  from the device with one telemetry all-reduce and go to Megatron-LM's TensorBoard writer
  (tags ``edgc/*``) and ``--edgc-metrics-file``;
* ``training.save_checkpoint`` / ``training.load_checkpoint``: every rank writes the
  pending records, then its compressor and controller state to
  ``iter_XXXXXXX/edgc/tp{T}_pp{P}_dp{D}.pt`` before Megatron writes its own files and the
  ``latest`` pointer, and reads it back on resume (:mod:`.checkpoint`).

With ``--edgc-mode off`` and ``--edgc-pp-compression off`` every wrapper passes through.
A job that called ``enable`` but trains through a loop these seams do not reach (its own,
Megatron-Bridge's) stops at its first gradient sync or optimizer step with one line naming
the loop (:mod:`.loop_check`); the summary line at the last iteration says whether EDGC ran.
On CPU (tests, laptops) ``python -m megatron_edgc.megatron_lm.cpu pretrain_gpt.py ...``
runs the script with the CUDA shims of :mod:`.cpu_shims`.
"""

from megatron_edgc.megatron_lm.flags import CKPT_FORMATS, add_args, chain, run_config
from megatron_edgc.megatron_lm.seams import (TESTED_MEGATRON_LM, MissingSeam, check_seams,
                                             disable, enable)

__all__ = ["enable", "disable", "add_args", "chain", "run_config", "check_seams",
           "MissingSeam", "TESTED_MEGATRON_LM", "CKPT_FORMATS"]
