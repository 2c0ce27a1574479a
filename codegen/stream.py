"""Back-to-back inferences as one static schedule: what a stream of inputs costs once the pipeline is full.

A chip that serves a stream does not wait for one inference to end before the
next input crosses the host link: the next transfer overlaps the current
compute. The schedule is static, so the honest way to time that is to schedule
it: the graph is repeated ``copies`` times over the same resident weights (one
input and one output per copy), and the same stages compile the lot.
"""

from __future__ import annotations

from copy import copy

from ..runtime_sim import Program
from ..runtime_sim.errors import LpxUserError
from .graph import Graph, Node, Tensor
from .stages import Compilation, graph_stage, run_stages


def replicated(g: Graph, copies: int) -> Graph:
    """``copies`` independent inferences of ``g`` in one graph.

    Parameters
    ----------
    g : Graph
        A lowered graph without resident state.
    copies : int

    Returns
    -------
    Graph
        The constants shared; every other tensor, node, input and output once per copy (copy ``k``'s layers
        end in ``#k``).
    """
    if g.state:
        raise LpxUserError("a stream of inferences cannot share resident state (a KV cache): each call updates it")
    out = Graph(tensors=list(g.tensors), quantized=dict(g.quantized))
    for k in range(copies):
        ids = {}  # copy 0 keeps the ids; each later copy gets its own activations (aliases into its own)
        if k:
            made = [tid for tid, tensor in enumerate(g.tensors) if tensor.data is None]
            ids = {tid: len(out.tensors) + n for n, tid in enumerate(made)}
            for tid in made:
                t = g.tensors[tid]
                out.tensors.append(Tensor(t.shape, t.dtype, None, None if t.alias_of is None
                                          else ids.get(t.alias_of, t.alias_of)))
        new_id = lambda t: ids.get(t, t)
        for node in g.nodes:
            out.nodes.append(Node(node.kind, [new_id(t) for t in node.inputs], new_id(node.output), copy(node.attrs),
                                  f"{node.layer}#{k}"))
        out.inputs += [new_id(t) for t in g.inputs]
        out.outputs += [new_id(t) for t in g.outputs]
        out.host_dtype.update({new_id(t): d for t, d in g.host_dtype.items()})
        out.host_converted.update({new_id(t): q for t, q in g.host_converted.items()})
        out.widened.update({new_id(t): w for t, w in g.widened.items()})
    return out


def stream_program(function, options, copies: int, name: str = "stream") -> Program:
    """One lpx function compiled as ``copies`` back-to-back inferences (see the module docstring).

    Parameters
    ----------
    function : tvm.relax.Function
        A function partitioned for lpx.
    options : Target
    copies : int
        At least 1.
    name : str
        Used for layer names and dump files.

    Returns
    -------
    Program
    """
    if copies < 1:
        raise LpxUserError(f"a stream needs at least one inference, got {copies}")
    c = Compilation(name, options, source=function)
    run_stages(c, "lower", graph_stage(options))
    c.graph = replicated(c.graph, copies)
    return run_stages(c, "tile", "emit")
