"""The LPX program format: a checked binary stream, and its disassembler.

Layout (little endian)::

    header   magic b"LPXPROG\\0", then the container header of :mod:`.container`
    body     config name, config digest, SRAM plan (model id, bytes, activation base), predicted cycles
             layer names | host inputs | host outputs | instructions | constants | streamed weights | state
             | host-converted inputs | widened outputs

Decoding verifies the header, the checksum, every opcode, every field range, every
operand shape and every SRAM address against the chip config before it returns;
anything wrong raises :class:`ProgramFormatError`. Nothing is ever unpickled or
evaluated.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from math import isinf, isnan

import numpy as np

from .config import ChipConfig, config_from_dict, load_config
from .columns import ProgramColumns
from .container import HEADER, opened, seal
from .held import held_bytes, held_rows
from .isa import (MAX_CYCLE, MAX_RANK, UNIT_OF, DType, HostTensor, Instruction, Opcode, Space, TensorRef, format_attrs,
                  pack_attrs, split_attrs)
from .rules import (MAX_DIM, MAX_OPERAND_BYTES, ProgramFormatError, _check_ref, _is_count, _validate_instruction,
                    _validate_outputs_covered)

MAGIC = b"LPXPROG\0"
SYSTEM_MAGIC = b"LPXSYS\0\0"  # a system program (system_sim): the same header, one program per chip inside
VERSION = 11  # 2: streamed weights; 3: attributes in op-table order; 4: streams, strided views; 5: SRAM plan;
# 6: resident state; 7: inputs the host converts, outputs it widens; 8: each constant's bytes start at a multiple
# of 64 from the program's first byte (zeros before them), so a simulator reads them where they lie; 9: a constant
# may be held by the host by name (.held) instead of carried; 10: so may a streamed weight, as rows a pitch apart;
# 11: the chip's parameters (so a program of a derived chip loads with no name to look it up by)
_KEYED_FROM = 9  # from format 9 the checksum covers the version field too (container.body_digest)
_ALIGN = 64
_PAD = object()  # in an encoding's parts: zeros up to the next multiple of _ALIGN
_INSTR = struct.Struct("<BBBBBBIQ")  # opcode unit unit_index n_src n_dst n_attr layer cycle
MAX_NAME = 4096


@dataclass(frozen=True)
class Constant:
    """Resident data (weights) placed in SRAM when the program is loaded."""

    ref: TensorRef
    data: np.ndarray  # its bytes in C order are the value: 1-D uint8 once decoded, any array when emitted
    # (weight set id, name, byte offset) where the host holds the bytes (see .held): encoded by name, no copy
    held: tuple = ()


@dataclass(frozen=True)
class StreamedWeight:
    """A weight kept in host memory and brought into SRAM by STREAM each time it is used."""

    host: HostTensor
    data: np.ndarray  # its bytes in C order are the value: uint8 once decoded, any array when emitted
    # (weight set id, name, byte offset, bytes from one row to the next) where the host holds the block (a
    # column block of a held [K, N] weight: rows apart, each row's bytes together); encoded by name, no copy
    held: tuple = ()


@dataclass(frozen=True)
class SramPlan:
    """One model's programs share a chip's SRAM: resident weights below ``activation_base``, each program's
    in its own range, and the activations above, reused by whichever program runs.

    ``model`` names the plan (8 bytes; empty for a program alone), ``sram_bytes`` is what all of them need.
    """

    model: bytes = b""
    sram_bytes: int = 0
    activation_base: int = 0


@dataclass(frozen=True)
class Program:
    """A statically scheduled LPX program.

    Parameters
    ----------
    config_name : str
        The chip preset it was compiled for.
    config_digest : bytes
        Fingerprint of that config; a program is rejected on any other chip.
    chip : ChipConfig, optional
        The chip itself: encoded with the program (its parameters, not its sources), so that a program of a
        design variant loads with nothing to look its name up in. Without it the name must be a preset's.
    instructions : tuple of Instruction
        In issue order.
    constants : tuple of Constant
    inputs, outputs : tuple of HostTensor
        The host-side signature: LOAD i reads input i, STORE j writes output j.
    layer_names : tuple of str
        Instruction ``layer`` indexes into these.
    predicted_cycles : int
        The makespan the compiler's scheduler computed.
    streamed : tuple of StreamedWeight
        Weights too big to stay resident; STREAM k copies streamed[k] into SRAM.
    plan : SramPlan
        Where this program sits among the other programs of its model on one chip.
    state : tuple of (int, TensorRef)
        Host inputs that stay resident in SRAM from call to call (a KV cache): input k lives at the ref, is
        zero at load, is never LOADed, and only the runtime writes it, between calls.
    host_converted : tuple of (int, float, int)
        ``(input index, scale, zero point)``: the caller passes this input in fp32 and the host converts it
        to the type that crosses the link, ``inputs[index]``: an int8/uint8 input by ONNX QuantizeLinear, an
        fp16/bf16 one by rounding to nearest (scale 1, zero point 0). The link carries the narrow bytes.
    widened_outputs : tuple of (int, float, int)
        ``(output index, scale, zero point)``: the chip stores this output narrow (``outputs[j]``) and the
        host widens it to fp32 for the caller: an fp16/bf16 one exactly (scale 1, zero point 0), an
        int8/uint8 one by ONNX DequantizeLinear. The link carries the narrow bytes.
    """

    config_name: str
    config_digest: bytes
    instructions: tuple
    constants: tuple = ()
    inputs: tuple = ()
    outputs: tuple = ()
    layer_names: tuple = ("program",)
    predicted_cycles: int = 0
    digest: bytes = field(default=b"", compare=False)
    streamed: tuple = ()
    plan: "SramPlan" = None
    state: tuple = ()
    host_converted: tuple = ()
    widened_outputs: tuple = ()
    chip: "ChipConfig | None" = field(default=None, compare=False)

    def __post_init__(self):
        if self.plan is None:
            object.__setattr__(self, "plan", SramPlan())
        for name, kind, words in (("config_name", str, "a str"), ("config_digest", bytes, "bytes"),
                                  ("plan", SramPlan, "a SramPlan")):
            if not isinstance(getattr(self, name), kind):
                raise TypeError(f"Program.{name} must be {words}, got {getattr(self, name)!r}")
        for name, is_part, part in _PARTS:
            items = getattr(self, name)
            bad = next((k for k, item in enumerate(items) if not is_part(item)), None) \
                if isinstance(items, (tuple, list)) else -1
            if bad is not None:
                got = repr(items) if bad < 0 else f"{items[bad]!r} at {bad}"
                raise TypeError(f"Program.{name} must be a tuple of {part}, got {got}")
            object.__setattr__(self, name, tuple(items))

    def encoded(self) -> np.ndarray:
        """The program as the runtime takes it (see :func:`encode_array`); a system program answers the same."""
        return encode_array(self)


def _is_conversion(entry) -> bool:
    return isinstance(entry, (tuple, list)) and len(entry) == 3


_PARTS = (  # what each of a Program's tuples holds: (field, test, in words)
    ("instructions", lambda x: isinstance(x, Instruction), "Instruction"),
    ("constants", lambda x: isinstance(x, Constant), "Constant"),
    ("inputs", lambda x: isinstance(x, HostTensor), "HostTensor"),
    ("outputs", lambda x: isinstance(x, HostTensor), "HostTensor"),
    ("layer_names", lambda x: isinstance(x, str), "str"),
    ("streamed", lambda x: isinstance(x, StreamedWeight), "StreamedWeight"),
    ("state", lambda x: isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[1], TensorRef),
     "(input index, TensorRef)"),
    ("host_converted", _is_conversion, "(input index, scale, zero point)"),
    ("widened_outputs", _is_conversion, "(output index, scale, zero point)"),
)


# ---------------------------------------------------------------------------
# encode
# ---------------------------------------------------------------------------
def _chip_parameters(chip) -> str:
    """A chip's parameters as JSON (its sources and description are for readers, not for the program)."""
    if chip is None:
        return ""
    return json.dumps({k: v for k, v in asdict(chip).items() if k not in ("sources", "description")},
                      sort_keys=True, default=dict)


