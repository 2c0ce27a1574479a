"""The LPX codegen: Relax composite ─► Program, as named stages.

    lower     Relax ops ─► LPX operator graph (no TVM types past this step)
    fuse      fold per-channel scale/bias and activations into conv/matmul
    precision store tensors in the requested type (fp16, bf16), casts at the boundary;
              for int8, DQ ─► conv/matmul ─► Q becomes an int8 operator (qfuse)
    tile      split each operator into instructions that fit the units
    alloc     place every tensor in SRAM (liveness-based, never over capacity)
    schedule  assign each instruction a unit and an issue cycle
    emit      build the Program (instructions + constants)

Each stage's result can be written to a folder for debugging
(``compile_function(..., dump_dir=...)``).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from ..runtime_sim import ChipConfig, Program, disassemble, load_config
from .alloc import CapacityError, allocate
from .emit import emit, resolve
from .fuse import fuse_epilogues
from .graph import Graph
from .precision import lower_precision
from .qfuse import fuse_int8
from .schedule import schedule
from .tile import tile

STAGES = ("lower", "fuse", "precision", "tile", "alloc", "schedule", "emit")
DTYPES = ("fp32", "fp16", "bf16", "int8")


@dataclass(frozen=True)
class CodegenOptions:
    """Options of the lpx codegen, validated on construction.

    Parameters
    ----------
    config : str
        Chip preset name (or path to a JSON preset).
    in_order : bool
        Use the in-order reference schedule instead of the list scheduler.
    dump_dir : str, optional
        Write each stage's result there.
    dtype : str
        Storage type on lpx: ``"fp32"`` (default), ``"fp16"``, ``"bf16"`` or ``"int8"``.
    """

    config: str = "tiny"
    in_order: bool = False
    dump_dir: str | None = None
    dtype: str = "fp32"

    def __post_init__(self):
        chip = load_config(self.config)  # raises a clear error for an unknown preset
        if not isinstance(self.in_order, bool):
            raise ValueError(f"in_order must be a bool, got {self.in_order!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        chip.check_dtype(self.dtype)

    @classmethod
    def from_dict(cls, options: dict | None) -> "CodegenOptions":
        options = dict(options or {})
        known = {"config", "in_order", "dump_dir", "dtype"}
        if set(options) - known:
            raise ValueError(f"unknown lpx codegen options {sorted(set(options) - known)}; "
                             f"known: {', '.join(sorted(known))}")
        return cls(**options)

    @property
    def chip(self) -> ChipConfig:
        return load_config(self.config)


def _describe_graph(g: Graph) -> str:
    lines = [f"inputs {g.inputs} outputs {g.outputs}"]
    for n in g.nodes:
        shapes = [g.tensors[t].shape for t in n.inputs]
        lines.append(f"t{n.output} {g.tensors[n.output].shape} = {n.kind}({n.inputs} {shapes}) "
                     f"{ {k: v for k, v in n.attrs.items()} }  ; {n.layer}")
    return "\n".join(lines)


def _tile_and_allocate(g: Graph, chip: ChipConfig) -> tuple:
    """Tile, then allocate; when activations do not fit beside the weights, stream more weights and retry."""
    for budget in (chip.sram_bytes // 2 >> k for k in range(4)):
        ops = tile(g, chip, resident_budget=budget)
        try:
            return ops, allocate(g, ops, chip)
        except CapacityError:
            continue
    ops = tile(g, chip, resident_budget=0)  # stream every weight that can stream; a CapacityError here is final
    return ops, allocate(g, ops, chip)


class Int8CoverageWarning(UserWarning):
    """With dtype="int8", a conv/matmul outside a complete QDQ pattern runs in float on lpx."""


def _fuse_int8_or_warn(g: Graph, name: str) -> None:
    fuse_int8(g)
    left = [n.layer for n in g.nodes if n.kind in ("conv2d", "matmul")]
    if left:
        warnings.warn(f"lpx int8: {len(left)} conv/matmul in {name} are not between DequantizeLinear and "
                      f"QuantizeLinear with integer weights and run in float (first: {left[0]})",
                      Int8CoverageWarning, stacklevel=3)


def compile_graph(g: Graph, options: CodegenOptions, name: str = "lpx") -> Program:
    """Run fuse ─► emit on a lowered graph."""
    chip = options.chip
    dump = Path(options.dump_dir) if options.dump_dir else None
    if dump:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{name}.1_lower.txt").write_text(_describe_graph(g))
    fuse_epilogues(g)
    if dump:
        (dump / f"{name}.2_fuse.txt").write_text(_describe_graph(g))
    if options.dtype == "int8":
        _fuse_int8_or_warn(g, name)
    else:
        lower_precision(g, options.dtype)
    if dump and options.dtype != "fp32":
        (dump / f"{name}.2b_precision.txt").write_text(_describe_graph(g))
    ops, addr = _tile_and_allocate(g, chip)
    if dump:
        (dump / f"{name}.3_tile.txt").write_text(
            "\n".join(f"{o.opcode.name} {o.dsts} <- {o.srcs} {o.attrs} ; {o.layer}" for o in ops))
    if dump:
        (dump / f"{name}.4_alloc.txt").write_text(
            "\n".join(f"t{t} @ {a:#x} {g.tensors[t].shape}" for t, a in addr.items() if t != "high_water"))
    instructions, layers = resolve(g, ops, addr)
    instructions, makespan = schedule(instructions, chip, in_order=options.in_order)
    program = emit(g, addr, instructions, layers, makespan, chip)
    if dump:
        (dump / f"{name}.5_schedule+emit.txt").write_text(disassemble(program))
    return program


def compile_function(func, options: CodegenOptions | None = None, name: str = "lpx") -> Program:
    """Compile one offloaded Relax function to an LPX Program.

    Parameters
    ----------
    func : tvm.relax.Function
        A function partitioned for lpx.
    options : CodegenOptions
    name : str
        Used for layer names and dump files.
    """
    from .lower import lower  # TVM is imported only when a Relax function is compiled

    return compile_graph(lower(func, name), options or CodegenOptions(), name)


__all__ = ["CodegenOptions", "CapacityError", "compile_function", "compile_graph", "STAGES"]
