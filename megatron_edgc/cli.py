"""Console entry points (``edgc-pretrain``, ``edgc-prepare-data``)."""

import os
import runpy
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    sys.path.insert(0, _ROOT)
    from pretrain_gpt2_edgc import main as pretrain

    return pretrain()


def prepare_data() -> None:
    runpy.run_path(os.path.join(_ROOT, "scripts", "prepare_data.py"), run_name="__main__")
