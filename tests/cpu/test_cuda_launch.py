"""kvcupy.backends.cuda.launch's driver structures and argument conversion, without a GPU: the
ctypes layouts must match cuda.h's (CUDA 12 and 13), or the driver reads garbage."""

from __future__ import annotations

import ctypes
import re
import struct

import numpy as np
import pytest

from kvcupy.backends.cuda import launch as cuda_launch


def test_structures_match_cuda_h():
    # CUlaunchAttribute: an int id padded to 8 bytes, then a 64-byte union.
    assert ctypes.sizeof(cuda_launch.LaunchAttribute) == 72
    assert cuda_launch.LaunchAttribute.value.offset == 8
    # CUlaunchConfig: seven unsigned ints, then the stream (8-aligned), attrs, numAttrs.
    config = cuda_launch.LaunchConfig
    assert (config.stream.offset, config.attributes.offset, config.attribute_count.offset) == (32, 40, 48)
    assert ctypes.sizeof(config) == 56


def test_a_dependent_config_asks_for_programmatic_serialisation():
    config = cuda_launch.launch_config((5, 2), (256,), 1024, 0x1234, True)
    assert list(config.grid) == [5, 2, 1] and list(config.block) == [256, 1, 1]
    assert (config.shared_bytes, config.stream, config.attribute_count) == (1024, 0x1234, 1)
    attribute = config.attributes[0]
    assert attribute.id == 6   # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert int.from_bytes(attribute.value[:4], "little") == 1   # programmaticStreamSerializationAllowed
    assert bytes(attribute)[cuda_launch.LaunchAttribute.value.offset + 4:] == bytes(60)   # the rest of the union


def test_an_attribute_carries_its_whole_payload():
    # Bytes after a zero byte too: assigned as a char array they stop at the first
    # zero, and a cluster dimension (4, 1, 1) reached the driver as (4, 0, 0).
    attribute = cuda_launch.launch_attribute(4, struct.pack("<3I", 4, 1, 1))   # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert attribute.id == 4
    assert struct.unpack_from("<3I", bytes(attribute), cuda_launch.LaunchAttribute.value.offset) == (4, 1, 1)
    assert bytes(attribute)[cuda_launch.LaunchAttribute.value.offset + 12:] == bytes(52)


def test_a_plain_config_has_no_attributes():
    config = cuda_launch.launch_config((7,), (128, 2), 0, 0x99, False)
    assert list(config.grid) == [7, 1, 1] and list(config.block) == [128, 2, 1]
    assert config.attribute_count == 0 and not config.attributes   # a null array


class FakeDeviceArray:
    class data:
        ptr = 0xDEAD0000


def test_parameters_sit_at_their_natural_alignment():
    # merge_splits: four pointers, five ints, a pointer (padded to 8), an int, a float.
    layout = cuda_launch.parameter_layout("PPPPiiiiiPif")
    assert layout.size == 72
    packed = cuda_launch.pack_parameters("PPPPiiiiiPif", (
        FakeDeviceArray(), np.uintp(0), np.uintp(0x10), FakeDeviceArray(), np.int32(4), np.int32(-2), np.int32(32),
        np.int32(128), np.int32(1), np.uintp(0x20), np.int32(-1), np.float32(0.5)))
    assert struct.unpack_from("<4Q5i", packed, 0) == (0xDEAD0000, 0, 0x10, 0xDEAD0000, 4, -2, 32, 128, 1)
    assert packed[52:56] == bytes(4)   # padding before the pointer
    assert struct.unpack_from("<Qif", packed, 56) == (0x20, -1, 0.5)
    # int64 and double after an int: padded to 8 as well.
    assert cuda_launch.parameter_layout("iqid").size == 32


def test_bad_signatures_and_arguments_are_refused():
    with pytest.raises(ValueError, match="no parameter code 'x'"):
        cuda_launch.parameter_layout("Pxi")
    with pytest.raises(ValueError, match="takes 2 arguments, not 1"):
        cuda_launch.pack_parameters("Pi", (np.uintp(0),))
    with pytest.raises(TypeError, match="neither a device array nor an address"):
        cuda_launch.pack_parameters("P", (None,))


