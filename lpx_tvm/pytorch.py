"""``lpx_tvm.from_pytorch``: a PyTorch module ─► a Relax module, by ``torch.export`` and TVM's ExportedProgram
importer. The module that comes out compiles like an imported ONNX model (``lpx_tvm.compile``)."""

from __future__ import annotations

from .runtime_sim.errors import LpxUserError


def _torch():
    try:
        import torch
    except ImportError:
        raise ImportError("from_pytorch needs PyTorch: pip install 'lpx-tvm[torch]'") from None
    return torch


def is_torch_module(model) -> bool:
    """Whether ``model`` is a ``torch.nn.Module`` (without importing torch where it is not loaded)."""
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(model, torch.nn.Module)


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def from_pytorch(module, example_inputs):
    """Import ``module`` as it runs on ``example_inputs``: their shapes and dtypes are the model's.

    Parameters
    ----------
    module : torch.nn.Module
        Exported in eval mode, without gradients (the caller's module is put back in the mode it was in).
    example_inputs : torch.Tensor or tuple of torch.Tensor
        The forward's positional arguments.

    Returns
    -------
    tvm.IRModule
        ``main`` takes the inputs in order (named as ``torch.export`` names them) and returns the forward's
        outputs; the weights are constants.

    Raises
    ------
    ValueError
        ``module`` is not a torch module, an example input is not a tensor, or ``torch.export`` (or TVM's
        importer) cannot take the module: the message is theirs, first line, with the op it names.
    """
    torch = _torch()
    from tvm.relax.frontend.torch import from_exported_program

    if not isinstance(module, torch.nn.Module):
        raise LpxUserError(f"from_pytorch takes a torch.nn.Module, got {type(module).__name__}")
    inputs = example_inputs if isinstance(example_inputs, tuple) else (
        tuple(example_inputs) if isinstance(example_inputs, list) else (example_inputs,))
    for k, value in enumerate(inputs):
        if not isinstance(value, torch.Tensor):
            raise LpxUserError(f"from_pytorch: example input {k} is a {type(value).__name__}, not a torch.Tensor")
    training = module.training
    module.train(False)  # eval mode
    try:
        with torch.no_grad():
            try:
                exported = torch.export.export(module, inputs)
            except Exception as err:  # torch.export raises many kinds; the first line says what it met
                raise LpxUserError(f"torch.export cannot export {type(module).__name__}: {_first_line(err)}") from None
            try:
                return from_exported_program(exported, keep_params_as_input=False)
            except Exception as err:
                raise LpxUserError(f"TVM's ExportedProgram importer cannot take {type(module).__name__}: "
                                   f"{_first_line(err)}") from None
    finally:
        module.train(training)
