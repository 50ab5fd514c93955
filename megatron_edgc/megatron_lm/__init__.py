"""EDGC in an unmodified Megatron-LM job (:mod:`megatron_edgc.megatron_lm.seams`)."""

from megatron_edgc.megatron_lm.seams import *  # noqa: F401,F403
