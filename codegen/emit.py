"""emit: resolve operands to SRAM addresses and build the Program."""

from __future__ import annotations

from ..runtime_sim import ChipConfig, Constant, DType, Instruction, Program, Space, StreamedWeight, TensorRef
from ..runtime_sim.isa import HostTensor
from .graph import Graph


def _ref(g: Graph, addr: dict, operand) -> TensorRef:
    if operand.tensor is None:  # a chained stream: its chain id until schedule picks the stream
        return TensorRef(operand.stream, tuple(operand.shape), DType.from_numpy(operand.dtype), None, Space.STREAM)
    base = g.base(operand.tensor)
    return TensorRef(addr[base] + operand.offset, tuple(operand.shape), DType.from_numpy(g.tensors[base].dtype),
                     operand.strides)


def resolve(g: Graph, ops: list, addr: dict) -> tuple:
    """Unscheduled instructions, the layer-name table, and which instructions' units the tiler fixed."""
    layers, index, fixed = [], {}, set()
    instructions = []
    for i, op in enumerate(ops):
        layer = index.setdefault(op.layer, len(index))
        if layer == len(layers):
            layers.append(op.layer)
        if op.unit_index is not None:
            fixed.add(i)
        instructions.append(Instruction(op.opcode, op.unit_index or 0, 0, tuple(_ref(g, addr, s) for s in op.srcs),
                                        tuple(_ref(g, addr, d) for d in op.dsts), op.attrs, layer))
    return instructions, tuple(layers), fixed


def emit(g: Graph, addr: dict, instructions: list, layers: tuple, makespan: int, config: ChipConfig,
         plan=None) -> Program:
    """Assemble the Program: constants at their addresses, host signature, schedule."""
    constants = []
    for tid, where in addr.items():
        if tid == "high_water" or g.tensors[tid].data is None:
            continue
        t = g.tensors[tid]
        # the weight itself, not a copy: encode writes its bytes straight into the program
        constants.append(Constant(TensorRef(where, t.shape, DType.from_numpy(t.dtype)), t.data))
    host = lambda ids: tuple(HostTensor(g.tensors[t].shape, DType.from_numpy(g.host_dtype.get(t, g.tensors[t].dtype)))
                             for t in ids)
    streamed = tuple(StreamedWeight(HostTensor(w.shape, DType.from_numpy(w.dtype)), w) for w in g.streamed)
    state = tuple((k, TensorRef(addr[g.base(t)], g.tensors[t].shape, DType.from_numpy(g.tensors[g.base(t)].dtype)))
                  for k, t in enumerate(g.inputs) if g.base(t) in g.state and g.base(t) in addr)
    converted = tuple((k, *g.host_converted[t]) for k, t in enumerate(g.inputs) if t in g.host_converted)
    widened = tuple((j, *g.widened[t]) for j, t in enumerate(g.outputs) if t in g.widened)
    return Program(config.name, config.digest, tuple(instructions), tuple(constants),
                   host(g.inputs), host(g.outputs), layers, makespan, streamed=streamed, plan=plan, state=state,
                   host_converted=converted, widened_outputs=widened, chip=config)
