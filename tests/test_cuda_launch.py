"""cuda_launch's driver structures and argument conversion, without a GPU: the
ctypes layouts must match cuda.h's (CUDA 12 and 13), or the driver reads garbage."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvcupy.backends import cuda_launch


def test_structures_match_cuda_h():
    # CUlaunchAttribute: an int id padded to 8 bytes, then a 64-byte union.
    assert ctypes.sizeof(cuda_launch.LaunchAttribute) == 72
    assert cuda_launch.LaunchAttribute.value.offset == 8
    # CUlaunchConfig: seven unsigned ints, then the stream (8-aligned), attrs, numAttrs.
    config = cuda_launch.LaunchConfig
    assert (config.stream.offset, config.attributes.offset, config.attribute_count.offset) == (32, 40, 48)
    assert ctypes.sizeof(config) == 56


def test_the_config_asks_for_programmatic_serialisation():
    config = cuda_launch.launch_config((5, 2), (256,), 1024, 0x1234)
    assert list(config.grid) == [5, 2, 1] and list(config.block) == [256, 1, 1]
    assert (config.shared_bytes, config.stream, config.attribute_count) == (1024, 0x1234, 1)
    attribute = config.attributes[0]
    assert attribute.id == 6   # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert int.from_bytes(attribute.value[:4], "little") == 1   # programmaticStreamSerializationAllowed


class FakeDeviceArray:
    class data:
        ptr = 0xDEAD0000


@pytest.mark.parametrize("value,c_type,expected", [
    (np.int32(-7), ctypes.c_int32, -7),
    (np.int64(1 << 40), ctypes.c_int64, 1 << 40),
    (np.uintp(0), ctypes.c_uint64, 0),
    (np.float32(0.5), ctypes.c_float, 0.5),
    (FakeDeviceArray(), ctypes.c_void_p, 0xDEAD0000),
])
def test_arguments_take_their_c_types(value, c_type, expected):
    argument = cuda_launch.c_argument(value)
    assert isinstance(argument, c_type) and argument.value == expected


@pytest.mark.parametrize("value", [3, 0.5, np.float16(1), None])
def test_arguments_without_a_c_type_are_refused(value):
    with pytest.raises(TypeError, match="kernel argument"):
        cuda_launch.c_argument(value)
