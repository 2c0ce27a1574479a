"""The application on top of the lpx_tvm library: the ``lpx-tvm`` command, the model zoo and its model
builders, and the benchmarks. The library never imports this package."""
