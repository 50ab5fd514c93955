"""Run a Megatron-LM training script on CPU processes with gloo (tests, laptops).

    torchrun --nproc-per-node 4 -m megatron_edgc.megatron_lm.cpu pretrain_gpt.py \\
        --distributed-backend gloo --transformer-impl local ... [--edgc-mode edgc ...]

Before the script runs: modules a CPU machine lacks and the script imports without using
them on this path are stubbed (megatron-core's batch-invariant kernels, which need
``triton``;
``megatron.rl``: absent from a training-only export of Megatron-LM), each only when it does
not import; then the CPU shims (:mod:`megatron_edgc.megatron_lm.cpu_shims`). The script
itself is run unmodified, as ``__main__``; with CUDA present only the stubs apply.
Processes the script spawns (megatron-core 0.16's asynchronous checkpoint writer starts a
``spawn`` manager) start from this module, so they get the stubs too, instead of
re-importing the script without them. ``python -m megatron_edgc.megatron_lm_cpu``, the
old name, still runs this module.
"""

from __future__ import annotations

import importlib.util
import os
import runpy
import sys
import types


class _Unavailable(types.ModuleType):
    """A module whose every name imports but fails when called, naming what is missing."""

    def __init__(self, name: str, missing: str):
        super().__init__(name)
        self.__missing = missing

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        where, missing = f"{self.__name__}.{attr}", self.__missing

        def unavailable(*args, **kwargs):
            raise RuntimeError(f"{where}: needs {missing}, which is not installed here "
                               f"(stubbed by megatron_edgc.megatron_lm.cpu)")
        return unavailable


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def install_import_stubs() -> list:
    """Stub what is missing; returns the stubbed module names."""
    stubbed = []
    if not _importable("triton"):
        name = "megatron.core.transformer.custom_layers.batch_invariant_kernels"
        sys.modules[name] = _Unavailable(name, "triton")
        stubbed.append(name)
    if not _importable("megatron.rl"):
        for name in ("megatron.rl", "megatron.rl.parallel_utils"):
            sys.modules[name] = _Unavailable(name, "megatron.rl")
        stubbed.append("megatron.rl")
    return stubbed


def _spawned_children_start_here() -> None:
    """``multiprocessing``'s spawn re-imports the parent's ``__main__`` in every child: by
    default the script (whose imports need the stubs); here, this module by name."""
    import multiprocessing.spawn as spawn

    original = spawn.get_preparation_data

    def get_preparation_data(name):
        data = original(name)
        if data.pop("init_main_from_path", None) is not None:
            data["init_main_from_name"] = "megatron_edgc.megatron_lm.cpu"  # this module
        return data
    spawn.get_preparation_data = get_preparation_data


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m megatron_edgc.megatron_lm.cpu SCRIPT [ARGS ...]")
    script = os.path.abspath(argv[0])
    sys.path.insert(0, os.path.dirname(script))
    install_import_stubs()
    _spawned_children_start_here()
    from megatron_edgc.megatron_lm.cpu_shims import apply_megatron_lm_cpu_shims

    apply_megatron_lm_cpu_shims(allow_untested="--edgc-allow-untested-megatron" in argv)
    sys.argv = argv
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":  # a process the script spawned
    install_import_stubs()
