"""``lpx_tvm.compile``: from an ONNX file (or Relax module) to something callable on numpy arrays."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping

import numpy as np
import tvm
from tvm import relax
from tvm.ir.prim.expr import IntImm

from .codegen import Target, SystemCompileError
from .codegen.alloc import held_weights_first
from .diagnostics import native_output_to_log
from .frontend import FrontendError, from_onnx
from .patterns import partition_for_lpx
from .pipeline import lower_lpx_calls, lpx_functions
from .report import ModelStats, OffloadReport, model_stats, offload_report
from .runtime import load_program, program_key, release
from .runtime_sim.errors import LpxUserError
from .runtime_sim.held import HeldWeights
from .runtime_sim.simulator import CallError
from .runtime_sim.system_sim import axis_slice


class CompiledModel:
    """A compiled model: call it with numpy arrays, read its offload report and LPX programs.

    Parameters
    ----------
    executable : tvm.relax.Executable
    report : OffloadReport
    programs : dict
        Offloaded function name -> encoded LPX program (the executable's own copy of it: reading one gives
        its bytes).
    params : list of relax.Var
        The model's inputs.
    input_names : list of str, optional
        Their names as the model gives them (an ONNX file's, before the importer made them identifiers).
    dtype : str
        The storage type on lpx the programs were compiled for.
    state_where : dict, optional
        Resident state input name ─► the (program, argument) pairs that hold it.
    held : HeldWeights, optional
        The caller's weights its programs name instead of carrying.
    lowered : tvm.IRModule, optional
        The module the executable was built from; :meth:`export_library` builds it again (without it, the
        model cannot be exported).
    """

    def __init__(self, executable, report: OffloadReport, programs: dict, params, dtype: str = "fp32",
                 input_names=None, state_where=None, held=None, lowered=None):
        self.executable = executable
        self.lowered = lowered  # the module the executable was built from (export builds it again, see library)
        self.held = held  # the caller's weights its programs name instead of copying (kept alive with them)
        self.held_bytes = 0  # how many bytes of them its programs name
        self.state_where = state_where or {}
        self.dtype = dtype
        self.report = report
        self._programs = programs  # name -> uint8 array, shared with the executable's constants
        self.programs = _ProgramBytes(programs)
        self._local = threading.local()
        # the loaded simulators (and their SRAM image) go when the model does
        weakref.finalize(self, release, [program_key(blob) for blob in programs.values()])
        # a symbolic dimension (dynamic shape left unpinned) is None: any size is accepted there
        names = [str(p.name) for p in params] if input_names is None else list(input_names)
        self.input_signature = [(name, tuple(_static_dim(d) for d in p.ty.shape.values), str(p.ty.dtype))
                                for name, p in zip(names, params)]

    @property
    def vm(self) -> relax.VirtualMachine:
        """This thread's VM over the shared executable (a VM's frames are not thread-safe)."""
        vm = getattr(self._local, "vm", None)
        if vm is None:
            vm = self._local.vm = relax.VirtualMachine(_runnable(self.executable), tvm.cpu())
        return vm

    @property
    def simulators(self) -> dict:
        """Offloaded function name -> loaded (verified) simulator of its program."""
        return {name: load_program(blob) for name, blob in self._programs.items()}

    @property
    def stats(self) -> ModelStats:
        """The model's figures on lpx: cycles and µs of its programs one after another, useful-MAC and unit
        utilisation over every chip, and each program's chips (:class:`~lpx_tvm.report.ModelStats`)."""
        return model_stats(self.simulators)

    def _state_parts(self, name: str) -> list:
        """``(view, cut, full shape)`` for every resident copy of state input ``name``: ``cut`` is ``(axis, lo,
        hi)`` where a chip holds only that slice of it (tensor parallel: its heads of a KV cache), else None."""
        parts = []
        for symbol, arg in self.state_where.get(name, ()):
            sim = load_program(self._programs[symbol])
            full = sim.inputs[arg].shape
            chip_sims = dict(sim.chips)
            for chip, index, *cut in sim.destinations(arg):  # the chips whose programs take that argument
                parts.append((chip_sims[chip].state_view(index), cut or None, full))
        if not parts:
            raise KeyError(f"{name!r} is not a resident state input (compile with state=[...])")
        return parts

    def state_views(self, name: str) -> list:
        """Every resident copy (one per chip that reads it) of state input ``name``, as writable arrays; a chip
        that holds a slice of it (see :meth:`write_state`) gives its slice."""
        return [view for view, _, _ in self._state_parts(name)]

    def write_state(self, name: str, value, index=...) -> int:
        """Write ``value`` into ``state[name][index]`` on every chip that holds it (a chip holding a slice gets
        its part); returns the bytes each chip's host link carries: the most any chip's share of the state
        takes in the type it is stored in (what the write costs: the chips' links work side by side)."""
        value = np.asarray(value)
        carried = 0
        for view, cut, full in self._state_parts(name):
            part = value if cut is None else _state_slice(value, index, cut, full, name)
            view[index] = part
            carried = max(carried, int(view[index].nbytes))
        return carried

    def _check(self, inputs) -> list:
        sig = self.input_signature
        if len(inputs) != len(sig):
            raise CallError(f"model takes {len(sig)} inputs ({', '.join(n for n, _, _ in sig)}), got {len(inputs)}")
        arrays = []
        for value, (name, shape, dtype) in zip(inputs, sig):
            arr = np.asarray(value)
            shape_ok = arr.ndim == len(shape) and all(want in (None, got) for want, got in zip(shape, arr.shape))
            if not shape_ok or arr.dtype != np.dtype(dtype):
                wanted = ", ".join("?" if d is None else str(d) for d in shape)
                raise CallError(f"input {name!r}: expected {dtype}[{wanted}], got {arr.dtype}{list(arr.shape)}")
            arrays.append(np.ascontiguousarray(arr))
        return arrays

    def __call__(self, *inputs, **named) -> list:
        """Run the model. Inputs by position or by name; returns a list of numpy arrays."""
        if named:
            missing = [n for n, _, _ in self.input_signature if n not in named]
            if inputs or missing:
                raise CallError(f"pass inputs either by position or all by name; missing {missing}")
            inputs = [named[n] for n, _, _ in self.input_signature]
        arrays = self._check(inputs)
        result = self.vm["main"](*[tvm.runtime.tensor(a) for a in arrays])
        return _to_numpy(result)

    def export_library(self, path) -> None:
        """Write a shared library that ``tvm.runtime.load_module`` reloads (import lpx_tvm first).

        Its large constants (programs and host weights) lie in a section of their own, which the library maps
        when it is loaded (:mod:`lpx_tvm.library`): the export copies no weight in memory."""
        if self.held is not None:
            raise LpxUserError("this model's programs read the weights passed to compile(weights=...) where they "
                               "are, by name (hold_weights=True), so a library could not carry them: compile it "
                               "without hold_weights to export it")
        if self.lowered is None:
            raise LpxUserError("this model was built without the module it came from, so it cannot be exported")
        from .library import write_library

        write_library(self.lowered, path)


