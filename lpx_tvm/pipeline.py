"""The relax pipeline ``"lpx"``, the codegen hook ``relax.ext.lpx`` and the target tag ``"lpx"``.

Offloaded functions become calls of the global runtime function
``lpx.runtime.execute`` whose first argument is the encoded program, held as a
uint8 constant of the executable, so ``export_library`` / ``load_module``
round-trip it with no side files.
"""

from __future__ import annotations

import warnings

import numpy as np
import tvm
from tvm import relax
from tvm.relax.expr_functor import PyExprMutator, mutator

from .codegen import Target, compile_model
from .patterns import partition_for_lpx
from .runtime_sim.program import aligned_array, encode
from .runtime_sim.errors import LpxUserError

EXECUTE = "lpx.runtime.execute"
_EXTERN_PROGRAMS: dict = {}  # symbol -> encoded program, filled by relax.ext.lpx (the BYOC path)


class NothingOffloadedWarning(UserWarning):
    """A module compiled for lpx ran entirely on the host."""


def relax_ext_lpx(functions, options, constant_names):
    """BYOC hook called by ``relax.transform.RunCodegen``: compile each function to a program."""
    opts = Target.from_dict(dict(options) if options else None)
    programs = compile_model({str(func.attrs["global_symbol"]): func for func in functions}, opts)
    for symbol, program in programs.items():
        _EXTERN_PROGRAMS[symbol] = encode(program)
    return []


def _is_lpx_function(func) -> bool:
    return isinstance(func, relax.Function) and func.attrs is not None and func.attrs.get("Codegen") == "lpx"


def lpx_functions(mod) -> dict:
    """A partitioned module's lpx functions by their global symbol (the name their programs go by)."""
    return {str(f.attrs["global_symbol"]): f for _, f in mod.functions.items() if _is_lpx_function(f)}


@mutator
class _CallRewriter(PyExprMutator):
    def __init__(self, mod, programs: dict):
        super().__init__(mod)
        self.programs = programs  # GlobalVar name or extern symbol -> program bytes
        self.count = 0

    def _execute(self, blob: bytes, args, out_ty):
        # the executable's constant shares the program's memory (DLPack): a program is mostly weights
        if not isinstance(blob, np.ndarray):  # a program from RunCodegen: bytes
            copy = aligned_array(len(blob))
            copy[:] = np.frombuffer(blob, np.uint8)
            blob = copy
        program = relax.const(tvm.runtime.from_dlpack(blob))
        self.count += 1
        outs = list(out_ty.fields) if isinstance(out_ty, relax.TupleType) else out_ty
        return relax.call_dps_packed(relax.ExternFunc(EXECUTE), relax.Tuple([program, *args]), outs)

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if isinstance(call.op, relax.GlobalVar) and call.op.name_hint in self.programs:
            return self._execute(self.programs[call.op.name_hint], call.args, call.ty)
        if call.op.same_as(tvm.ir.Op.get("relax.call_dps_packed")) and isinstance(call.args[0], relax.ExternFunc):
            blob = self.programs.get(str(call.args[0].global_symbol))
            if blob is not None:
                return self._execute(blob, call.args[1].fields, call.ty)
        return call


def _already_partitioned(mod) -> bool:
    """True once partition_for_lpx (and maybe RunCodegen) ran: lpx functions or extern calls exist."""
    found = []
    for _, func in mod.functions.items():
        if _is_lpx_function(func):
            return True
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, lambda e: found.append(e) if isinstance(e, relax.ExternFunc) else None)
    return bool(found)


@mutator
class _StatefulCallCloner(PyExprMutator):
    """Each call of an lpx function that takes resident state gets a function of its own: TVM merges equal
    functions, and one function's program has one resident slot per parameter, so two call sites with two
    caches (a decoder's identical layers) would share one cache."""

    def __init__(self, mod, state_params: set):
        super().__init__(mod)
        self.state_params, self.seen, self.clones = state_params, set(), 0

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not isinstance(call.op, relax.GlobalVar) or not any(a in self.state_params for a in call.args):
            return call
        func = self.builder_.get()[call.op]
        if not _is_lpx_function(func):
            return call
        if call.op.name_hint not in self.seen:
            self.seen.add(call.op.name_hint)
            return call
        self.clones += 1
        symbol = f"{func.attrs['global_symbol']}_{self.clones}"
        gvar = self.builder_.add_func(func.with_attr("global_symbol", symbol), f"{call.op.name_hint}_{self.clones}")
        return relax.Call(gvar, call.args, call.attrs, call.ty_args)


def _input_names(main) -> list:
    """The model's input names, one per parameter of ``main`` (the ONNX names where the importer kept them)."""
    given = (main.attrs or {}).get("onnx_input_names")
    return [str(n) for n in given] if given is not None else [str(p.name) for p in main.params]


def _one_function_per_stateful_call(mod, names):
    main = mod["main"]
    params = {p for p, name in zip(main.params, _input_names(main)) if name in set(names)}
    cloner = _StatefulCallCloner(mod, params)
    body = cloner.visit_expr(main)
    if not cloner.clones:
        return mod
    out = cloner.builder_.get()
    out["main"] = body
    return out