def _chip_from_parameters(text: str, name: str, digest: bytes):
    """The chip a program's parameters describe, which must be the one its name and digest say."""
    try:
        chip = config_from_dict(json.loads(text))
    except (ValueError, TypeError) as err:
        raise ProgramFormatError(f"program's chip parameters are malformed: {err}") from None
    if chip.name != name or chip.digest != digest:
        raise ProgramFormatError(f"program's chip parameters describe {chip.name!r} (digest {chip.digest.hex()}), "
                                 f"not the {name!r} (digest {digest.hex()}) it names")
    if _chip_parameters(chip) != text:  # (the same values spelled otherwise: a program reads back as its bytes)
        raise ProgramFormatError("program's chip parameters are not written as the format writes them")
    return chip


def _pack_str(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<H", len(raw)) + raw


def _pack_dims(dtype: DType, shape) -> bytes:
    return struct.pack(f"<BB{len(shape)}I", int(dtype), len(shape), *shape)


def _pack_ref(ref: TensorRef) -> bytes:
    strides = () if ref.strides is None else tuple(ref.strides)
    return (struct.pack("<BQ", int(ref.space), ref.addr) + _pack_dims(ref.dtype, ref.shape)
            + struct.pack(f"<B{len(strides)}I", 1 if ref.strides is not None else 0, *strides))


def encode(program: Program) -> bytearray:
    """Serialize a program (see the module docstring for the layout)."""
    return _encode(program, bytearray)


def aligned_array(size: int) -> np.ndarray:
    """An uninitialised uint8 array whose data starts on a 64-byte boundary (as DLPack consumers want)."""
    raw = np.empty(size + 64, np.uint8)
    start = -raw.ctypes.data % 64
    return raw[start:start + size]


def aligned_copy(array: np.ndarray, dtype=None) -> np.ndarray:
    """``array`` (converted to ``dtype``) in a fresh 64-byte aligned buffer, which TVM binds without a copy."""
    dtype = np.dtype(array.dtype if dtype is None else dtype)
    owned = aligned_array(array.size * dtype.itemsize).view(dtype).reshape(array.shape)
    np.copyto(owned, array, casting="unsafe")
    return owned


def encode_array(program: Program) -> np.ndarray:
    """Serialize a program into a 64-byte aligned uint8 array (TVM takes it as a tensor without a copy)."""
    return _encode(program, aligned_array)


def _encode(program: Program, allocate):
    encoding = Encoding(program)
    blob = allocate(encoding.nbytes)
    encoding.write(memoryview(blob).cast("B"))
    return blob


class Encoding:
    """A program's bytes, laid out but not written: ``nbytes``, then :meth:`write` into a buffer of that size
    (a system program writes each chip's straight into its own buffer: weights are most of a program, and
    each copy of them costs their size)."""

    def __init__(self, program: Program):
        self.parts = _parts(program)
        self.sizes, at = [], HEADER.size
        for part in self.parts:
            self.sizes.append(-at % _ALIGN if part is _PAD else part.nbytes if isinstance(part, np.ndarray)
                              else len(part))
            at += self.sizes[-1]
        self.nbytes = at

    def write(self, view: memoryview) -> None:
        """Write the program into ``view`` (``nbytes`` bytes, starting 64-byte aligned) and seal it."""
        at = HEADER.size
        for part, size in zip(self.parts, self.sizes):
            if part is _PAD:
                view[at:at + size] = bytes(size)
            elif isinstance(part, np.ndarray):  # a weight, in any layout: its bytes in C order
                np.copyto(np.frombuffer(view[at:at + size], part.dtype).reshape(part.shape), part)
            else:
                view[at:at + size] = part
            at += size
        seal(view[:self.nbytes], MAGIC, VERSION, _KEYED_FROM)


def _parts(program: Program) -> list:
    plan = program.plan
    chip = [_pack_str(_chip_parameters(program.chip))] if VERSION >= 11 else []  # (a test writes older formats)
    parts = [_pack_str(program.config_name), program.config_digest, *chip,
             struct.pack("<8sQQ", plan.model.ljust(8, b"\0"), plan.sram_bytes, plan.activation_base),
             struct.pack("<QI", program.predicted_cycles, len(program.layer_names))]
    parts += [_pack_str(name[:MAX_NAME]) for name in program.layer_names]
    for group in (program.inputs, program.outputs):
        parts.append(struct.pack("<I", len(group)))
        parts += [_pack_dims(t.dtype, t.shape) for t in group]
    parts.append(struct.pack("<I", len(program.instructions)))
    for ins in program.instructions:
        attrs = pack_attrs(ins.opcode, ins.attrs)
        parts.append(_INSTR.pack(int(ins.opcode), int(ins.unit), ins.unit_index, len(ins.srcs), len(ins.dsts),
                                 len(attrs), ins.layer, ins.cycle))
        parts += [_pack_ref(r) for r in ins.srcs + ins.dsts]
        parts.append(struct.pack(f"<{len(attrs)}d", *attrs))
    parts.append(struct.pack("<I", len(program.constants)))
    for const in program.constants:
        parts.append(_pack_ref(const.ref))
        if const.held:
            set_id, name, offset = const.held
            parts.append(struct.pack("<B8s", 1, set_id) + _pack_str(name) + struct.pack("<Q", offset))
        else:
            parts += [b"\0"] if VERSION >= 9 else []  # (VERSION: a test writes an older format)
            parts += [_PAD, const.data]
    parts.append(struct.pack("<I", len(program.streamed)))
    for weight in program.streamed:
        parts.append(_pack_dims(weight.host.dtype, weight.host.shape))
        if weight.held:
            set_id, name, offset, pitch = weight.held
            parts.append(struct.pack("<B8s", 1, set_id) + _pack_str(name) + struct.pack("<QQ", offset, pitch))
        else:
            parts += [b"\0"] if VERSION >= 10 else []  # (VERSION: a test writes an older format)
            parts.append(weight.data)
    parts.append(struct.pack("<I", len(program.state)))
    for index, ref in program.state:
        parts.append(struct.pack("<I", index) + _pack_ref(ref))
    for conversions in (program.host_converted, program.widened_outputs):
        parts.append(struct.pack("<I", len(conversions)))
        parts += [struct.pack("<Idi", *entry) for entry in conversions]
    return parts


# ---------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------
_LAYOUTS = {}  # struct format -> its compiled Struct


class _Reader:
    """Bounds-checked cursor over the body; every read names what it read."""

    def __init__(self, buf: memoryview):
        self.buf = buf
        self.pos = 0

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise ProgramFormatError(f"program truncated while reading {what} at byte {self.pos}")
        view = self.buf[self.pos:self.pos + n]
        self.pos += n
        return view

    def unpack(self, fmt: str, what: str):
        layout = _LAYOUTS.get(fmt)
        if layout is None:  # (a few dozen formats: ranks are bounded)
            layout = _LAYOUTS[fmt] = struct.Struct("<" + fmt)
        end = self.pos + layout.size
        if end > len(self.buf):
            raise ProgramFormatError(f"program truncated while reading {what} at byte {self.pos}")
        values = layout.unpack_from(self.buf, self.pos)
        self.pos = end
        return values

    def count(self, what: str, min_record_bytes: int) -> int:
        (n,) = self.unpack("I", what)
        if n * min_record_bytes > len(self.buf) - self.pos:
            raise ProgramFormatError(f"{what} = {n} does not fit in the remaining {len(self.buf) - self.pos} bytes")
        return n

    def string(self, what: str) -> str:
        (n,) = self.unpack("H", what)
        try:
            return bytes(self.take(n, what)).decode()
        except UnicodeDecodeError:
            raise ProgramFormatError(f"{what} is not UTF-8") from None

    def dims(self, what: str) -> tuple:
        code, rank = self.unpack("BB", what)
        dtype = DType._value2member_map_.get(code)  # (a dict lookup: an enum call costs ten)
        if dtype is None:
            raise ProgramFormatError(f"{what}: unknown dtype code {code}")
        if rank > MAX_RANK:
            raise ProgramFormatError(f"{what}: rank {rank} exceeds {MAX_RANK}")
        shape = self.unpack(f"{rank}I", what)
        if any(d == 0 or d >= MAX_DIM for d in shape):
            raise ProgramFormatError(f"{what}: dimension out of range in {shape}")
        return dtype, shape

    def ref(self, what: str) -> TensorRef:
        code, addr = self.unpack("BQ", what)
        space = Space._value2member_map_.get(code)
        if space is None:
            raise ProgramFormatError(f"{what}: unknown operand space {code}")
        dtype, shape = self.dims(what)
        (has_strides,) = self.unpack("B", what)
        if has_strides > 1:
            raise ProgramFormatError(f"{what}: bad strides flag {has_strides}")
        strides = self.unpack(f"{len(shape)}I", what) if has_strides else None
        return TensorRef(addr, shape, dtype, strides, space)


def read_digest(blob) -> bytes:
    """The 16-byte body digest from a program header, checking only the magic."""
    head = bytes(memoryview(blob)[:HEADER.size])
    if len(head) < HEADER.size or head[:8] not in (MAGIC, SYSTEM_MAGIC):
        raise ProgramFormatError("not an LPX program (bad magic)")
    return head[-16:]


def decode(blob, config: ChipConfig | str | None = None) -> Program:
    """Parse and fully validate a program.

    Parameters
    ----------
    blob : bytes-like
        The encoded program.
    config : ChipConfig or str, optional
        The chip it will run on; by default the preset the program names.

    Raises
    ------
    ProgramFormatError
        On any malformed, corrupted, foreign or out-of-bounds content.
    """
    return decoded_columns(blob, config).program


def decoded_columns(blob, config: ChipConfig | str | None = None, verified: bool = False):
    """:func:`decode`, returning the program as :class:`.columns.ProgramColumns` (see :func:`validated_columns`);
    ``verified``: its checksum is not checked again (a system program's checksum covers its chips' bytes)."""
    version, body, digest = opened(blob, MAGIC, (7, 8, 9, 10, VERSION), "program", verified, _KEYED_FROM)
    try:
        program = _parse_body(_Reader(body), digest, version)
    except ProgramFormatError:
        raise
    except (ValueError, struct.error) as err:  # defensive: any parse slip is still a format error
        raise ProgramFormatError(f"malformed program: {err}") from None
    return validated_columns(program, config)


def _parse_body(r: _Reader, digest: bytes, version: int = VERSION) -> Program:
    config_name = r.string("config name")
    config_digest = bytes(r.take(8, "config digest"))
    parameters = r.string("chip parameters") if version >= 11 else ""
    chip = _chip_from_parameters(parameters, config_name, config_digest) if parameters else None
    model, plan_bytes, activation_base = r.unpack("8sQQ", "SRAM plan")
    plan = SramPlan(b"" if model == bytes(8) else model, plan_bytes, activation_base)
    predicted, n_layers = r.unpack("QI", "program header")
    if n_layers * 2 > len(r.buf) - r.pos:
        raise ProgramFormatError(f"layer count {n_layers} does not fit in the program")
    layers = tuple(r.string("layer name") for _ in range(n_layers))
    sigs = []
    for what in ("input count", "output count"):
        n = r.count(what, 2)
        sigs.append(tuple(HostTensor(s, d) for d, s in (r.dims(what) for _ in range(n))))
    n_instr = r.count("instruction count", _INSTR.size)
    instructions = []
    for index in range(n_instr):
        op, unit, unit_index, n_src, n_dst, n_attr, layer, cycle = r.unpack(_INSTR.format[1:], "instruction")
        where = f"instruction {index}"
        if op not in Opcode._value2member_map_:
            raise ProgramFormatError(f"{where}: unknown opcode {op}")
        op = Opcode(op)
        if unit != UNIT_OF[op]:
            raise ProgramFormatError(f"{where}: {op.name} runs on {UNIT_OF[op].name}, not unit {unit}")
        if layer >= max(n_layers, 1):
            raise ProgramFormatError(f"{where}: layer index {layer} out of range")
        refs = tuple(r.ref(f"{where} operand") for _ in range(n_src + n_dst))
        flat = r.unpack(f"{n_attr}d", f"{where} attributes")
        # CLIP's bounds (and an epilogue's) may be infinite; nothing may be NaN
        if any(isnan(a) or (isinf(a) and op not in _INFINITE_OK) for a in flat):
            raise ProgramFormatError(f"{where}: non-finite attribute")
        try:  # (the instruction checks its attributes' kinds as it is made)
            instructions.append(Instruction(op, unit_index, cycle, refs[:n_src], refs[n_src:],
                                            split_attrs(op, flat), layer))
        except ValueError as err:
            raise ProgramFormatError(f"{where}: {err}") from None
    n_const = r.count("constant count", 10)
    constants = []
    for _ in range(n_const):
        ref = r.ref("constant")
        (kind,) = r.unpack("B", "constant kind") if version >= 9 else (0,)
        if kind == 1:  # held by the host, by name
            (set_id,) = r.unpack("8s", "constant's weight set")
            name = r.string("constant's name")
            (offset,) = r.unpack("Q", "constant's offset")
            data = held_bytes(set_id, name, offset, ref.nbytes, f"constant {ref}")
            constants.append(Constant(ref, data, (set_id, name, offset)))
            continue
        if kind != 0:
            raise ProgramFormatError(f"constant {ref}: unknown kind {kind}")
        if version >= 8 and any(r.take(-(HEADER.size + r.pos) % _ALIGN, "constant padding")):
            raise ProgramFormatError("constant padding is not zeros")
        data = np.frombuffer(r.take(ref.nbytes, "constant data"), dtype=np.uint8)
        constants.append(Constant(ref, data))
    n_streamed = r.count("streamed weight count", 2)
    streamed = []
    for _ in range(n_streamed):
        dtype, shape = r.dims("streamed weight")
        host = HostTensor(shape, dtype)
        (kind,) = r.unpack("B", "streamed weight kind") if version >= 10 else (0,)
        if kind == 1:  # held by the host, by name: rows a pitch apart
            (set_id,) = r.unpack("8s", "streamed weight's weight set")
            name = r.string("streamed weight's name")
            offset, pitch = r.unpack("QQ", "streamed weight's offset and pitch")
            data = held_rows(set_id, name, offset, pitch, host, f"streamed weight {len(streamed)}")
            streamed.append(StreamedWeight(host, data, (set_id, name, offset, pitch)))
            continue
        if kind != 0:
            raise ProgramFormatError(f"streamed weight {len(streamed)}: unknown kind {kind}")
        streamed.append(StreamedWeight(host, np.frombuffer(r.take(host.nbytes, "streamed weight data"), np.uint8)))
    n_state = r.count("state count", 4)
    state = []
    for _ in range(n_state):
        (index,) = r.unpack("I", "state input index")
        state.append((index, r.ref("state")))
    converted, widened = (tuple(r.unpack("Idi", what) for _ in range(r.count(f"{what} count", 16)))
                          for what in ("host-converted input", "widened output"))
    if r.pos != len(r.buf):
        raise ProgramFormatError(f"{len(r.buf) - r.pos} trailing bytes after the widened outputs")
    return Program(config_name, config_digest, tuple(instructions), tuple(constants), sigs[0], sigs[1],
                   layers, predicted, digest, tuple(streamed), plan, tuple(state), converted, widened, chip)


def _check_conversion(what: str, dtype, scale, zero_point) -> None:
    """What the host converts between fp32 and a narrow type: rounding (fp16/bf16: scale 1, zero point 0)
    or (de)quantisation (int8/uint8: a positive scale, a zero point in the type's range)."""
    if dtype not in _NARROW:
        raise ProgramFormatError(f"{what} is {dtype.short}, not int8/uint8/fp16/bf16")
    if dtype in (DType.F16, DType.BF16):
        if (scale, zero_point) != (1.0, 0):
            raise ProgramFormatError(f"{what} is {dtype.short}: it is rounded, with scale 1 and zero point 0, "
                                     f"not {scale!r} and {zero_point!r}")
        return
    info = np.iinfo(dtype.np)
    if not (isinstance(scale, float) and scale > 0 and not isinf(scale)) or not info.min <= zero_point <= info.max:
        raise ProgramFormatError(f"{what}: scale {scale!r} must be a positive float and zero point "
                                 f"{zero_point!r} in [{info.min}, {info.max}]")


def validate(program: Program, config: ChipConfig | str | None = None) -> ChipConfig:
    """Check a program against a chip: config identity, units, shapes and SRAM bounds.

    Returns the chip config. Raises ProgramFormatError naming the first problem.
    """
    return validated_columns(program, config).chip


def validated_columns(program: Program, config: ChipConfig | str | None = None):
    """:func:`validate`, returning the program as :class:`.columns.ProgramColumns` (what checking and
    measuring it need next)."""
    try:
        chip = load_config(config) if config is not None else program.chip or load_config(program.config_name)
    except ValueError as err:
        raise ProgramFormatError(f"program names chip config {program.config_name!r}: {err}") from None
    if program.config_digest != chip.digest or program.config_name != chip.name:
        raise ProgramFormatError(
            f"program was compiled for chip config {program.config_name!r}, not for {chip.name!r} "
            f"(config digests {program.config_digest.hex()} vs {chip.digest.hex()})")
    for where, ref, data, nbytes in ([("constant", c.ref, c.data, c.ref.nbytes) for c in program.constants]
                                     + [("streamed weight", w.host, w.data, w.host.nbytes) for w in program.streamed]):
        if not isinstance(data, np.ndarray) or data.nbytes != nbytes:
            got = f"{data.nbytes} bytes" if isinstance(data, np.ndarray) else f"a {type(data).__name__}"
            raise ProgramFormatError(f"{where} {ref}: its data must be an array of its {nbytes} bytes, got {got}")
    for const in program.constants:
        _check_ref(const.ref, chip, "constant")
        if program.plan.activation_base and const.ref.end > program.plan.activation_base:
            raise ProgramFormatError(f"constant {const.ref} lies above the plan's activation base "
                                     f"{program.plan.activation_base}")
    for index, ref in program.state:
        _check_ref(ref, chip, "state")
        # the chip may keep it in its storage type (fp16 for an fp32 input): the shape must match
        if not _is_count(index) or index >= len(program.inputs) or tuple(ref.shape) != tuple(program.inputs[index].shape):
            raise ProgramFormatError(f"state {ref} does not match input {index} of the program's signature")
    resident = dict(program.state)
    for what, conversions, group in (("host-converted input", program.host_converted, program.inputs),
                                     ("widened output", program.widened_outputs, program.outputs)):
        for index, scale, zero_point in conversions:
            if not _is_count(index) or index >= len(group) or (group is program.inputs and index in resident):
                raise ProgramFormatError(f"{what} {index} is not an {what.split()[-1]} of the program")
            _check_conversion(f"{what} {index}", group[index].dtype, scale, zero_point)
    if not (_is_count(program.plan.sram_bytes) and _is_count(program.plan.activation_base)):
        raise ProgramFormatError(f"SRAM plan {program.plan} needs non-negative integer sizes")
    if program.plan.sram_bytes > chip.sram_bytes or program.plan.activation_base > chip.sram_bytes:
        raise ProgramFormatError(f"SRAM plan of {program.plan.sram_bytes} bytes exceeds the chip's {chip.sram_bytes}")
    if not _is_count(program.predicted_cycles):
        raise ProgramFormatError(f"predicted cycles {program.predicted_cycles!r} is not a non-negative integer")
    columns = ProgramColumns(program, chip)
    if columns.has_instruction_errors():
        for index, ins in enumerate(program.instructions):  # one by one, to name the first
            _validate_instruction(index, ins, program, chip)
        if columns.malformed:  # defensive: such a value always breaks a rule above
            raise ProgramFormatError("an operand's size or shape is not a non-negative integer in range")
    _validate_outputs_covered(program)
    columns.time_kinds()
    for kind, occ in enumerate(columns.kind_occupancy):  # kinds come in order of their first instruction
        if occ.busy + occ.latency >= MAX_CYCLE or max(occ.flops, occ.macs, occ.sram_bytes) >= MAX_OPERAND_BYTES:
            index = columns.first[kind]
            raise ProgramFormatError(f"instruction {index} ({program.instructions[index].opcode.name}): runs "
                                     f"{occ.busy + occ.latency} cycles for {occ.flops} operations and "
                                     f"{occ.sram_bytes} bytes, past 2^48")
    return columns


_NARROW = (DType.I8, DType.U8, DType.F16, DType.BF16)  # what a host-converted input may cross the link as
_INFINITE_OK = frozenset({Opcode.CLIP, Opcode.MATMUL, Opcode.DWCONV})


# ---------------------------------------------------------------------------
# disassembler
# ---------------------------------------------------------------------------
def format_instruction(index: int, ins: Instruction, layer_names=()) -> str:
    """One readable line for one instruction."""
    attrs = format_attrs(ins.opcode, ins.attrs)
    srcs = " ".join(str(r) for r in ins.srcs) or "-"
    dsts = " ".join(str(r) for r in ins.dsts) or "-"
    layer = layer_names[ins.layer] if ins.layer < len(layer_names) else ins.layer
    return (f"{index:6d} @{ins.cycle:<10d} {ins.unit.name}{ins.unit_index:<2d} {ins.opcode.name:<12s}"
            f"{dsts} <- {srcs}" + (f"  {attrs}" if attrs else "") + f"  ; {layer}")


def disassemble(program: Program) -> str:
    """The whole program, one line per instruction after a short header."""
    head = [f"; lpx program for chip {program.config_name!r}, {len(program.instructions)} instructions, "
            f"{len(program.constants)} constants ({sum(c.ref.nbytes for c in program.constants)} bytes), "
            f"{len(program.streamed)} streamed weights ({sum(w.host.nbytes for w in program.streamed)} bytes), "
            f"predicted {program.predicted_cycles} cycles",
            "; inputs:  " + ", ".join(f"{t.dtype.short}{list(t.shape)}" for t in program.inputs),
            "; outputs: " + ", ".join(f"{t.dtype.short}{list(t.shape)}" for t in program.outputs),
            "; operands: fp16[32x320]@0x2000 is a tensor in SRAM at that byte address (/a,b: its strides in "
            "elements, a strided view); @S3 is stream 3, a result chained from one unit to the next without SRAM"]
    head += [f"; input {index} is quantised on the host (scale {scale:g}, zero point {zero_point}): the link "
             f"carries {program.inputs[index].dtype.short}" for index, scale, zero_point in program.host_converted
             if program.inputs[index].dtype in (DType.I8, DType.U8)]
    head += [f"; input {index} is rounded to {program.inputs[index].dtype.short} on the host" for index, _, _
             in program.host_converted if program.inputs[index].dtype in (DType.F16, DType.BF16)]
    head += [f"; output {index} is stored in {program.outputs[index].dtype.short} and widened to fp32 on the host"
             for index, _, _ in program.widened_outputs]
    body = [format_instruction(i, ins, program.layer_names) for i, ins in enumerate(program.instructions)]
    return "\n".join(head + body)


