"""Host arrays onto the GPU and back for the GPU tests: bfloat16 through DLPack
(as torch hands it over), caches as CuPy views. Imported only where CuPy works."""

from __future__ import annotations

import ctypes

import cupy
import numpy as np

import kvcupy as kc
from kvcupy import interop


def to_device(array):
    if array is None:
        return None
    if array.dtype == kc.formats.MODEL_DTYPES["bfloat16"]:
        return cupy.asarray(array.view(np.uint16))   # bits; the cache knows its dtype
    if array.dtype == kc.formats.FP8_DTYPE:
        return cupy.asarray(array.view(np.uint8))
    return cupy.asarray(array)


class DeviceBf16:
    """A bfloat16 array on the GPU handed over through DLPack (as torch would)."""

    def __init__(self, bits):
        self.bits = bits

    def __dlpack_device__(self):
        return self.bits.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        capsule = self.bits.__dlpack__(**kwargs)
        name = b"dltensor_versioned" if kwargs.get("max_version") else b"dltensor"
        tensor = interop._get_pointer(capsule, name) + interop._TENSOR_OFFSETS[name]
        ctypes.c_uint8.from_address(tensor + interop._DTYPE_CODE_OFFSET).value = interop.DLPACK_BFLOAT
        return capsule


def device_query(query):
    if query.dtype == kc.formats.MODEL_DTYPES["bfloat16"]:
        return DeviceBf16(cupy.asarray(query.view(np.uint16)))
    return cupy.asarray(query)


def from_device(result, dtype):
    if isinstance(result, DeviceBf16):
        result = result.bits
    array = cupy.asnumpy(result)
    if dtype == kc.formats.MODEL_DTYPES["bfloat16"] and array.dtype == np.uint16:
        array = array.view(dtype)
    return array.astype(np.float64)


def device_view(cache):
    """A CuPy copy of a host cache, wrapped as the caller's arrays would be."""
    return kc.wrap_cache(*(to_device(t) for t in (cache.key_cache, cache.value_cache,
                                                  cache.k_scale_cache, cache.v_scale_cache)),
                         kv_dtype=cache.kv_dtype, rotation=cache.rotation) if cache.k_scale_cache is not None \
        else kc.wrap_cache(DeviceBf16(to_device(cache.key_cache)) if cache.key_cache.dtype.itemsize == 2
                           and cache.key_cache.dtype != np.float16 else to_device(cache.key_cache),
                           DeviceBf16(to_device(cache.value_cache)) if cache.value_cache.dtype.itemsize == 2
                           and cache.value_cache.dtype != np.float16 else to_device(cache.value_cache),
                           kv_dtype="auto", rotation=cache.rotation)


