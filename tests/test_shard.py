"""The pieces of a bucket shard (``compression/shard.py``): they tile exactly what the
parameters put into the shard, whole-row blocks are as large as they can be, and a row
block of the instance sum is the instance sum of the row blocks."""

import random

import torch

from megatron_edgc.compression.matrices import matrix_shape
from megatron_edgc.compression.shard import shard_pieces


def layout(shapes, pad=0):
    params, at = [], 0
    for i, shape in enumerate(shapes):
        params.append((f"p{i}", at, shape))
        at += matrix_shape(shape)[0] * matrix_shape(shape)[1]
    return params, at + pad


def test_pieces_tile_the_shard_and_rows_are_maximal():
    rng = random.Random(0)
    for trial in range(200):
        shapes = [rng.choice([(rng.randint(2, 9), rng.randint(2, 9)), (rng.randint(1, 20),)])
                  for _ in range(rng.randint(1, 6))]
        params, total = layout(shapes, pad=rng.randint(0, 7))
        s = rng.randint(1, 5)
        total += (-total) % s
        size = total // s
        covered = []
        for k in range(s):
            pieces = shard_pieces(params, k * size, (k + 1) * size)
            for piece in pieces:
                assert k * size <= piece.start and piece.start + piece.numel <= (k + 1) * size
                covered += range(piece.start, piece.start + piece.numel)
                name = piece.name.split("[")[0]
                offset, shape = next((o, sh) for nm, o, sh in params if nm == name)
                n, m = matrix_shape(shape)
                if piece.shape[0] > 1:   # a row block: starts and ends on row boundaries
                    assert (piece.start - offset) % m == 0 and piece.shape[1] == m
                elif n > 1 and m > 1:    # a partial piece lies within one row
                    row = (piece.start - offset) // m
                    assert (piece.start + piece.numel - 1 - offset) // m == row or \
                        piece.numel < 2 * m
            # at most one row block per parameter, at most two partial pieces around it
            names = [p.name.split("[")[0] for p in pieces]
            assert all(names.count(n_) <= 3 for n_ in set(names))
        params_numel = sum(matrix_shape(sh)[0] * matrix_shape(sh)[1] for _, _, sh in params)
        assert sorted(covered) == list(range(params_numel)), trial   # each element once


def test_whole_parameter_in_shard_is_one_matrix():
    params, total = layout([(8, 4), (4,), (6, 4)])
    pieces = shard_pieces(params, 0, total)
    assert [(p.name, p.start, p.shape) for p in pieces] == \
        [("p0", 0, (8, 4)), ("p1", 32, (1, 4)), ("p2", 36, (6, 4))]
    # a cut inside p0's row 2 and p2's row 3
    pieces = shard_pieces(params, 10, 50)
    assert [(p.name, p.start, p.shape) for p in pieces] == \
        [("p0[head]", 10, (1, 2)), ("p0[rows 3:8]", 12, (5, 4)), ("p1", 32, (1, 4)),
         ("p2[rows 0:3]", 36, (3, 4)), ("p2[tail]", 48, (1, 2))]


def test_row_block_of_the_sum_is_the_sum_of_row_blocks():
    """What makes the slow hop exact in exact arithmetic: P = M Q over a row block of the
    instance-summed gradient equals the sum of each rank's row-block products."""
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(12, 7, generator=gen, dtype=torch.float64) for _ in range(3)]
    q = torch.randn(7, 2, generator=gen, dtype=torch.float64)
    params, _ = layout([(12, 7)])
    (block,) = [p for p in shard_pieces(params, 14, 63) if p.shape[0] > 1]
    r0 = block.start // 7
    rows = slice(r0, r0 + block.shape[0])
    summed = sum(grads)[rows] @ q
    assert torch.allclose(summed, sum(g[rows] @ q for g in grads), rtol=0, atol=1e-12)
