"""KVCache: the six tensors of FORMAT.md plus what wrote them (KV dtype, rotation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .rotation import RotationPlan


@dataclass(frozen=True)
class KVCache:
    """FORMAT.md's logical views of one layer's cache.

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
