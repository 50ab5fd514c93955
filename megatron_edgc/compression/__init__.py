"""Gradient compression math: pure tensors in and out, no process groups, no megatron."""

from megatron_edgc.compression.powersgd import (BucketCompressor, is_compressible,  # noqa: F401
                                                matrix_shape, orthonormalize)
