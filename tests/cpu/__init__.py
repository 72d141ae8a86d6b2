"""The library on the CPU: the oracle, the CPU backend, the cache manager, formats,
rotation, interop and errors, and the CUDA planner and launch glue on the host."""