def _state_slice(value: np.ndarray, index, cut, full: tuple, name: str) -> np.ndarray:
    """The part of ``value`` (written to ``state[index]``) that falls in a chip's slice ``[lo, hi)`` along
    ``axis``: every axis up to the sliced one must be indexed whole."""
    axis, lo, hi = cut
    index = () if index is Ellipsis else index if isinstance(index, tuple) else (index,)
    if any(not isinstance(i, slice) or i != slice(None) for i in index[:axis + 1]):
        raise CallError(f"state {name!r} is split over chips along axis {axis}: write it with an index that "
                        f"takes axes 0..{axis} whole, got {index!r}")
    indexed = np.broadcast_to(np.zeros((), value.dtype), full)[index].shape  # the shape ``index`` selects
    return np.broadcast_to(value, indexed)[axis_slice(axis, lo, hi)]


class _ProgramBytes(Mapping):
    """A compiled model's programs as bytes, read from the arrays the executable shares (copied on access)."""

    def __init__(self, arrays: dict):
        self._arrays = arrays

    def __getitem__(self, name):
        return bytes(memoryview(self._arrays[name]))

    def write(self, name, path) -> None:
        """Write program ``name``'s bytes to ``path`` from where the executable holds them (no copy: a program is
        mostly weights)."""
        with open(path, "wb") as out:
            out.write(memoryview(self._arrays[name]))

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self):
        return len(self._arrays)


