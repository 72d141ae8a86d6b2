"""Process-wide settings the tests need before any framework touches a GPU."""

import os

# JAX's GPU client takes 75% of the device's memory when it starts, whichever
# test first touches JAX; the CuPy and torch tests of the same run need theirs.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
