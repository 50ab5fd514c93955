"""The DP patch on bucket groups megatron-core reduces over other groups than plain DP,
4 gloo processes each (``tests/group_sync_runner.py``): context parallelism (dense
buckets over DP×CP) and MoE expert parallelism (experts over the expert-DP group). The
runner's cases share one launch (:data:`CASES`)."""

import json
import math
import os
import sys

import pytest

import warm
from distributed import compressed_bucket_bytes, slow_hop_shard_bytes
from megatron_edgc.compression.matrices import is_compressible, matrix_shape

HERE = os.path.dirname(os.path.abspath(__file__))
LOW_RANK = 4


#: The runner's cases, all run in one 4-process launch (issue 71: one torchrun and its
#: imports instead of four; each case builds its own model-parallel state and module).
CASES = ("cp2", "ep2", "inst2", "inst2-bypass")


def run_cases(cases, out_dir: str) -> dict:
    """``case -> [each rank's results]`` of one launch of the runner over ``cases``."""
    proc = warm.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "4", os.path.join(HERE, "group_sync_runner.py"), ",".join(cases), out_dir],
        timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {}
    for case in cases:
        results[case] = []
        for r in range(4):
            with open(os.path.join(out_dir, case, f"rank{r}.json")) as fh:
                results[case].append(json.load(fh))
    return results


@pytest.fixture(scope="module")
def group_sync(tmp_path_factory) -> dict:
    """Every case's results, from one launch for the module."""
    return run_cases(CASES, str(tmp_path_factory.mktemp("group_sync")))


def bucket_bytes(shapes: list, rank: int) -> int:
    """One bucket at ``rank`` with fp32 factors (the patch's default here)."""
    return compressed_bucket_bytes(shapes, rank, factor_bytes=4)


@pytest.mark.parametrize("case,sizes,expert_members", [
    ("cp2", [4], None),                     # DP 2 × CP 2: the dense buckets over all four
    ("ep2", [4, 2], [[0, 2], [1, 3]]),      # DP 4, EP 2: the experts over 2 replicas each
    ("inst2", [2], [[0, 2], [1, 3]]),       # 2 optimizer instances of 2: shards across
])
def test_each_bucket_group_is_compressed_over_its_own_group(case, sizes, expert_members,
                                                            group_sync):
    results = group_sync[case]
    for r in results:
        assert r["group_sizes"] == sizes
        if case == "inst2":
            check_slow_hop(r, expert_members)
            continue
        assert r["group_members"][0] == [0, 1, 2, 3]
        if expert_members is not None:
            assert r["expert"] == [False, True]
            assert r["group_members"][1] in expert_members
            assert r["rank"] in r["group_members"][1]
        # full rank, every matrix compressed: megatron-core's own reduction, to 2e-5 (the
        # directions of P below the orthonormalization's shift, which grows with the Gram's
        # norm since issue 50, are filled: 1.0e-5 measured on this bucket, 3.4e-6 before)
        for errors in r["full_rank_rel_err"]:
            assert max(errors) < 2e-5, errors
        # a low rank: bytes from the shapes, per group, and a real approximation
        shapes = r["bucket_shapes"]
        want = [bucket_bytes(s, LOW_RANK) for s in shapes]
        want_expert = sum(w for w, e in zip(want, r["expert"]) if e)
        assert r["low_rank_bytes"] == [sum(want)] * 2
        assert r["low_rank_expert_bytes"] == [want_expert] * 2
        for errors, norms in zip(r["low_rank_rel_err"], r["grad_norms"]):
            assert min(norms) > 0
            for shape_list, err in zip(shapes, errors):
                compressed = any(len(s) == 2 and is_compressible(*matrix_shape(s), LOW_RANK, 2.0)
                                 for s in shape_list)
                assert (err > 0.05) if compressed else (err < 1e-5), (shape_list, err)
        # replicas bit-identical over each bucket's reduction group
        assert all(all(step) for step in r["replicas_identical"])
    if case == "ep2":   # the two expert groups hold different experts
        by_group = {tuple(r["group_members"][1]): r["full_rank_rel_err"] for r in results}
        assert len(by_group) == 2


