"""KV-cache dtypes of docs/format.md: what a cache stores, and how many bytes it costs.

This module is the one table of KV dtypes; every other module asks it.
The float32 arithmetic of quantization itself lives in `reference.py` (the
oracle) and in each backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

# The unquantized ("auto") cache stores the model dtype itself.
MODEL_DTYPES = {
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float32": np.dtype(np.float32),
}
FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)

INT4_LEVELS = 15          # codes 0..15, asymmetric
INT8_MAX = 127.0          # codes -128..127, symmetric
FP8_MAX = 448.0           # largest finite e4m3fn
MIN_SCALE = np.float32(1e-6)
ZERO_POINT_MASK = 0xF     # int4: zero-point in the scale's four low mantissa bits
# The non-finite rule: a vector holding NaN or +-inf is stored with this scale
# word (float32 quiet NaN; as an int4 scale its low bits say zero-point 0) and
# all codes 0, so every read of it yields NaN.
NONFINITE_SCALE_BITS = 0x7FC00000

# Half an e4m3fn ulp, relative: 3 mantissa bits. Below the smallest normal
# (2^-6) the step is the subnormal one, 2^-9, so the absolute error is 2^-10.
FP8_HALF_ULP = 2.0 ** -4
FP8_SUBNORMAL_HALF_STEP = 2.0 ** -10

# Dtypes as kernels spell them (kernels_cu/types.cuh defines the kvc:: names:
# NVRTC's pip wheel has no cuda_fp16.h); the one dtype-to-C++ table.
CPP_TYPES = {
    np.dtype(np.float16): "kvc::half",
    np.dtype(ml_dtypes.bfloat16): "kvc::bfloat16",
    np.dtype(np.float32): "float",
    np.dtype(np.uint8): "kvc::u8",
    np.dtype(np.int8): "kvc::i8",
}


@dataclass(frozen=True)
class KVDtype:
    """One KV-cache dtype: its storage, its scale rule, and what kernels are told of it.

    scale_rule: "asymmetric" (int4: (max - min) / levels, zero-point in the
    scale's low bits), "symmetric" (absmax / code_max) or None (auto).
    kernel_id: the KV_DTYPE value a kernel is compiled with (-D KVC_KV_DTYPE=..).
    """

    name: str
    storage: np.dtype | None   # None: the model dtype (auto)
    values_per_element: int    # 2 for int4 (two nibbles a byte), else 1
    quantized: bool
    scale_rule: str | None
    code_min: float | None     # clamp bounds of the codes (fp8: of the scaled values)
    code_max: float | None
    kernel_id: int

    @property
    def levels(self) -> float | None:
        """What the scale divides the vector's range (int4) or absmax by."""
        if self.scale_rule == "asymmetric":
            return self.code_max - self.code_min
        return self.code_max

    def stored_head_size(self, head_size: int) -> int:
        """Length of the last axis of key_cache / value_cache."""
        return head_size // self.values_per_element

    def storage_dtype(self, model_dtype: np.dtype | None = None) -> np.dtype:
        if self.storage is not None:
            return self.storage
        if model_dtype is None:
            raise ValueError(f"kv_dtype={self.name!r} needs a model dtype")
        return np.dtype(model_dtype)

    def bytes_per_token(self, num_kv_heads: int, head_size: int,
                        model_dtype: np.dtype | None = None) -> int:
        """Bytes one token occupies in K and V together, scales included."""
        itemsize = self.storage_dtype(model_dtype).itemsize
        per_vector = self.stored_head_size(head_size) * itemsize
        if self.quantized:
            per_vector += 4   # one float32 scale
        return 2 * num_kv_heads * per_vector

    def kernel_defines(self, model_dtype: np.dtype) -> dict[str, str | int]:
        """The -D defines a kernel reading or writing this cache is compiled with."""
        storage = self.storage_dtype(model_dtype)
        return {"KVC_KV_DTYPE": self.kernel_id, "KVC_CACHE_T": CPP_TYPES[storage],
                "KVC_VALUES_PER_ELEMENT": self.values_per_element}

    def half_steps(self, rotated: np.ndarray, model_dtype: np.dtype) -> np.ndarray:
        """The largest rounding error this format allows on each value it stores
        (rotated: [..., d] float64, the vectors as quantized; same shape): the
        error bound `repro` and the tests hold every backend to."""
        if self.scale_rule == "asymmetric":
            step = (rotated.max(axis=-1) - rotated.min(axis=-1)) / self.levels
            return np.broadcast_to(step[..., None] / 2, rotated.shape)
        if self.name == "fp8_per_token_head":
            scale = np.abs(rotated).max(axis=-1, keepdims=True) / self.levels
            return np.maximum(np.abs(rotated) * FP8_HALF_ULP, scale * FP8_SUBNORMAL_HALF_STEP)
        if self.scale_rule == "symmetric":
            step = np.abs(rotated).max(axis=-1) / self.levels
            return np.broadcast_to(step[..., None] / 2, rotated.shape)
        # auto: the model dtype's own rounding (ml_dtypes.finfo also knows bfloat16)
        return np.abs(rotated) * float(ml_dtypes.finfo(model_dtype).eps) / 2


KV_DTYPES = {
    "int4_per_token_head": KVDtype("int4_per_token_head", np.dtype(np.uint8), 2, True,
                                   "asymmetric", 0, INT4_LEVELS, kernel_id=0),
    "int8_per_token_head": KVDtype("int8_per_token_head", np.dtype(np.int8), 1, True,
                                   "symmetric", -128, INT8_MAX, kernel_id=1),
    "fp8_per_token_head": KVDtype("fp8_per_token_head", np.dtype(np.uint8), 1, True,
                                  "symmetric", -FP8_MAX, FP8_MAX, kernel_id=2),
    "auto": KVDtype("auto", None, 1, False, None, None, None, kernel_id=3),
}
QUANTIZED_KV_DTYPES = tuple(name for name, kv in KV_DTYPES.items() if kv.quantized)


def kv_dtype_info(kv_dtype: str) -> KVDtype:
    try:
        return KV_DTYPES[kv_dtype]
    except (KeyError, TypeError):
        raise ValueError(
            f"kv_dtype={kv_dtype!r} is not a KV dtype; expected one of {sorted(KV_DTYPES)}"
        ) from None


def model_dtype(dtype) -> np.dtype:
    """Normalise a model dtype given as a name or a NumPy dtype."""
    key = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    try:
        return MODEL_DTYPES[key]
    except KeyError:
        raise ValueError(
            f"dtype={dtype!r} is not a model dtype; expected one of {sorted(MODEL_DTYPES)}"
        ) from None


def encode_int4_scale(scale: np.ndarray, zero_point: np.ndarray) -> np.ndarray:
    """float32 whose bits are (bits(scale) & ~0xF) | zero_point (docs/format.md)."""
    bits = np.asarray(scale, np.float32).view(np.uint32)
    zp = np.asarray(zero_point).astype(np.uint32)
    return ((bits & np.uint32(~ZERO_POINT_MASK & 0xFFFFFFFF)) | zp).view(np.float32)


def decode_int4_scale(encoded: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale', zero_point) of an encoded int4 scale, as docs/format.md decodes it."""
    bits = np.asarray(encoded, np.float32).view(np.uint32)
    zero_point = (bits & np.uint32(ZERO_POINT_MASK)).astype(np.int32)
    scale = (bits & np.uint32(~ZERO_POINT_MASK & 0xFFFFFFFF)).view(np.float32)
    return scale, zero_point


def fp8_decode_table() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn bit patterns (NaN for 0x7F/0xFF)."""
    return np.arange(256, dtype=np.uint8).view(FP8_DTYPE).astype(np.float32)
