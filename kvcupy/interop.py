"""Arrays in and out: NumPy, or any DLPack producer (torch, JAX, CuPy), zero-copy.

The CPU backend works on NumPy views of the caller's host memory. Results go
back in the caller's framework. bfloat16 has no NumPy dtype, so it crosses
DLPack as int16 and is viewed as `ml_dtypes.bfloat16` on this side.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

DLPACK_CPU = 1   # kDLCPU in dlpack.h's DLDeviceType


def framework_of(x) -> str:
    if isinstance(x, np.ndarray):
        return "numpy"
    module = type(x).__module__.split(".")[0]
    return module if module in ("torch", "jax", "jaxlib", "cupy") else "dlpack"


def _is_torch_bfloat16(x) -> bool:
    return framework_of(x) == "torch" and str(x.dtype) == "torch.bfloat16"


def to_host(x, name: str) -> np.ndarray:
    """A NumPy view of a host array argument, or a TypeError/ValueError naming it."""
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, np.generic) or not hasattr(x, "__dlpack__"):
        raise TypeError(f"{name} must be an array (NumPy or a DLPack tensor), got {type(x).__name__}")
    device_type, device_id = x.__dlpack_device__()
    if int(device_type) != DLPACK_CPU:
        raise ValueError(
            f"{name} is on DLPack device {int(device_type)}:{device_id}; this build of kvcupy "
            "runs on the CPU backend only, so arrays must be in host memory")
    if _is_torch_bfloat16(x):
        import torch
        return np.from_dlpack(x.view(torch.int16)).view(ml_dtypes.bfloat16)
    if framework_of(x) in ("jax", "jaxlib"):
        return np.asarray(x)   # JAX arrays are immutable: a read-only view is all there is
    return np.from_dlpack(x)


def like(result: np.ndarray, reference):
    """`result` in the framework of `reference` (zero-copy where DLPack allows)."""
    framework = framework_of(reference)
    if framework == "torch":
        import torch
        if result.dtype == ml_dtypes.bfloat16:
            return torch.from_dlpack(result.view(np.int16)).view(torch.bfloat16)
        return torch.from_dlpack(result)
    if framework in ("jax", "jaxlib"):
        import jax.numpy as jnp
        return jnp.asarray(result)
    return result