def test_stacked_experts_are_compressed_one_matrix_each(monkeypatch, tmp_path):
    """megatron-core's legacy ``GroupedMLP`` (``--moe-grouped-gemm`` without Transformer
    Engine) keeps 4 experts in two parameters; built here (its ``grouped_gemm`` kernel is a
    CUDA package: only the availability check is skipped, the layout is the class's own),
    each expert's block is one matrix entry, the very view the layer multiplies."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.moe import experts as experts_module

    from megatron_edgc.compression.powersgd import BucketCompressor
    from megatron_edgc.patches.cpu import apply_cpu_shims, model_parallel_cpu_manual_seed
    from megatron_edgc.patches.bucket_matrices import matrix_entries, stacked_expert_shapes

    apply_cpu_shims()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        model_parallel_cpu_manual_seed(1, 0)
        monkeypatch.setattr(experts_module.gg, "assert_grouped_gemm_is_available",
                            lambda: None)
        h, f, e = 32, 48, 4
        config = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=4,
                                   ffn_hidden_size=f, moe_ffn_hidden_size=f,
                                   num_moe_experts=e, add_bias_linear=False,
                                   gated_linear_unit=True, activation_func=F.silu,
                                   use_cpu_initialization=True)
        from megatron.core.process_groups_config import ProcessGroupCollection

        layer = experts_module.GroupedMLP(e, config,
                                          ProcessGroupCollection.use_mpu_process_groups())
        stacked = stacked_expert_shapes(layer)
        assert stacked == {layer.weight1: (e, h, 2 * f), layer.weight2: (e, f, h)}
        for p in (layer.weight1, layer.weight2):
            p.main_grad = torch.randn_like(p)
        entries = [entry for name, p in (("weight1", layer.weight1), ("weight2", layer.weight2))
                   for entry in matrix_entries(name, p, stacked)]
        assert [(name, shape) for name, shape, _, _ in entries] == \
            [(f"weight1.expert{i}", (h, 2 * f)) for i in range(e)] + \
            [(f"weight2.expert{i}", (f, h)) for i in range(e)]
        # the layer's own views: weight1.view(E, hidden, -1), weight2.view(E, -1, hidden)
        w1 = layer.weight1.main_grad.view(e, h, -1)
        w2 = layer.weight2.main_grad.view(e, -1, h)
        for name, shape, p, i in entries:
            numel = shape[0] * shape[1]   # the patch's view: the entry's offset in the bucket
            view = p.main_grad.view(-1)[i * numel:(i + 1) * numel].view(shape)
            want = (w1 if p is layer.weight1 else w2)[i]
            assert view.data_ptr() == want.data_ptr() and torch.equal(view, want), name
        # one shape group of E matrices per weight, each at the rank, not one wide matrix
        comp = BucketCompressor([(name, shape) for name, shape, _, _ in entries], 4)
        assert sorted((k, len(g.names)) for k, g in comp.groups.items()) == \
            sorted([((f, h), e), ((h, 2 * f), e)])
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def check_slow_hop(r: dict, inter_members: list) -> None:
    """One rank of ``inst2``: its shard equals Megatron's partial distributed optimizer at
    full rank, the slow hop carries the shard's pieces, nothing is lost, the replicas agree
    and the error feedback covers the shard only."""
    assert r["group_members"][0] in inter_members and r["rank"] in r["group_members"][0]
    (shapes,), (offsets,), (shard,) = r["bucket_shapes"], r["bucket_offsets"], r["shard_ranges"]
    assert shard[1] - shard[0] == r["bucket_numel"][0] // 2
    for errors in r["full_rank_rel_err"]:
        assert max(errors) < 2e-5, errors   # as the flat buckets' (above)
    slow, fast = slow_hop_shard_bytes(shapes, offsets, shard, 2, LOW_RANK, factor_bytes=4)
    assert r["slow_hop_bytes"] == [slow] * 2
    # the instance's reduce-scatter stays dense (the whole bucket goes in); the P rows and
    # the Q slices are gathered inside the instance
    assert r["low_rank_bytes"] == [4 * r["bucket_numel"][0] + slow + fast] * 2
    assert slow < 0.15 * 4 * (shard[1] - shard[0])
    for errors in r["conservation_rel_err"]:
        assert max(errors) < 1e-5, errors
    assert all(all(step) for step in r["replicas_identical"])
    # error feedback (residual + Q) of the shard: about half of the whole matrices'
    whole = sum(4 * math.prod(s) for s in shapes if len(s) == 2)
    assert 0.4 * whole < r["state_bytes"] <= 0.55 * whole, (r["state_bytes"], whole)


def test_slow_hop_bypass_decides_alike_inside_each_instance(group_sync):
    """``--edgc-bypass auto`` with 2 instances: the ranks of an instance measure different
    costs (made 0 s and 1000 s here), yet every rank sends the same buckets dense (MAX
    over the instance), the sync completes, and the decision is cached per rank."""
    results = group_sync["inst2-bypass"]
    assert sorted(r["intra_rank"] for r in results) == [0, 0, 1, 1]
    for r in results:
        # instance rank 1 would send every bucket dense: so does instance rank 0
        assert r["dense_keys"] == r["keys"] == r["dense_keys_again"]
        assert r["bypassed"] == len(r["keys"]) and r["finite"]
