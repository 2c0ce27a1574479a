"""Write docs/ISA.md, the ISA reference, from the op table (tests/test_isa.py checks it is current)."""

from pathlib import Path

from lpx_tvm.runtime_sim.isa import isa_reference

path = Path(__file__).resolve().parents[1] / "docs" / "ISA.md"
path.write_text(isa_reference() + "\n")
print(f"wrote {path}")
