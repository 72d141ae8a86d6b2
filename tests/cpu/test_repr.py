"""repr of a KVCache and a RotationPlan: one line that says what the object is, never its data."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import kvcupy
from kvcupy import KVCache


@pytest.mark.parametrize(("kv_dtype", "stored_head_size", "storage"), [
    ("int4_per_token_head", 48, "uint8"), ("int8_per_token_head", 96, "int8"),
    ("fp8_per_token_head", 96, "uint8"), ("auto", 96, "float16"),
])
def test_cache_repr_is_one_line_of_geometry_dtype_device_and_rotation(kv_dtype, stored_head_size, storage):
    plan = kvcupy.rotation_plan(96, "blockdiag")
    cache = kvcupy.allocate_cache(num_blocks=64, block_size=16, num_kv_heads=8, head_size=96,
                                  kv_dtype=kv_dtype, rotation=plan)
    text = repr(cache)
    assert text == str(cache) and "\n" not in text, text
    assert text == (f"KVCache(kv_dtype={kv_dtype!r}, head_size=96, shape=(64, 16, 8, {stored_head_size}), "
                    f"storage={storage}, device=cpu, "
                    "rotation='96 = 32 x 3 (block-diagonal H_32), preset kvcupy')"), text


def test_cache_repr_without_rotation():
    cache = kvcupy.allocate_cache(num_blocks=2, block_size=16, num_kv_heads=2, head_size=128,
                                  kv_dtype="int8_per_token_head")
    assert repr(cache).endswith("rotation='128: no rotation')"), repr(cache)


@dataclass
class DeviceTensor:
    """Stands in for a torch / CuPy tensor on a GPU: shape, dtype and a DLPack device."""

    shape: tuple
    dtype: str
    dlpack_device: tuple

    def __dlpack_device__(self):
        return self.dlpack_device


@pytest.mark.parametrize(("dlpack_device", "label"), [((2, 1), "cuda:1"), ((10, 0), "rocm:0"), ((1, 0), "cpu")])
def test_cache_repr_names_the_dlpack_device(dlpack_device, label):
    tensor = DeviceTensor((4, 16, 2, 64), "torch.uint8", dlpack_device)
    cache = KVCache(tensor, tensor, None, None, "int8_per_token_head", None, 64)
    assert f"storage=torch.uint8, device={label}, rotation=None)" in repr(cache), repr(cache)


@pytest.mark.parametrize(("kind", "preset", "structure"), [
    ("blockdiag", "kvcupy", "256 = 256 x 1 (block-diagonal H_256)"),
    ("blockdiag", "vllm", "256 = 256 x 1 (block-diagonal H_256)"),
    ("kron", "kvcupy", "256 = 1 x 256 (H_1 (x) H_256)"),
    ("none", None, "256: no rotation"),
])
def test_rotation_plan_repr_names_its_structure_not_its_signs(kind, preset, structure):
    plan = kvcupy.rotation_plan(256, kind, preset or "kvcupy")
    assert repr(plan) == (f"RotationPlan(kind={kind!r}, head_size=256, preset={preset!r}, "
                          f"structure={structure!r})")
    assert "-1" not in repr(plan)   # about half of the 256 signs are -1; none is printed
