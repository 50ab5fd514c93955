#!/usr/bin/env python
"""Corpus → JSONL → Megatron indexed dataset: ``megatron_edgc.training.prepare_data``
(installed as ``edgc-prepare-data``) run from the source tree; see its ``--help``."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_edgc.training.prepare_data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
