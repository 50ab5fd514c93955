"""Console entry points (``edgc-pretrain``, ``edgc-prepare-data``): the package's own
modules, so a wheel install needs nothing from the source tree."""

from megatron_edgc.prepare_data import main as prepare_data  # noqa: F401
from megatron_edgc.pretrain import main  # noqa: F401
