"""Map one matrix product onto the matrix planes: which operand stays, how it tiles, which plane does what.

``out[M, N] = A[M, K] @ B[K, N]``. One operand is *stationary*: installed into
a plane's weight buffer a ``rows × cols`` tile at a time (INSTALL, over the
plane's install streams); the other *streams* through it, one row of K per pass
(MATMUL). B stationary streams A's rows; A stationary installs A's tiles
transposed and streams B's columns, computing the result transposed. Per
product the mapping that costs fewer plane-cycles is taken: a convolution with
few output channels and many positions keeps its activations stationary, one
with many channels and few positions its weights.

K beyond the array's rows is tiled; each K tile adds into fp32/int32 partial
sums (MATMUL's accumulator operand) and the last one streams its sums straight
into the vector unit (a chained EPILOGUE: bias, activation or requantisation,
and the store). The work is cut into *jobs* (a stationary column tile and a
chunk of the streamed rows) spread over the planes; each tile names its own
weight buffer and the scheduler picks which of the plane's buffers holds it,
so a tile installs while the previous one computes, and a plane works on
several jobs in turn, one's partial sums written back while another computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from typing import Callable

import numpy as np

from ..runtime_sim import ChipConfig, Opcode
from .views import Operand, stream, transposed


@dataclass
class Product:
    """A matrix product to map, described by views of its operands.

    ``a(m0, m1, k0, k1)`` and ``b(k0, k1, n0, n1)`` give 2-D views of A and B,
    ``out(m0, m1, n0, n1)`` one of the result, ``extras(m0, m1, n0, n1,
    transposed)`` the EPILOGUE's bias (and requantisation) operands shaped to
    broadcast against that block (or its transpose).
    """

    m: int
    k: int
    n: int
    a: Callable
    b: Callable
    out: Callable
    extras: Callable
    dtype: np.dtype  # of A and B
    zp_a: int = 0
    zp_b: int = 0
    epilogue: dict | None = None  # the EPILOGUE's attributes
    stationary: str | None = None  # force "A" or "B"
    # a row-wise op chained from the EPILOGUE's stream (a softmax over the columns): (opcode, attributes,
    # layer, view of its output like ``out``); its product holds B, in one column tile, so a job's rows are whole
    then: tuple | None = None
    # the streamed rows are the rows the next op reads band by band (a matmul's): their chunks come first
    # (a convolution's next op reads every channel of its rows, whichever operand streams)
    rows_first: bool = True


def _install_cycles(rows: int, cols: int, itemsize: int, config: ChipConfig) -> int:
    return ceil(rows * cols * itemsize / (config.mxm_install_streams * config.lanes))


@dataclass(frozen=True)
class Mapping:
    """How a product maps: the stationary operand, and into how many chunks its streamed rows are cut."""

    stationary: str
    chunks: int
    cycles: int  # the estimated makespan on the planes


def plan(p: Product, config: ChipConfig) -> Mapping:
    """The mapping with the shortest estimated makespan.

    Per K tile a plane runs its jobs in turn; a job's rows take ``rows × passes``
    cycles, its tile's install hides behind the previous job unless it takes
    longer, and a job's next K tile waits for its partial sums (the plane's
    latency) unless other jobs fill that time.
    """
    passes = config.mxm_passes[_matrix_class(p.dtype)]
    item = np.dtype(p.dtype).itemsize
    k_tiles = ceil(p.k / config.mxm_rows)
    best = None
    for stationary in (p.stationary,) if p.stationary else ("B", "A"):
        held, streamed = (p.n, p.m) if stationary == "B" else (p.m, p.n)
        col_tiles = ceil(held / config.mxm_cols)
        install = _install_cycles(min(p.k, config.mxm_rows), min(held, config.mxm_cols), item, config)
        for chunks in sorted({1, 2, 3, 4, 6, 8, 12, 16} & set(range(1, streamed + 1))):
            rows = ceil(streamed / chunks) * passes
            per_plane = ceil(col_tiles * chunks / config.mxm_planes)
            step = per_plane * max(install, rows)
            if k_tiles > 1:  # a job's next K tile waits for its partial sums unless other jobs fill the time
                step = max(step, rows + config.latency_cycles["MXM"])
            cycles = install + k_tiles * step + config.latency_cycles["MXM"]
            if best is None or cycles < best.cycles:  # ties keep fewer chunks: fewer installs
                best = Mapping(stationary, chunks, cycles)
    return best


def add_tree(emit: Callable, terms: list, layer: str, into=None):
    """Sum ``terms`` (operands of one shape) with the vector unit as a tree, each ADD in place into its first
    operand (log2 of the terms deep, not one after another); the last ADD writes ``into`` where given. Returns
    the operand that holds the sum."""
    terms = list(terms)
    while len(terms) > (2 if into is not None else 1):
        for a, b in zip(terms[::2], terms[1::2]):
            emit(Opcode.ADD, [a, b], [a], {}, layer, None)
        terms = terms[::2]
    if into is not None:
        emit(Opcode.ADD, terms, [into], {}, layer, None)
        return into
    return terms[0]


def _k_groups(jobs: int, k_tiles: int, planes: int) -> int:
    """Into how many runs to split each job's K tiles: as many as leave no plane idle (at most a run a tile),
    where the jobs alone leave planes idle. The vector unit adds the runs' partial sums in the planes' own
    accumulator type (fp32 or int32), so the sum is the one a single plane makes up to the order of its
    terms."""
    if jobs >= planes or k_tiles < 2:
        return 1
    return min(planes // jobs, k_tiles)


def _matrix_class(dtype) -> str:
    from ..runtime_sim.isa import DType

    return DType.from_numpy(dtype).matrix_class


class PlaneMapper:
    """Emits INSTALL / MATMUL / EPILOGUE tile ops for products, keeping the planes balanced."""

    def __init__(self, g, config: ChipConfig, emit: Callable, new_chain: Callable):
        self.g, self.config, self.emit, self.new_chain = g, config, emit, new_chain
        self.load = [0] * config.mxm_planes  # planned cycles per plane, to balance jobs
        self.load_now = [0] * config.mxm_planes  # the same for the product being mapped
        self.tiles = 0  # each installed tile names its own buffer; schedule picks the plane's physical one

    def map(self, p: Product, layer: str) -> None:
        """Emit the tile ops of one product."""
        config = self.config
        self.load_now = [0] * config.mxm_planes
        mapping = plan(p, config)
        stationary = mapping.stationary
        held, streamed = (p.n, p.m) if stationary == "B" else (p.m, p.n)
        passes = config.mxm_passes[_matrix_class(p.dtype)]
        col_tiles = [(c, min(c + config.mxm_cols, held)) for c in range(0, held, config.mxm_cols)]
        k_tiles = [(k, min(k + config.mxm_rows, p.k)) for k in range(0, p.k, config.mxm_rows)]
        step = ceil(streamed / mapping.chunks)
        chunks = [(r, min(r + step, streamed)) for r in range(0, streamed, step)]
        if p.rows_first:  # chunk by chunk of rows, each spread over the planes: the next op starts on the first
            jobs = [(c, rows) for rows in chunks for c in col_tiles]
        else:
            jobs = [(c, rows) for c in col_tiles for rows in chunks]
        partial = np.dtype(np.int32) if np.dtype(p.dtype).kind in "iu" else np.dtype(np.float32)
        groups = _k_groups(len(jobs), len(k_tiles), config.mxm_planes)
        if groups > 1:
            self._split_k(p, stationary, jobs, k_tiles, groups, passes, partial, layer)
            return
        per_plane = [[] for _ in range(config.mxm_planes)]
        for job in sorted(jobs, key=lambda j: -(j[1][1] - j[1][0])):
            plane = self._least_loaded()
            self._book(plane, self._cycles(p, job, k_tiles, passes))
            per_plane[plane].append(job)
        for plane, plane_jobs in enumerate(per_plane):
            sums = {}
            for ki, (k0, k1) in enumerate(k_tiles):
                for job in plane_jobs:
                    (c0, c1), (r0, r1) = job
                    last = ki == len(k_tiles) - 1
                    self._tile(p, stationary, plane, (k0, k1), (c0, c1), (r0, r1), ki, last, sums, job, partial, layer)

    def _least_loaded(self) -> int:
        return min(range(self.config.mxm_planes), key=lambda q: (self.load_now[q], self.load[q]))

    def _book(self, plane: int, cycles: int) -> None:
        self.load_now[plane] += cycles
        self.load[plane] += cycles

    def _cycles(self, p: Product, job: tuple, k_tiles: list, passes: int) -> int:
        """A job's plane-cycles over ``k_tiles``: each tile's install (its own rows and columns: a narrow last
        column tile installs in a fraction of a full one's time) or its rows' passes, the longer."""
        (c0, c1), (r0, r1) = job
        item = np.dtype(p.dtype).itemsize
        return sum(max(_install_cycles(k1 - k0, c1 - c0, item, self.config), (r1 - r0) * passes)
                   for k0, k1 in k_tiles)

    def _split_k(self, p, stationary, jobs, k_tiles, groups, passes, partial, layer) -> None:
        """A product with fewer jobs than planes (a decode step's: one row, few column tiles) whose K spans
        several tiles: each job's K tiles in ``groups`` runs on planes of their own, side by side; the other
        runs' partial sums are added (VXM) into the last run's before its last tile, whose sums stream into
        the EPILOGUE as ever. A plane that would run all K tiles in turn, idle planes beside it, runs a
        ``groups``-th of them."""
        bounds = [round(g * len(k_tiles) / groups) for g in range(groups + 1)]
        runs = [k_tiles[a:b] for a, b in zip(bounds, bounds[1:])]
        for job in jobs:
            (c0, c1), (r0, r1) = job
            finished = []
            for g, run in enumerate(runs):
                plane = self._least_loaded()
                self._book(plane, self._cycles(p, job, run, passes))
                sums = {}
                final = g == len(runs) - 1
                for ki, ks in enumerate(run):
                    if final and ki == len(run) - 1:  # the others' sums join before the last tile
                        sums[job] = add_tree(self.emit, ([sums[job]] if job in sums else []) + finished, layer)
                        self._tile(p, stationary, plane, ks, (c0, c1), (r0, r1), 1, True, sums, job, partial, layer)
                    else:
                        self._tile(p, stationary, plane, ks, (c0, c1), (r0, r1), ki, False, sums, job, partial,
                                   layer)
                if not final:
                    finished.append(sums[job])

    def _tile(self, p, stationary, plane, ks, cs, rs, ki, last, sums, job, partial, layer) -> None:
        (k0, k1), (c0, c1), (r0, r1) = ks, cs, rs
        if stationary == "B":  # install B[k, c]; stream A[r, k]; result out[r, c]
            weights, rows, zp_a, zp_b = p.b(k0, k1, c0, c1), p.a(r0, r1, k0, k1), p.zp_a, p.zp_b
            m, n = (r0, r1), (c0, c1)
        else:  # install A[c, k]ᵀ; stream B[k, r]ᵀ; result out[c, r]ᵀ
            weights, rows, zp_a, zp_b = transposed(p.a(c0, c1, k0, k1)), transposed(p.b(k0, k1, r0, r1)), p.zp_b, p.zp_a
            m, n = (c0, c1), (r0, r1)
        self.tiles += 1
        buffer = self.tiles
        self.emit(Opcode.INSTALL, [weights], [], {"buffer": buffer}, layer, plane)
        shape = (r1 - r0, c1 - c0)
        srcs = [rows] + ([sums[job]] if ki else [])
        if last:
            chain = self.new_chain()
            acc = stream(chain, shape, partial)
            self.emit(Opcode.MATMUL, srcs, [acc], {"buffer": buffer, "zp_a": zp_a, "zp_b": zp_b}, layer, plane)
            out = p.out(*m, *n)
            extras = p.extras(*m, *n, stationary == "A")
            if stationary == "A":
                out = transposed(out)
            if p.then is not None:  # the epilogue's rows go on, in a stream, to the chained op
                opcode, attrs, then_layer, then_out = p.then
                out = stream(self.new_chain(), shape, self.g.tensors[self.g.base(out.tensor)].dtype)
                self.emit(Opcode.EPILOGUE, [acc] + extras, [out], dict(p.epilogue or {}), layer, None)
                self.emit(opcode, [out], [then_out(*m, *n)], dict(attrs), then_layer, None)
                return
            self.emit(Opcode.EPILOGUE, [acc] + extras, [out], dict(p.epilogue or {}), layer, None)
            return
        if job not in sums:
            tid = self.g.add_tensor(shape, partial)
            sums[job] = Operand(tid, shape)
        self.emit(Opcode.MATMUL, srcs, [sums[job]], {"buffer": buffer, "zp_a": zp_a, "zp_b": zp_b}, layer, plane)