def _runnable(executable):
    """The executable's module, run in place when nothing in it needs compiling.

    ``Executable.jit`` exports and reloads the library whenever the import tree holds C source, even the
    empty placeholder (``;``) that a model with no host kernels gets: that round trip copies every
    constant, and a program's constant is mostly weights.
    """
    pending = executable.mod._collect_from_import_tree(lambda m: m.kind in ("c", "static_library"))
    if all(m.kind == "c" and m.inspect_source().strip() in ("", ";") for m in pending):
        return executable.mod
    return executable


def _has_quantize(mod) -> bool:
    found = []
    for _, func in mod.functions.items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, lambda e: found.append(e) if isinstance(e, relax.Call)
                                            and isinstance(e.op, tvm.ir.Op) and e.op.name == "relax.quantize"
                                            else None)
    return bool(found)


def _static_dim(dim):
    return int(dim) if isinstance(dim, IntImm) else None


def _to_numpy(result) -> list:
    if hasattr(result, "numpy"):
        return [result.numpy()]
    return [x for item in result for x in _to_numpy(item)]


def compile(model, config: str | None = None, input_shapes: dict | None = None, in_order: bool = False,
            dump_dir: str | None = None, dtype: str = "fp32", system: str | None = None,
            parallel: str = "pipeline", chips: int | None = None, state=(), example_inputs=None,
            weights: dict | None = None, hold_weights=False, target: Target | None = None) -> CompiledModel:
    """Compile an ONNX model (or a Relax module, or a PyTorch module) for lpx with host fallback.

    Parameters
    ----------
    model : str, Path, bytes, onnx.ModelProto, tvm.IRModule or torch.nn.Module
    config : str or ChipConfig, optional
        Chip preset (``"tsp"``, the default, ``"lp30"`` or ``"tiny"``), path to a JSON preset, or a config (a
        design variant from ``lpx_tvm.runtime_sim.derive_config``, say). With ``system``: that system's chip.
    input_shapes : dict, optional
        ``{input name: dims}`` to pin dynamic input shapes.
    in_order : bool
        Use the in-order reference schedule.
    dump_dir : str, optional
        Write every codegen stage's result there.
    dtype : str
        Storage type on lpx: ``"fp32"`` (default), ``"fp16"`` or ``"bf16"`` (fp32 accumulation), ``"fp8"``
        (on a chip that runs it: lp30), or ``"int8"`` for a QDQ-quantised model (see ``lpx_tvm.quantize``).
        The host part keeps the model's own dtype.
    system : str, optional
        Run on a system of chips: a preset (``"tsp-node"``, ``"tiny-4"``, ...) or a JSON system file.
    parallel : str
        With ``system``: ``"pipeline"`` (consecutive layers on consecutive chips), ``"tensor"`` (every
        product's columns split over the chips, all-gathered), ``"expert"`` (a mixture's experts spread) or
        ``"auto"``.
    chips : int, optional
        With ``system``: use this many of its chips (default: a pipeline takes as many as shorten its longest
        stage, tensor parallel all of them).
    state : sequence of str
        Model inputs that stay resident on the chips from call to call (a decoder's ``past_key_values.*``):
        never sent by the host; :meth:`CompiledModel.write_state` updates them between calls.
    example_inputs : torch.Tensor or tuple of torch.Tensor, optional
        For a PyTorch module: the inputs it is exported on (:func:`lpx_tvm.from_pytorch`).
    weights : dict, optional
        ``{initializer name: array}`` for an ONNX model that holds its weights as external data not loaded
        (``lpx_tvm.app.models.llama`` builds a decoder's two graphs so): bound in place, never copied
        (:func:`lpx_tvm.frontend.from_onnx`).
    hold_weights : bool or HeldWeights
        With ``weights``: the programs name each weight that lies in those arrays (stored as the very bytes)
        and read it there, instead of carrying a copy; the caller's arrays then are the only copy in the host
        (:mod:`lpx_tvm.runtime_sim.held`). They must not change while the model lives, and the model cannot be
        exported. Another model's ``held`` (compiled over the same arrays): this one keeps each weight on the
        chip, and at the SRAM address, where that one placed it (a decoder's decode program over its prefill
        program's resident weights).

    target : lpx_tvm.codegen.Target, optional
        What to compile for, parsed already (``Target.parse``): instead of ``config``, ``system``, ``dtype``,
        ``parallel``, ``chips``, ``in_order`` and ``dump_dir``.

    Returns
    -------
    CompiledModel
    """
    if target is not None:
        given = {name: value for name, value, default in (
            ("config", config, None), ("in_order", in_order, False), ("dump_dir", dump_dir, None),
            ("dtype", dtype, "fp32"), ("system", system, None), ("parallel", parallel, "pipeline"),
            ("chips", chips, None)) if value != default}
        if given:
            raise LpxUserError(f"target= says what to compile for; {', '.join(given)} would say it again")
        if not isinstance(target, Target):
            raise LpxUserError(f"target must be an lpx_tvm.codegen.Target (Target.parse(...)), got {target!r}")
    else:
        target = Target.parse(config, system, dtype, parallel, chips, in_order, dump_dir)
    target.check_compilable()
    dtype, system, parallel = target.dtype, target.system, target.parallel
    held = _held(hold_weights, weights)
    if isinstance(state, (str, bytes)):  # (a name alone would be taken letter by letter)
        raise LpxUserError(f"state must be a sequence of input names, got {state!r}")
    from .pytorch import from_pytorch, is_torch_module

    if is_torch_module(model):
        if example_inputs is None:
            raise LpxUserError("a PyTorch module compiles on example inputs: compile(module, example_inputs=(x,))")
        model = from_pytorch(model, example_inputs)
    elif example_inputs is not None:
        raise LpxUserError("example_inputs are for a PyTorch module; an ONNX model's inputs are in its graph "
                           "(input_shapes pins a dynamic one)")
    why_not = None  # why a mixture as exported could not be rewritten for its experts to spread
    if system is not None and parallel in ("expert", "auto") and not isinstance(model, tvm.IRModule):
        model, why_not = _experts_spread(model, input_shapes)
    mod = _imported(model, target, input_shapes, weights)
    params = list(mod["main"].params)
    input_names = (mod["main"].attrs or {}).get("onnx_input_names")
    input_names = [str(n) for n in input_names] if input_names is not None else None
    advice = (mod["main"].attrs or {}).get("onnx_pin_advice")
    with native_output_to_log("TVM"):
        partitioned = partition_for_lpx(mod, target.chip, dtype)
        del mod  # once lowering drops the lpx functions, their weights live only in the programs
        report = offload_report(partitioned)
        if advice and not report.lpx_functions:  # that is why nothing runs on lpx: say so, not a host-only model
            raise FrontendError(f"nothing can run on lpx until the shapes are pinned: {advice} (or "
                                "input_shapes={name: dims} in Python)")
        programs = {}
        named = held.named if held is not None else 0
        with held_weights_first(held):
            try:
                lowered, _, state_where = lower_lpx_calls(partitioned, target, programs_out=programs,
                                                          state=tuple(state), held=held)
            except SystemCompileError as err:
                if why_not is None:
                    raise
                raise SystemCompileError(f"{err}; the rewrite was tried and {why_not}") from None
        executable = tvm.compile(lowered, target="lpx", relax_pipeline=relax.pipeline.default_build_pipeline())
    held = held if held is not None and held.named > named else None  # (none lies in the arrays: none held)
    model = CompiledModel(executable, report, programs, params, dtype, input_names, state_where, held, lowered)
    model.held_bytes = held.named - named if held is not None else 0
    return model


