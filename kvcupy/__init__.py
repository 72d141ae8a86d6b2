"""kvcupy: quantized (INT4 / INT8 / FP8 per token-head) paged KV caches and attention over them."""

from .backends import BackendStatus, BackendUnavailable, list_backends
from .batch import BatchPlan, SlotMapping, plan_batch, plan_slots
from .cache import CacheFullError, PagedKVCache
from .formats import KV_DTYPES, QUANTIZED_KV_DTYPES
from .functional import updated_cache
from .kvcache import KVCache
from .interop import Device
from .ops import (allocate_cache, cache_arrays, copy_blocks, paged_attention, reshape_and_cache,
                  rotate, wrap_cache)
from .rotation import RotationPlan, rotation_plan

__version__ = "0.1.0"

__all__ = [
    "BackendStatus", "BackendUnavailable", "BatchPlan", "CacheFullError", "Device", "KVCache",
    "KV_DTYPES", "PagedKVCache", "QUANTIZED_KV_DTYPES", "RotationPlan", "SlotMapping",
    "allocate_cache", "cache_arrays", "list_backends", "copy_blocks", "paged_attention", "plan_batch",
    "plan_slots", "reshape_and_cache", "rotate", "rotation_plan", "updated_cache", "wrap_cache",
    "__version__",
]
