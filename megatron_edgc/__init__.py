"""megatron-edgc: entropy-driven dynamic gradient compression for Megatron (arXiv 2511.10333)."""

import warnings

__version__ = "0.1.0"

# megatron-core announces at import that it falls back from apex/transformer-engine to
# torch implementations (the expected configuration on CPU, not news), and warns about a
# cuda-graph default of its own TransformerConfig.
warnings.filterwarnings("ignore", message=".*(Transformer Engine and Apex|Apex is not) "
                                          "(are not |)installed.*")
warnings.filterwarnings("ignore", message="full scope is deprecated")