def _experts_spread(model, input_shapes) -> tuple:
    """``(model, None)`` with a mixture of experts whose router's top-k runs on the host rewritten so that its
    experts can spread (:func:`.expert_forms.dense_experts`); ``(model, why not)`` as it came where it cannot
    be, or ``(model, None)`` where it has no top-k."""
    from .expert_forms import dense_experts
    from .frontend import load_onnx, prepare_onnx

    # (a file is first read without its weights: most models have no top-k, and are imported once, after this)
    if not any(node.op_type == "TopK" for node in load_onnx(model, external_data=False).graph.node):
        return model, None
    try:
        return dense_experts(prepare_onnx(load_onnx(model), input_shapes)), None
    except ValueError as err:
        return model, str(err)


def _held(hold_weights, weights):
    """The :class:`HeldWeights` a compile names its weights in (see :func:`compile`), or None."""
    if hold_weights is False or hold_weights is None:
        return None
    if not weights:
        raise LpxUserError("hold_weights holds the arrays passed as weights=...; none were given")
    if hold_weights is True:
        return HeldWeights(weights)
    if not isinstance(hold_weights, HeldWeights):
        raise LpxUserError(f"hold_weights must be True, False or another model's held weights (its .held), "
                           f"got {hold_weights!r}")
    for name, held in hold_weights.given().items():
        given = weights.get(name)
        if not (isinstance(given, np.ndarray) and given.nbytes == held.nbytes
                and given.ctypes.data == held.ctypes.data):
            raise LpxUserError(f"hold_weights: the other model holds {name!r}, and weights[{name!r}] is not that "
                               "array: both models must be compiled over the same arrays")
    return hold_weights


