"""SRAM footprints meet where their bytes do: the checker's pairwise test, the scheduler's vectorised one and
the whole-program check's pair-by-pair one, against a byte map of SRAM."""

import numpy as np

from lpx_tvm.runtime_sim import DType, TensorRef
from lpx_tvm.runtime_sim.hazards import footprint_key, meet_pairs, meets, overlaps

SPAN = 512


def random_ref(rng) -> TensorRef:
    """A view with up to two axes: dense, a column block of a wider matrix, a strided row, a transposed block."""
    rows, cols = int(rng.integers(1, 6)), int(rng.integers(1, 9))
    kind = rng.integers(4)
    if kind == 0:
        strides = None
    elif kind == 1:
        strides = (cols + int(rng.integers(1, 9)), 1)
    elif kind == 2:
        strides = (int(rng.integers(2, 12)), int(rng.integers(2, 4)))
    else:
        strides = (1, rows + int(rng.integers(0, 3)))
    addr = int(rng.integers(0, SPAN // 2))
    return TensorRef(addr, (rows, cols), DType.F32 if rng.integers(2) else DType.I8, strides)


def touched(ref) -> set:
    """The bytes the view touches, element by element."""
    item = ref.dtype.itemsize
    out = set()
    for index in np.ndindex(*ref.shape):
        start = ref.addr + item * sum(i * s for i, s in zip(index, ref.element_strides))
        out.update(range(start, start + item))
    return out


def block_bytes(ref) -> set:
    addr, rows, run, stride = ref.footprint()
    return {addr + r * stride + c for r in range(rows) for c in range(run)}


def compared_exactly(a, b) -> bool:
    """Blocks of one stride, two plain ranges, or a plain range that fits in a row of the block's stride."""
    if a[2] == b[2]:
        return True
    block, plain = (a, b) if b[2] == 0 else (b, a)
    return plain[2] == 0 and plain[1] - plain[0] <= block[2]


def test_footprints_meet_exactly_where_same_stride_blocks_share_bytes_and_never_miss_a_shared_byte():
    rng = np.random.default_rng(7)
    refs = [random_ref(rng) for _ in range(160)]
    keys = [footprint_key(r) for r in refs]
    assert all(touched(r) <= block_bytes(r) for r in refs)  # a footprint covers its view's bytes
    exact = [touched(r) == block_bytes(r) for r in refs]
    table = np.array(keys, np.int64).T
    exact_pairs = 0
    first, second = np.repeat(np.arange(len(refs)), len(refs)), np.tile(np.arange(len(refs)), len(refs))
    pairwise = meet_pairs(table[:, first], table[:, second]).reshape(len(refs), len(refs))
    for a, (ref, key) in enumerate(zip(refs, keys)):
        vector = overlaps(table, key)
        for b, other in enumerate(refs):
            truth = bool(touched(ref) & touched(other))
            pair = meets(keys[b], key)
            assert pair == bool(vector[b]) == meets(key, keys[b]) == pairwise[a, b] == pairwise[b, a], (ref, other)
            if truth:
                assert pair, f"{ref} and {other} share bytes the footprints miss"
            if exact[a] and exact[b] and compared_exactly(key, keys[b]):
                exact_pairs += 1
                assert pair == truth, (ref, other)
    assert exact_pairs > 1000  # the exact cases were exercised, not just the bounding-range fallback