def state_arguments(mod, functions: dict, names) -> tuple:
    """Which lpx function parameters are the model inputs ``names`` (resident state, such as a KV cache).

    Returns
    -------
    (dict, dict)
        Global symbol ─► indexes of its state parameters; model input name ─► [(symbol, index), ...].
    """
    main = mod["main"]
    own = _input_names(main)
    wanted = {p: name for p, name in zip(main.params, own) if name in set(names)}
    missing = sorted(set(names) - set(wanted.values()))
    if missing:
        raise LpxUserError(f"state inputs {missing} are not inputs of the model (its inputs: {own})")
    args, where = {}, {}

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, relax.GlobalVar) and expr.op.name_hint in functions:
            symbol = str(functions[expr.op.name_hint].attrs["global_symbol"])
            for k, arg in enumerate(expr.args):
                if arg in wanted:
                    args.setdefault(symbol, set()).add(k)
                    where.setdefault(wanted[arg], []).append((symbol, k))
    relax.analysis.post_order_visit(main.body, visit)
    unused = sorted(set(wanted.values()) - set(where))
    if unused:
        raise LpxUserError(f"state inputs {unused} do not go straight into an lpx function (they must be resident "
                           "on the chip, so what reads them must be offloaded)")
    return args, where


def lower_lpx_calls(mod, options: Target, programs_out: dict | None = None, state=(), held=None) -> tuple:
    """Compile every lpx function and call its program through the runtime bridge.

    ``state`` names model inputs kept resident on the chips from call to call (see :func:`state_arguments`);
    ``held`` (a :class:`~lpx_tvm.runtime_sim.held.HeldWeights`): the programs name the constants that lie
    inside its arrays instead of carrying a copy.

    Returns
    -------
    (IRModule, int, dict)
        The rewritten module, the number of offloaded call sites, and where each state input lives.
    """
    programs = dict(_EXTERN_PROGRAMS)
    if state:
        mod = _one_function_per_stateful_call(mod, state)
    functions = {gvar.name_hint: func for gvar, func in mod.functions.items() if _is_lpx_function(func)}
    state_args, state_where = state_arguments(mod, functions, state) if state else ({}, {})
    compiled = compile_model({str(f.attrs["global_symbol"]): f for f in functions.values()}, options, state_args)
    for name, func in functions.items():
        symbol = str(func.attrs["global_symbol"])
        program = compiled[symbol] if held is None else held.program(compiled[symbol])
        programs[name] = program.encoded()
        if programs_out is not None:
            programs_out[symbol] = programs[name]
    rewriter = _CallRewriter(mod, programs)
    for gvar, func in list(mod.functions.items()):
        if isinstance(func, relax.Function) and not _is_lpx_function(func) and not (
                func.attrs and func.attrs.get("Composite")):
            mod[gvar] = rewriter.visit_expr(func)
    for gvar, func in list(mod.functions.items()):
        if _is_lpx_function(func):
            del mod[gvar]
    return mod, rewriter.count, state_where


def lpx_passes(target: Target | None = None):
    """Partition for lpx and lower the offloaded functions (run before the default build pipeline), for
    ``target`` (default: what the current TVM target carries, see :meth:`Target.tvm_target`)."""

    @tvm.transform.module_pass(opt_level=0, name="lpx.PartitionAndLower")
    def _passes(mod, _ctx):
        options = target if target is not None else Target.from_tvm(tvm.target.Target.current(allow_none=True)
                                                                      or tvm.target.Target("lpx"))
        if not _already_partitioned(mod):
            mod = partition_for_lpx(mod, options.chip, options.dtype)
        mod, count, _ = lower_lpx_calls(mod, options)
        if count == 0:
            warnings.warn("target lpx: no operator was offloaded to lpx; the whole module runs on the host",
                          NothingOffloadedWarning, stacklevel=2)
        return mod
    return _passes


def lpx_pipeline(target: Target | None = None, **words):
    """The ``"lpx"`` relax pipeline: lpx offload, then TVM's default build pipeline.

    Parameters
    ----------
    target : Target, optional
        What to compile for. Default: what the TVM target carries (``Target.tvm_target``), else ``tsp`` and fp32.
    **words
        Instead of ``target``: :meth:`Target.parse`'s words (``config``, ``dtype``, ``in_order``, ...).
    """
    if words:
        if target is not None:
            raise LpxUserError(f"target= says what to compile for; {', '.join(words)} would say it again")
        target = Target.parse(**words)
    passes = lpx_passes(target)
    base = relax.pipeline.default_build_pipeline()

    @tvm.transform.module_pass(opt_level=0, name="lpx.Pipeline")
    def _pipeline(mod, _ctx):
        return base(passes(mod))
    return _pipeline


def default_pipeline(**kwargs):
    """TVM's default pipeline, with lpx offload first when the current target has the ``lpx`` key."""
    base = relax.pipeline.default_build_pipeline(**kwargs)

    @tvm.transform.module_pass(opt_level=0, name="lpx.DefaultOrLpx")
    def _pipeline(mod, _ctx):
        target = tvm.target.Target.current(allow_none=True)
        if target is not None and "lpx" in target.keys:
            mod = lpx_passes(Target.from_tvm(target))(mod)
        return base(mod)
    return _pipeline
