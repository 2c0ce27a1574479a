"""Kernels TVM compiles for this CPU that the simulator runs its hot loops with (installed by
:mod:`lpx_tvm.registration`): few rows times an fp16 tile and depthwise sums (:mod:`.host`), a chain's
elementwise steps in one pass (:mod:`.fused`), IM2COL and max pooling in one call (:mod:`.window`). numpy's path
in :mod:`lpx_tvm.runtime_sim.semantics` stays the definition."""