def parameter_codes(parameters: str) -> str:
    """cuda_launch's codes of a C parameter list (the types attention.cu uses)."""
    codes = ""
    for parameter in parameters.replace("\\", " ").split(","):
        declaration = " ".join(parameter.split())
        if "*" in declaration:
            codes += "P"
        elif declaration.startswith("long long "):
            codes += "q"
        elif declaration.startswith("int "):
            codes += "i"
        elif declaration.startswith("float "):
            codes += "f"
        else:
            raise AssertionError(f"no code for parameter {declaration!r}")
    return codes


def attention_source() -> str:
    from kvcupy import jit
    return (jit.source_dir() / "attention.cu").read_text()


def test_the_merge_signature_matches_the_kernel_source():
    from kvcupy.backends.cuda import kernels
    source = attention_source()
    header = source[source.index('extern "C" __global__ void merge_splits('):]
    parameters = header[header.index("(") + 1:header.index(")")]
    assert parameter_codes(parameters) == kernels.MERGE_SIGNATURE


def macro_fields(source: str, macro: str) -> list:
    """(field name, launch.py code) of the FIELD(type, name) / LAST(type, name) entries
    of X-macro `macro` in `source`, in order."""
    body = source[source.index(f"#define {macro}("):]
    body = body[:body.index("\n\n")]
    return [(name, parameter_codes(f"{kind} {name}"))
            for kind, name in re.findall(r"(?:FIELD|LAST)\(([^,()]+),\s*(\w+)\)", body)]


def test_the_attention_params_match_the_kernel_header():
    from kvcupy import jit
    from kvcupy.backends.cuda.params import ATTENTION_PARAMS
    header = (jit.source_dir() / "params.cuh").read_text()
    fields = macro_fields(header, "KVC_ATTENTION_FIELDS")
    assert fields == list(zip(ATTENTION_PARAMS.names, ATTENTION_PARAMS.signature))
    assert len(fields) == 54
    source = attention_source()
    for entry in ("paged_attention", "prefill_attention"):
        assert f"{entry}(KVC_ATTENTION_PARAMETERS)" in source


def test_a_parameter_struct_packs_named_fields_and_zeros_the_rest():
    layout = cuda_launch.ParameterStruct((("pointer", "P"), ("count", "i"), ("wide", "q"), ("factor", "f")))
    assert layout.offsets == {"pointer": 0, "count": 8, "wide": 16, "factor": 24}
    assert layout.size == 28   # the parameters' bytes, no tail padding
    packed = layout.pack({"count": 3, "factor": 0.5})
    assert packed == struct.pack("<Qiiqf", 0, 3, 0, 0, 0.5)
    assert layout.pack({"pointer": np.uintp(0xAB00)})[:8] == struct.pack("<Q", 0xAB00)
    with pytest.raises(KeyError, match="no field 'counts'"):
        layout.pack({"counts": 1})
    with pytest.raises(ValueError, match="repeats"):
        cuda_launch.ParameterStruct((("a", "i"), ("a", "i")))


class FakeDriver:
    """libcuda's two entry points as cuda_launch calls them: records what a launch passed."""

    def __init__(self, result=0):
        self.result, self.launches = result, []

    def cuLaunchKernelEx(self, config, handle, params, extra):
        config = ctypes.cast(config, ctypes.POINTER(cuda_launch.LaunchConfig)).contents
        words = ctypes.cast(extra, ctypes.POINTER(ctypes.c_void_p))
        size = ctypes.c_size_t.from_address(words[3]).value
        attribute = config.attributes[0].id if config.attribute_count else None
        self.launches.append(dict(grid=list(config.grid), block=list(config.block), stream=config.stream,
                                  shared_bytes=config.shared_bytes, attribute=attribute, handle=handle,
                                  params=params,
                                  markers=(words[0], words[2], words[4]),
                                  buffer=ctypes.string_at(words[1], size)))
        return self.result

    def cuGetErrorName(self, result, name):
        ctypes.cast(name, ctypes.POINTER(ctypes.c_char_p))[0] = b"CUDA_ERROR_INVALID_VALUE"
        return 0


