"""NVRTC and the kernel sources: the JIT, shared-memory arithmetic read from the
PTX, constants the headers and Python both state. No GPU needed."""
