"""Old name of :mod:`megatron_edgc.megatron_lm.cpu` (``python -m megatron_edgc.megatron_lm_cpu``)"""
from megatron_edgc.megatron_lm.cpu import install_import_stubs, main  # noqa: F401
if __name__ == "__main__": main()  # noqa: E701
