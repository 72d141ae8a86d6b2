"""What `kvcupy check` compiles without --all (CI's check): the representative
sample covers every kernel family and KV dtype of the full list, and --sample
adds a seeded draw from that list, the same on every machine. No NVRTC needed."""

from __future__ import annotations

import pytest

from cli import check
from kvcupy import jit
from kvcupy.backends.cuda.specs import specialisations

KV_DEFINES = ("KVC_ATTN_KV", "KVC_PREFILL_KV", "KVC_KV_DTYPE")


def family(spec) -> tuple:
    """A specialisation's entry, kernels and KV dtype (None where it has none)."""
    values = jit.define_values(spec.defines)
    kv = next(((name, values[name]) for name in KV_DEFINES if name in values), None)
    return spec.entry, spec.functions, kv


def test_the_representative_sample_takes_every_family_and_kv_dtype():
    every = {family(spec) for spec in specialisations(True)}
    covered = {family(spec) for spec in specialisations(False)}
    assert every - covered == set()


def test_a_draw_is_fixed_by_its_seed_and_varies_with_it():
    every = specialisations(True)
    first = check.drawn(every, 50, "3f2a9c1")
    assert [check._stable_key(s) for s in first] == [check._stable_key(s) for s in check.drawn(every[::-1], 50,
                                                                                               "3f2a9c1")]
    other = check.drawn(every, 50, "77e0b12")
    assert {check._stable_key(s) for s in first} != {check._stable_key(s) for s in other}
    assert len({check._stable_key(s) for s in first}) == 50


@pytest.mark.parametrize("count", [0, 25, 10 ** 6])
def test_the_sample_adds_the_draw_to_the_representative_builds_once_each(count):
    chosen = check.sampled(count, "seed")
    keys = [check._stable_key(s) for s in chosen]
    assert len(keys) == len(set(keys))
    representative = {check._stable_key(s) for s in specialisations(False)}
    every = {check._stable_key(s) for s in specialisations(True)}
    assert representative <= set(keys) <= representative | every
    assert len(set(keys) - representative) <= count
    if count >= len(every):
        assert set(keys) == representative | every
