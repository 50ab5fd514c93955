"""Gradient compression math: pure tensors in and out, no process groups, no megatron."""

from megatron_edgc.compression.matrices import is_compressible, matrix_shape  # noqa: F401
from megatron_edgc.compression.orthonormal import orthonormalize  # noqa: F401
from megatron_edgc.compression.powersgd import BucketCompressor  # noqa: F401
