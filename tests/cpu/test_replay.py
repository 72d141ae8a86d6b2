"""kvcupy.replay's keys without a GPU: two calls share a key exactly when they differ in
nothing but their data pointers (and the cache's tensors' addresses, for caches of one
layout); a replay launches with the new call's pointers. The arrays are stand-ins for
CuPy's (replay tells them apart by class); tests/gpu/test_replay.py runs the real thing."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from kvcupy import replay


class FakeDeviceArray:
    """What replay reads of a CuPy array: dtype, shape, strides, device id, address."""

    def __init__(self, shape, dtype=np.float16, ptr=0x10000, strides=None, device=0):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.strides = strides or tuple(int(np.prod(shape[i + 1:])) * self.dtype.itemsize for i in range(len(shape)))
        self.data, self.device = SimpleNamespace(ptr=ptr), SimpleNamespace(id=device)


class Recorded:
    def __init__(self):
        self.replays = []

    def replay(self, stream, pointers):
        self.replays.append((stream, pointers))


@pytest.fixture(autouse=True)
def fake_device(monkeypatch):
    monkeypatch.setattr(replay, "_cupy", lambda: FakeDeviceArray)
    monkeypatch.setattr(replay, "_current_device", lambda: 0)
    monkeypatch.setattr(replay, "_stream", lambda first, device: 0x5EED)
    monkeypatch.setattr(replay, "_metadata_plans", {})


def cache(layout=7, addresses=(0xA0, 0xB0, 0xC0, 0xD0)):
    return SimpleNamespace(_arrays=SimpleNamespace(replay_layout=layout, addresses=addresses), block_size=16,
                           num_blocks=64)


SHAPE = (4, 8, 128)


def attention(query=None, out=None, the_cache=None, batch=None, metadata=(None, None, None), hints=(None, None),
              scalars=(0.125, None, 0.0), sinks=None):
    query = query or FakeDeviceArray(SHAPE, ptr=0x20000)
    return replay.attention_call(query, the_cache or cache(), out, batch, metadata, hints, scalars, sinks)


def test_calls_that_differ_only_in_pointers_share_a_key_and_replay_with_their_own():
    batch = SimpleNamespace(_replays={})
    first = attention(FakeDeviceArray(SHAPE, ptr=0x20000), FakeDeviceArray(SHAPE, ptr=0x30000), batch=batch)
    assert first.recorded is None
    recorded = Recorded()
    first.keep(recorded, batch)
    second = attention(FakeDeviceArray(SHAPE, ptr=0x40010), FakeDeviceArray(SHAPE, ptr=0x50000),
                       the_cache=cache(addresses=(1, 2, 3, 4)), batch=batch)
    assert second.key == first.key and second.recorded is recorded
    assert second.run() is None
    assert recorded.replays == [(0x5EED, (0x40010, 0x50000, 1, 2, 3, 4))]


@pytest.mark.parametrize("change", ["dtype", "shape", "strides", "alignment", "device", "layout", "out", "scale type",
                                    "window", "sinks"])
def test_anything_but_the_pointers_makes_another_key(change, monkeypatch):
    batch = SimpleNamespace(_replays={})
    base = dict(query=FakeDeviceArray(SHAPE, ptr=0x20000), out=FakeDeviceArray(SHAPE, ptr=0x30000), batch=batch,
                scalars=(1.0, None, 0.0))
    first = attention(**base)
    changed = dict(base)
    if change == "dtype":
        changed["query"] = FakeDeviceArray(SHAPE, np.float32, ptr=0x20000)
    elif change == "shape":
        changed["query"] = FakeDeviceArray((5, 8, 128), ptr=0x20000)
    elif change == "strides":
        changed["query"] = FakeDeviceArray(SHAPE, ptr=0x20000, strides=(4096, 256, 2))
    elif change == "alignment":
        changed["query"] = FakeDeviceArray(SHAPE, ptr=0x20002)
    elif change == "device":
        changed["query"] = FakeDeviceArray(SHAPE, ptr=0x20000, device=1)
        monkeypatch.setattr(replay, "_current_device", lambda: 1)
    elif change == "layout":
        changed["the_cache"] = cache(layout=8)
    elif change == "out":
        changed["out"] = None
    elif change == "scale type":
        changed["scalars"] = (True, None, 0.0)   # equal to 1.0, refused by the full path
    elif change == "window":
        changed["scalars"] = (1.0, 100, 0.0)
    else:
        changed["sinks"] = FakeDeviceArray((8,), np.float32, ptr=0x60000)
    assert attention(**changed).key != first.key


def test_what_cannot_replay_gets_no_call():
    host = np.zeros(SHAPE, np.float16)
    batch = SimpleNamespace(_replays={})
    assert replay.attention_call(host, cache(), None, batch, (None,) * 3, (None,) * 2, (0.1, None, 0.0), None) is None
    assert attention(sinks=np.zeros(8, np.float32), batch=batch) is None            # sinks on the host
    assert attention(the_cache=SimpleNamespace(_arrays=None), batch=batch) is None  # a cache never viewed
    assert attention(batch=batch, hints=(1, None)) is None                          # a plan and hints at once
    assert attention(query=FakeDeviceArray(SHAPE, device=1), batch=batch) is None   # not the current device
    assert attention(metadata=(np.zeros((4, 2), np.int32), FakeDeviceArray((4,), np.int32), None)) is None


def test_device_metadata_is_planned_once_for_its_tensors():
    table, lens = FakeDeviceArray((4, 16), np.int32, ptr=0x70000), FakeDeviceArray((4,), np.int32, ptr=0x80000)
    first = attention(metadata=(table, lens, None), hints=(1, 256))
    assert first.plan is None and first.recorded is None
    plan, recorded = SimpleNamespace(_replays={}), Recorded()
    first.keep(recorded, plan)
    again = attention(metadata=(table, lens, None), hints=(1, 256))
    assert again.plan is plan and again.recorded is recorded
    other_tokens = attention(FakeDeviceArray((5, 8, 128)), metadata=(table, lens, None), hints=(1, 256))
    assert other_tokens.plan is None   # a plan is made for a number of query tokens
    other_table = attention(metadata=(FakeDeviceArray((4, 16), np.int32, ptr=0x90000), lens, None), hints=(1, 256))
    assert other_table.plan is None


def test_a_write_replays_with_its_key_value_and_cache_pointers():
    slots = SimpleNamespace(_replays={})
    key, value = FakeDeviceArray((3, 2, 128), ptr=0x1000), FakeDeviceArray((3, 2, 128), ptr=0x2000)
    first = replay.write_call(key, value, cache(), slots)
    recorded = Recorded()
    first.keep(recorded, slots)
    second = replay.write_call(FakeDeviceArray((3, 2, 128), ptr=0x3000), FakeDeviceArray((3, 2, 128), ptr=0x4000),
                               cache(addresses=(5, 6, 7, 8)), slots)
    assert second.recorded is recorded
    second.run()
    assert recorded.replays == [(0x5EED, (0x3000, 0x4000, 5, 6, 7, 8))]
    assert replay.write_call(key, value, cache(), np.arange(3)) is None   # host slot ids: checked every call


def test_caches_of_one_layout_share_a_replay_layout():
    import kvcupy as kc
    from kvcupy.ops import cache_arrays

    def arrays(kv_dtype="int4_per_token_head", blocks=4, rotation=None):
        return cache_arrays(kc.allocate_cache(blocks, 16, 2, 96, kv_dtype, rotation=rotation))

    first = arrays()
    assert arrays().replay_layout == first.replay_layout and arrays().addresses != first.addresses
    assert arrays("int8_per_token_head").replay_layout != first.replay_layout
    assert arrays(blocks=5).replay_layout != first.replay_layout
    assert arrays(rotation=kc.rotation_plan(96, "kron")).replay_layout != first.replay_layout


def test_a_rotation_replays_into_a_new_output(monkeypatch):
    import kvcupy as kc
    monkeypatch.setattr(replay.ROTATIONS, "_replays", {})
    allocated = FakeDeviceArray((6, 96), ptr=0xF000)
    monkeypatch.setattr(replay, "_new_like", lambda x: allocated)
    plan = kc.rotation_plan(96)
    first = replay.rotate_call(FakeDeviceArray((6, 96), ptr=0x1000), plan, False)
    recorded = Recorded()
    first.keep(recorded, replay.ROTATIONS)
    again = replay.rotate_call(FakeDeviceArray((6, 96), ptr=0x2000), plan, False)
    assert again.recorded is recorded and again.run() is allocated
    assert recorded.replays == [(0x5EED, (0x2000, 0xF000))]
    assert replay.rotate_call(FakeDeviceArray((6, 96), ptr=0x2000), plan, True).recorded is None
    assert replay.rotate_call(FakeDeviceArray((6, 96), ptr=0x2000), kc.rotation_plan(96, "kron"), False).recorded is None
    assert replay.rotate_call(np.zeros((6, 96), np.float16), plan, False) is None
