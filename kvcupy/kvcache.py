"""KVCache: the six tensors of docs/format.md plus what wrote them (KV dtype, rotation)."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .rotation import RotationPlan


class _Geometry:
    """Sizes read off key_cache [num_blocks, block_size, num_kv_heads, stored_head_size]."""

    @property
    def num_blocks(self) -> int:
        return int(self.key_cache.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.key_cache.shape[1])

    @property
    def num_kv_heads(self) -> int:
        return int(self.key_cache.shape[2])

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def tensors(self) -> tuple:
        """The tensors present: K, V and, when quantized, their scales."""
        return tuple(t for t in (self.key_cache, self.value_cache,
                                 self.k_scale_cache, self.v_scale_cache) if t is not None)


# dlpack.h's DLDeviceType codes, named for display (a repr must not fail on any device).
_DLPACK_DEVICE_NAMES = {1: "cpu", 2: "cuda", 3: "cuda_host", 10: "rocm", 11: "rocm_host", 13: "cuda_managed"}


def _device_label(tensor) -> str:
    """Where a tensor lives, for display: "cpu", "cuda:0", ...; "cpu" without DLPack."""
    if not hasattr(tensor, "__dlpack_device__"):
        return "cpu"
    device_type, device_id = (int(n) for n in tensor.__dlpack_device__())
    name = _DLPACK_DEVICE_NAMES.get(device_type, f"dlpack_device_{device_type}")
    return name if name == "cpu" else f"{name}:{device_id}"


@dataclass(frozen=True)
class KVCache(_Geometry):
    """docs/format.md's logical views of one layer's cache.

    key_cache / value_cache: [num_blocks, block_size, num_kv_heads, stored_head_size];
    k_scale_cache / v_scale_cache: [num_blocks, block_size, num_kv_heads] float32,
    None for kv_dtype "auto". Views may be strided (e.g. scales inline in vLLM's
    rows). `rotation` records the plan that wrote the cache; every read uses it.
    The arrays are the caller's own (NumPy, torch, ...), never copied.
    """

    key_cache: Any
    value_cache: Any
    k_scale_cache: Any
    v_scale_cache: Any
    kv_dtype: str
    rotation: RotationPlan | None
    head_size: int

    # The backend's view of the tensors (CacheArrays), made on first use: the
    # caller's tensors never move, so one view serves every later call.
    _arrays: Any = field(default=None, init=False, repr=False, compare=False)

    @property
    def device(self):
        from .interop import device_of
        return device_of(self.key_cache)

    def __repr__(self) -> str:
        # One line: the tensors' geometry and home, never their contents.
        plan = self.rotation
        rotation = None if plan is None else plan.describe() + (f", preset {plan.preset}" if plan.preset else "")
        return (f"KVCache(kv_dtype={self.kv_dtype!r}, head_size={self.head_size}, "
                f"shape={tuple(int(n) for n in self.key_cache.shape)}, storage={self.key_cache.dtype}, "
                f"device={_device_label(self.key_cache)}, rotation={rotation!r})")


@dataclass(frozen=True)
class CacheArrays(_Geometry):
    """A KVCache as its backend reads it: the tensors as the backend's arrays
    (NumPy on the host; fp8 as uint8 and, on a device, bfloat16 as uint16 bits),
    with the logical dtype of key_cache / value_cache beside them."""

    key_cache: Any
    value_cache: Any
    k_scale_cache: Any
    v_scale_cache: Any
    kv_dtype: str
    rotation: RotationPlan | None
    head_size: int
    storage_dtype: np.dtype
    device: Any

    @functools.cached_property
    def plan_key(self) -> tuple:
        """What a backend's attention plan may depend on besides the batch: the
        format, whether a rotation applies, each tensor's shape, strides and 16-byte
        alignment, and the device (a batch planned once serves caches of other
        formats or layouts too). Worked out once: the tensors never move."""
        tensors = (self.key_cache, self.value_cache, self.k_scale_cache, self.v_scale_cache)
        rotated = self.rotation is not None and not self.rotation.is_identity
        return (self.kv_dtype, str(self.storage_dtype), self.head_size, rotated, repr(self.device),
                tuple(None if a is None else (tuple(a.shape), tuple(a.strides), _address(a) % 16) for a in tensors))


    @functools.cached_property
    def replay_layout(self) -> int:
        """What a recorded call (kvcupy.replay) reads of the cache besides its tensors'
        addresses, plan_key and the rotation itself, as a number (one per distinct
        layout in the process: a replay's key hashes it at every call)."""
        with _LAYOUTS_LOCK:
            return _LAYOUTS.setdefault((self.plan_key, self.rotation), len(_LAYOUTS))

    @functools.cached_property
    def addresses(self) -> tuple:
        """key_cache, value_cache, k_scale_cache, v_scale_cache's addresses (0: absent)."""
        return tuple(0 if a is None else _address(a)
                     for a in (self.key_cache, self.value_cache, self.k_scale_cache, self.v_scale_cache))


_LAYOUTS: dict = {}
_LAYOUTS_LOCK = threading.Lock()


def _address(array) -> int:
    """A NumPy or CuPy array's first byte's address (never through NumPy's
    `.data`: a memoryview cannot hold ml_dtypes' bfloat16)."""
    return array.ctypes.data if isinstance(array, np.ndarray) else array.data.ptr
