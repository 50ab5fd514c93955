"""Run real multi-process megatron-core jobs (gloo, local workers) from a test."""

import json
import math
import os
import sys

import torch

import warm
from megatron_edgc.compression.matrices import is_compressible, matrix_shape

HERE = os.path.dirname(os.path.abspath(__file__))

#: The 4-process layouts the wiring is tested under.
LAYOUTS = {
    "tp1-pp2-dp2": ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                    "--data-parallel-size", "2"],
    "tp2-pp2-dp1": ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                    "--data-parallel-size", "1"],
    "tp1-pp2-dp2-overlap": ["--pipeline-model-parallel-size", "2", "--data-parallel-size", "2",
                            "--overlap-grad-reduce", "--bucket-size", "20000"],
    "tp1-pp2-dp2-distopt": ["--pipeline-model-parallel-size", "2", "--data-parallel-size", "2",
                            "--use-distributed-optimizer"],
    "tp1-pp2-dp2-interleaved": ["--pipeline-model-parallel-size", "2", "--data-parallel-size",
                                "2", "--virtual-pipeline-model-parallel-size", "2"],
}


def run_job(argv, out_dir, timeout=600, env=None):
    """Train with ``argv`` on TP x PP x DP local processes; return per-rank results.

    Each rank's parallel coordinates, final parameters and summary come back as a dict;
    the logging rank writes the metrics file named in ``argv``.
    """
    proc = warm.run([sys.executable, os.path.join(HERE, "job_runner.py"), out_dir, *argv],
                    timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(os.path.join(out_dir, "stdout.txt"), "w") as fh:   # the job's own lines
        fh.write(proc.stdout)
    files = sorted(f for f in os.listdir(out_dir) if f.startswith("rank"))
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(len(files))]


def read_jsonl(path):
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def assert_dp_replicas_identical(results):
    """Parameters of ranks that differ only in their DP index are bit-identical (with MoE
    expert parallelism: ranks of the same EP index, which hold the same experts)."""
    groups = {}
    for r in results:
        groups.setdefault((r["tp"], r["pp"], r.get("ep", 0)), []).append(r)
    compared = 0
    for key, members in groups.items():
        ref = members[0]["params"]
        assert ref, f"no parameters dumped for {key}"
        for other in members[1:]:
            assert other["params"].keys() == ref.keys()
            for name, tensor in ref.items():
                assert torch.equal(tensor, other["params"][name]), \
                    f"{name} differs between DP replicas of (tp, pp, ep) = {key}"
                compared += 1
    return compared


def compressed_bucket_bytes(shapes, rank, factor_bytes: int = 2, dense_bytes: int = 4) -> int:
    """The DP bytes of one bucket of parameters ``shapes`` at ``rank`` (None: dense), from
    the shapes: (n+m)·r factor elements per compressed matrix at ``factor_bytes`` each (bf16,
    the default: 2), the rest dense at ``dense_bytes`` (the dense wire: fp32 by default),
    and one flag, with the dense rest, or with P where the bucket has none."""
    if rank is None:
        return dense_bytes * sum(math.prod(s) for s in shapes)
    factors = dense = 0
    for shape in shapes:
        n, m = matrix_shape(shape)
        if n > 1 and is_compressible(n, m, rank, 2.0):
            factors += (n + m) * rank
        else:
            dense += math.prod(shape)
    flag = dense_bytes if dense else factor_bytes
    return factor_bytes * factors + dense_bytes * dense + flag


def slow_hop_shard_bytes(shapes, offsets, shard, instance_size: int, rank: int,
                         factor_bytes: int = 2) -> tuple:
    """``(slow hop, fast hop beyond the dense reduce-scatter)`` bytes of one bucket shard
    at ``rank`` with Megatron's partial distributed optimizer
    (``compression/shard_powersgd.py``), from the shapes: across instances 1/s of the
    bucket's column factors ``P`` (``m × r`` per compressed matrix), the row factors of the
    shard's row blocks, the rest of the shard dense in fp32 and a flag; inside the
    instance ``P`` reduce-scattered (fp32) and this rank's slice all-gathered (factor
    dtype)."""
    from megatron_edgc.compression.shard import shard_pieces

    pieces = shard_pieces([(str(i), o, tuple(sh)) for i, (sh, o) in
                           enumerate(zip(shapes, offsets))], *shard)
    whole = {str(i): matrix_shape(sh) for i, sh in enumerate(shapes)}

    def compressed(n, m):
        return n > 1 and is_compressible(n, m, rank, 2.0)

    rows = dense = 0
    for pc in pieces:
        if pc.row_block and compressed(*whole[pc.parent]):
            rows += pc.shape[0] * rank
        else:
            dense += pc.numel
    lq = sum(m * rank for n, m in whole.values() if compressed(n, m))
    # P, then the flag; no first phase at all without a compressed matrix
    lq_padded = -(-(lq + 1) // instance_size) * instance_size if lq else 0
    flag = 4 if dense or factor_bytes == 4 else factor_bytes
    slow = factor_bytes * rows + 4 * dense + flag + factor_bytes * lq_padded // instance_size
    fast = 4 * lq_padded + factor_bytes * lq_padded // instance_size
    return slow, fast

