"""GPT-2 pretraining on megatron-core (TP x PP x DP) with EDGC gradient compression: the
entry point behind ``pretrain_gpt2_edgc.py`` and the ``edgc-pretrain`` command.

    edgc-pretrain                                   # tiny CPU default, 4 local processes
    edgc-pretrain --config configs/X.yaml --train-iters 500
    torchrun --nproc-per-node 8 -m megatron_edgc.training.pretrain --config ...   # a rank each

Bad configuration fails here, with one line naming the flag, before any process group.
"""

import functools
import sys


def main(argv=None) -> int:
    from megatron_edgc.config import ConfigError, parse_config
    from megatron_edgc.patches.cpu import UnsupportedMegatronVersion, check_megatron_version
    from megatron_edgc.training.launch import detect_launch_env, spawn_local

    launch = detect_launch_env()
    try:
        cfg = parse_config(argv, world_size=launch.world_size if launch else None)
        check_megatron_version(cfg.allow_untested_megatron)
        import torch

        from megatron_edgc.patches.features import refuse_instances_overlap

        p = cfg.parallel
        why = refuse_instances_overlap(p.num_distributed_optimizer_instances,
                                       p.overlap_grad_reduce, torch.cuda.is_available())
        if why:
            raise ConfigError("--overlap-grad-reduce", why)
    except (ConfigError, UnsupportedMegatronVersion) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from megatron_edgc.training.loop import worker_main  # heavy imports, once, before fork

    if launch is not None:
        # torchrun: the elastic error file of this rank, so torchrun's report names the
        # root cause (the first rank that failed) above its peers' consequences.
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(worker_main)(cfg, launch.rank, launch.world_size, launch.local_rank)
    return spawn_local(functools.partial(worker_main, cfg), cfg.parallel.world_size,
                       cfg.parallel.master_port)


if __name__ == "__main__":
    sys.exit(main())
