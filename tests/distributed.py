"""Run real multi-process megatron-core jobs (gloo, forked local workers) from a test."""

import json
import os

import torch

from megatron_edgc.config import parse_config
from megatron_edgc.training.launch import spawn_local


def run_job(argv, out_dir, dump_params=True):
    """Train with ``argv`` on TP x PP x DP local processes; return per-rank results.

    Each rank writes its parallel coordinates and (optionally) its parameters to
    ``out_dir/rank{r}.pt``; the logging rank writes the metrics file given in argv.
    """
    from megatron.core import parallel_state

    from megatron_edgc.training.loop import Trainer, init_worker, shutdown_worker

    cfg = parse_config(argv)
    os.makedirs(out_dir, exist_ok=True)

    def target(rank, world, local):
        init_worker(cfg, rank, world, local)
        try:
            trainer = Trainer(cfg)
            summary = trainer.run()
            params = {}
            if dump_params:
                for i, chunk in enumerate(trainer.bundle.chunks):
                    for name, p in chunk.named_parameters():
                        params[f"{i}.{name}"] = p.detach().clone()
            torch.save({"tp": parallel_state.get_tensor_model_parallel_rank(),
                        "pp": parallel_state.get_pipeline_model_parallel_rank(),
                        "dp": parallel_state.get_data_parallel_rank(),
                        "params": params, "summary": summary},
                       os.path.join(out_dir, f"rank{rank}.pt"))
            return 0
        finally:
            shutdown_worker()

    code = spawn_local(target, cfg.parallel.world_size)
    assert code == 0, f"a worker failed with exit code {code}"
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(cfg.parallel.world_size)]


def read_jsonl(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def assert_dp_replicas_identical(results):
    """Parameters of ranks that differ only in their DP index are bit-identical."""
    groups = {}
    for r in results:
        groups.setdefault((r["tp"], r["pp"]), []).append(r)
    compared = 0
    for key, members in groups.items():
        ref = members[0]["params"]
        assert ref, f"no parameters dumped for {key}"
        for other in members[1:]:
            assert other["params"].keys() == ref.keys()
            for name, tensor in ref.items():
                assert torch.equal(tensor, other["params"][name]), \
                    f"{name} differs between DP replicas of (tp, pp) = {key}"
                compared += 1
    return compared
