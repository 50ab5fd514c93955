"""The matrices in one rank's shard of a DDP bucket (EDGC on the slow hop, docs/method.md §1
"The slow hop"): rank ``k`` of an instance of ``s`` owns ``[k·L/s, (k+1)·L/s)`` of the
bucket, which cuts matrices; each parameter's part is split, in megatron-core's row-major
layout, into a block of whole rows (compressed with its matrix's ``Q``: ``P = Σ M_i Q`` is
linear in the rows) and at most two partial rows at its ends, sent dense with every
vector. Pure index arithmetic, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_edgc.compression.matrices import matrix_shape


@dataclass(frozen=True)
class ShardPiece:
    """A piece of the shard: ``numel`` elements from bucket offset ``start``, viewed as
    ``shape`` (``(rows, m)`` for a row block, ``(1, numel)`` for a dense piece)."""

    name: str
    start: int
    shape: tuple
    parent: str = ""      # the parameter (matrix) the piece is part of
    row0: int = 0         # a row block's first row in that matrix
    row_block: bool = False

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def shard_pieces(params, shard_start: int, shard_end: int) -> list:
    """The pieces of ``[shard_start, shard_end)`` covered by ``params``: ``(name, bucket
    offset, shape)`` of each parameter. Bucket padding (covered by no parameter) is left
    out: it is zero on every rank."""
    pieces = []
    for name, offset, shape in params:
        n, m = matrix_shape(shape)
        a, b = max(offset, shard_start), min(offset + n * m, shard_end)
        if a >= b:
            continue
        la, lb = a - offset, b - offset
        if n == 1 or m == 1:
            pieces.append(ShardPiece(name, a, (1, b - a), name))
            continue
        r0, r1 = -(-la // m), lb // m   # whole rows inside [la, lb)
        if r1 <= r0:                    # no whole row: one partial piece
            pieces.append(ShardPiece(name, a, (1, b - a), name))
            continue
        if la < r0 * m:
            pieces.append(ShardPiece(f"{name}[head]", a, (1, r0 * m - la), name))
        rows_name = name if (r0, r1) == (0, n) else f"{name}[rows {r0}:{r1}]"
        pieces.append(ShardPiece(rows_name, offset + r0 * m, (r1 - r0, m), name, r0, True))
        if r1 * m < lb:
            pieces.append(ShardPiece(f"{name}[tail]", offset + r1 * m, (1, lb - r1 * m),
                                     name))
    return pieces
