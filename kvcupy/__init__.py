"""kvcupy: quantized (INT4 / INT8 / FP8 per token-head) paged KV caches and attention over them."""

from .cache import CacheFullError, PagedKVCache
from .formats import KV_DTYPES, QUANTIZED_KV_DTYPES
from .kvcache import KVCache
from .ops import allocate_cache, paged_attention, reshape_and_cache, rotate, wrap_cache
from .rotation import RotationPlan, rotation_plan

__version__ = "0.1.0"

__all__ = [
    "CacheFullError", "KVCache", "KV_DTYPES", "PagedKVCache", "QUANTIZED_KV_DTYPES",
    "RotationPlan", "allocate_cache", "paged_attention", "reshape_and_cache", "rotate",
    "rotation_plan", "wrap_cache", "__version__",
]
