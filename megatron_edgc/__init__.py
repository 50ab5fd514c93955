"""megatron-edgc: entropy-driven dynamic gradient compression for Megatron (arXiv 2511.10333)."""

__version__ = "0.1.0"
