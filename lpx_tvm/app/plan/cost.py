"""A silicon-cost proxy for chip variants: die area from SRAM bytes, MACs, vector ALUs and links.

No die-area breakdown of the tensor streaming processor is public. What is: the
die is 25 × 29 mm = 725 mm² in 14 nm (Abts et al., "Think Fast: A Tensor
Streaming Processor", ISCA 2020, abstract) with 220 MiB of SRAM, 4 × 320 × 320
MACs, 5,120 vector ALUs and 16 chip-to-chip links. The split below is ASSUMED,
estimated from the die photo's floorplan (ISCA 2020 Fig. 5) and 14 nm densities:
SRAM 40 %, matrix units 27 %, vector units 5 %, switch units, stream registers
and control 15 %, I/O and chip-to-chip 9 %, the rest (4 %) fixed. Each block
is charged per unit of what it holds, so a variant's area scales with it. The
figures are good for ranking variants against each other, not as an area
estimate of a real design (±10 percentage points per block).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...codegen.target import chip_of
from ...runtime_sim import ChipConfig

TSP_DIE_MM2 = 725.0  # ISCA 2020: 25 × 29 mm
_SHARES = {"sram": 0.40, "mxm": 0.27, "vxm": 0.05, "switch_and_control": 0.15, "io": 0.09, "other": 0.04}


def _units(chip: ChipConfig) -> dict:
    """What each block holds: MiB of SRAM, MACs, vector ALUs, lanes (switch, streams, control), links."""
    return {"sram": chip.sram_bytes / 2**20, "mxm": chip.mxm_planes * chip.mxm_rows * chip.mxm_cols,
            "vxm": chip.vxm_alus, "switch_and_control": chip.lanes, "io": chip.c2c_links, "other": 1}


@dataclass(frozen=True)
class AreaModel:
    """mm² per unit of each block (:func:`_units`), derived once from the tsp preset and the assumed shares."""

    mm2_per_unit: dict

    @classmethod
    def from_tsp(cls) -> "AreaModel":
        tsp = _units(chip_of("tsp"))
        return cls({block: share * TSP_DIE_MM2 / tsp[block] for block, share in _SHARES.items()})

    def breakdown(self, chip: ChipConfig) -> dict:
        """mm² of each block of ``chip``."""
        units = _units(chip)
        return {block: rate * units[block] for block, rate in self.mm2_per_unit.items()}

    def area_mm2(self, chip: ChipConfig) -> float:
        """The cost proxy: the chip's die area under the assumed split (the tsp preset gives 725 mm²)."""
        return sum(self.breakdown(chip).values())


def pareto_front(points, cost_key: str, value_key: str) -> list:
    """Indexes of the points no other point beats on both (lower cost and lower value; ties kept once).

    Parameters
    ----------
    points : sequence of dict
    cost_key, value_key : str
        Both are minimised (use a latency, not a throughput, as the value).
    """
    ranked = sorted((p[cost_key], p[value_key], k) for k, p in enumerate(points)
                    if p.get(cost_key) is not None and p.get(value_key) is not None)
    front, best = [], float("inf")
    for cost, value, k in ranked:
        if value < best:
            front.append(k)
            best = value
    return front