def test_a_launch_passes_the_packed_buffer_through_extra(monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(cuda_launch, "_driver", lambda: driver)
    args = (FakeDeviceArray(), np.int32(7), np.float32(2.0))
    cuda_launch.launch(0x1234, (9,), (256,), "Pif", args, stream=0x77, dependent=True)
    cuda_launch.launch(0x5678, [3, 4], [64], "Pif", args, stream=0x77, shared_bytes=100_000)
    launch, plain = driver.launches
    assert (launch["grid"], launch["block"], launch["stream"], launch["handle"]) == ([9, 1, 1], [256, 1, 1],
                                                                                      0x77, 0x1234)
    assert launch["attribute"] == cuda_launch.PROGRAMMATIC_STREAM_SERIALIZATION and launch["params"] is None
    # CU_LAUNCH_PARAM_BUFFER_POINTER, CU_LAUNCH_PARAM_BUFFER_SIZE, CU_LAUNCH_PARAM_END.
    assert launch["markers"] == (1, 2, None)
    assert launch["buffer"] == cuda_launch.pack_parameters("Pif", args) == struct.pack("<Qif", 0xDEAD0000, 7, 2.0)
    # A plain launch: no attribute, the dynamic shared memory passed on.
    assert (plain["grid"], plain["block"], plain["handle"]) == ([3, 4, 1], [64, 1, 1], 0x5678)
    assert plain["attribute"] is None and plain["shared_bytes"] == 100_000
    assert plain["buffer"] == launch["buffer"]


def test_a_failed_launch_names_the_drivers_error(monkeypatch):
    monkeypatch.setattr(cuda_launch, "_driver", lambda: FakeDriver(result=1))
    with pytest.raises(RuntimeError, match=r"cuLaunchKernelEx failed: CUDA_ERROR_INVALID_VALUE \(1\)"):
        cuda_launch.launch(0x1234, (1,), (32,), "i", (np.int32(0),), stream=0)


def test_a_packed_launch_replays_with_its_pointer_fields_patched(monkeypatch):
    driver = FakeDriver()
    monkeypatch.setattr(cuda_launch, "_driver", lambda: driver)
    query, out = FakeDeviceArray(), FakeDeviceArray()
    args = (out, np.int32(7), np.uint64(0), query, np.float64(0.5))
    assert cuda_launch.signature_of(args) == "PiQPd"
    assert cuda_launch.parameter_offsets("PiQPd") == (0, 8, 16, 24, 32)
    first = cuda_launch.PackedLaunch.from_args(0x1234, (9,), (256,), args, replayed=(query, out))
    assert first.patches == ((0, 1), (24, 0))
    second = cuda_launch.PackedLaunch(0x5678, (2,), (32,), struct.pack("<qQ", -1, 3), patches=((8, 2),))
    call = cuda_launch.RecordedCall([first, second])
    first(0x77)                                        # the recording call: as packed
    call.replay(0x99, (0xAAAA0000, 0xBBBB0000, 42))    # then each pointer field from the call's pointers
    recorded, replayed, other = driver.launches
    assert recorded["buffer"] == struct.pack("<QiiQQd", 0xDEAD0000, 7, 0, 0, 0xDEAD0000, 0.5)
    assert replayed["buffer"] == struct.pack("<QiiQQd", 0xBBBB0000, 7, 0, 0, 0xAAAA0000, 0.5)
    assert (recorded["stream"], replayed["stream"], other["stream"]) == (0x77, 0x99, 0x99)
    assert other["buffer"] == struct.pack("<qQ", -1, 42) and other["handle"] == 0x5678


def test_a_signature_refuses_an_untyped_argument():
    with pytest.raises(TypeError, match="neither a device array nor a typed NumPy scalar"):
        cuda_launch.signature_of((np.int32(1), 2.0))