def compile_programs(model, config: str | None = "tsp", input_shapes: dict | None = None,
                     dtype: str = "fp32", weights: dict | None = None) -> tuple:
    """A model's LPX programs, without building its host part: what a design sweep or a planner measures.

    Parameters are those of :func:`compile`.

    Returns
    -------
    (dict, OffloadReport)
        Offloaded function name ─► :class:`~lpx_tvm.runtime_sim.Program`, and what was offloaded.
    """
    from .codegen import compile_model

    options, functions, report = _lpx_functions(model, config, input_shapes, dtype, weights)
    with native_output_to_log("TVM"):
        return compile_model(functions, options), report


def compile_stream(model, copies: int, config: str | None = "tsp", input_shapes: dict | None = None,
                   dtype: str = "fp32"):
    """A model that runs as one lpx program, compiled as ``copies`` back-to-back inferences in one static
    schedule (:mod:`lpx_tvm.codegen.stream`): each next input's transfer overlaps the current compute.

    Returns
    -------
    Program
        ``copies`` inputs and outputs per model input and output, over one copy of the weights.
    """
    from .codegen.stream import stream_program

    options, functions, report = _lpx_functions(model, config, input_shapes, dtype)
    if len(functions) != 1 or report.host_ops:
        raise LpxUserError(f"a stream needs a model that runs as one lpx program with nothing on the host; this "
                           f"one has {len(functions)} lpx programs and host ops {dict(report.host_ops) or 'none'}")
    (function,) = functions.values()
    with native_output_to_log("TVM"):
        return stream_program(function, options, copies)


def _lpx_functions(model, config, input_shapes, dtype, weights=None) -> tuple:
    """(options, the partitioned model's lpx functions by symbol, the offload report), on one chip."""
    options = Target.parse(config, dtype=dtype)
    mod = _imported(model, options, input_shapes, weights)
    with native_output_to_log("TVM"):
        partitioned = partition_for_lpx(mod, options.chip, dtype)
    return options, lpx_functions(partitioned), offload_report(partitioned)


def _imported(model, target: Target, input_shapes, weights=None):
    """The Relax module of ``model`` (imported where it is a file or an ONNX model), checked against the
    target's dtype."""
    mod = model if isinstance(model, tvm.IRModule) else from_onnx(model, input_shapes, weights)
    if target.dtype == "int8" and not _has_quantize(mod):
        raise LpxUserError("dtype='int8' needs a QDQ-quantised model (QuantizeLinear/DequantizeLinear around its "
                           "conv/matmul); make one with `lpx-tvm quantize MODEL.onnx -o MODEL_int8.onnx` or "
                           "lpx_tvm.quantize(model, calibration_inputs)")
    return mod
