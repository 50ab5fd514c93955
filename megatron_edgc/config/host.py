"""What the host CPU computes natively, where a default depends on it (issue 80).

bf16 on a CPU runs at fp32's speed or better only with bf16 instructions: AVX512-BF16 or
AMX-BF16 on x86, the BF16 extension on Arm. Without them (an AMD EPYC of family 25, Zen 3:
AVX2 only) PyTorch converts every operand: a 512² bf16 matmul ran at 0.8 GFLOP/s against
67 for fp32 on one thread, and the tiny CPU config took 6.7-8.3 s an iteration in bf16
against 1.3-1.6 s in fp32. So an unset ``--bf16`` on a CPU means bf16 only where the CPU
has them (:attr:`~megatron_edgc.config.run.RunConfig.bf16_resolved`).
"""

from __future__ import annotations

import functools
import platform

#: /proc/cpuinfo flags that carry bf16 arithmetic, and how to name them.
_BF16_FLAGS = {"avx512_bf16": "AVX512-BF16", "amx_bf16": "AMX-BF16", "bf16": "Arm BF16"}


def cpu_bf16_from(cpuinfo: str) -> tuple:
    """``(native, what)`` from the text of ``/proc/cpuinfo``: whether the CPU has bf16
    instructions, and a phrase naming them or the CPU without them."""
    flags, model = set(), ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("flags", "features"):
            flags |= set(value.split())
        elif key == "model name" and not model:
            model = value.strip()
    found = [name for flag, name in _BF16_FLAGS.items() if flag in flags]
    if found:
        return True, f"{model or 'this CPU'} has native bf16 ({', '.join(found)})"
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return False, (f"{model or 'this CPU'} has no native bf16 ({isa}, no AVX512-BF16 or "
                   f"AMX-BF16): bf16 arithmetic is converted, many times slower than fp32")


@functools.lru_cache(maxsize=None)
def cpu_bf16() -> tuple:
    """``(native, what)`` of this machine's CPU (Linux: ``/proc/cpuinfo``; elsewhere:
    not native, as unknown)."""
    try:
        with open("/proc/cpuinfo") as fh:
            return cpu_bf16_from(fh.read())
    except OSError:
        return False, f"{platform.processor() or 'this CPU'}: bf16 support unknown (no " \
                      f"/proc/cpuinfo), taken as not native"
