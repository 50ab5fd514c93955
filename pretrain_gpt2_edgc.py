#!/usr/bin/env python
"""GPT-2 pretraining on megatron-core (TP x PP x DP) with EDGC gradient compression.

    python pretrain_gpt2_edgc.py                               # tiny CPU default, 4 processes
    python pretrain_gpt2_edgc.py --config configs/X.yaml --train-iters 500
    torchrun --nproc-per-node 8 pretrain_gpt2_edgc.py --config ...   # one rank per process

Bad configuration fails here, with one line naming the flag, before any process group.
The logic is ``megatron_edgc.training.pretrain`` (installed as ``edgc-pretrain``).
"""

import sys

from megatron_edgc.training.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
