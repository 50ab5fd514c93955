"""Run one training job in a fresh interpreter and dump every rank's results.

    python tests/job_runner.py OUT_DIR [pretrain flags...]

A fresh process matters: workers are forked after the imports, which is only safe
before the forking process has run torch operations (OpenMP thread pools do not survive
a fork), and the pytest process has.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_edgc.config import parse_config  # noqa: E402
from megatron_edgc.training.launch import spawn_local  # noqa: E402


def main() -> int:
    out_dir, argv = sys.argv[1], sys.argv[2:]
    from megatron.core import parallel_state

    from megatron_edgc.training.loop import Trainer, init_worker, shutdown_worker

    cfg = parse_config(argv)
    os.makedirs(out_dir, exist_ok=True)

    def target(rank, world, local):
        init_worker(cfg, rank, world, local)
        try:
            trainer = Trainer(cfg)
            summary = trainer.run()
            params = {f"{i}.{name}": p.detach().clone()
                      for i, chunk in enumerate(trainer.bundle.chunks)
                      for name, p in chunk.named_parameters()}
            torch.save({"tp": parallel_state.get_tensor_model_parallel_rank(),
                        "pp": parallel_state.get_pipeline_model_parallel_rank(),
                        "dp": parallel_state.get_data_parallel_rank(),
                        "params": params, "summary": summary},
                       os.path.join(out_dir, f"rank{rank}.pt"))
            return 0
        finally:
            shutdown_worker()

    return spawn_local(target, cfg.parallel.world_size)


if __name__ == "__main__":
    sys.exit(main())
