"""megatron-core seams: the DP gradient sync, the pipeline backward sends, stage timing, the
CPU shims, torch-Adam resume and the feature probe."""
