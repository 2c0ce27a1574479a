"""Capacity planning: the search and its report, the model of a mapping and its graphs, verify, speculative decoding, prefill pools, and the GPU side (AIConfigurator, AFD, the modes)."""
