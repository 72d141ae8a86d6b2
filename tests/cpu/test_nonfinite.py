"""Non-finite input (docs/format.md, "Non-finite input"): one behaviour for every KV dtype.

A vector (the d values of one token in one KV head, K or V, as quantized:
after rotation, which spreads one bad input channel over its block) holding
a NaN or +-inf is stored with the scale word 0x7FC00000 and all codes 0;
"auto" caches store it as given. Attention over it is then non-finite for
every (query token, query head) row that sees it, within causality and the
sliding window, and finite, matching the oracle, for every other row.

The one case without a fixed answer: an "auto" key of +-inf gives scores of
+-inf, which IEEE softmax reads as a certain key (NaN output) or as a masked
one (finite output), depending on the query's signs. Unrotated, the backend
must agree with the oracle row by row; rotated, it need not: the backend
scores in the rotated domain, where the key is a block of +-inf, the oracle
in the model's, where the inverse rotation of that block (inf - inf) is NaN.
"""

import numpy as np
import pytest

import kvcupy as kc
from kvcupy import formats, reference

from ..helpers import KV_DTYPES, paged_batch
from .test_cpu_backend import ATTENTION_RTOL, fresh_cache, oracle_copy, worst_row_error

NAN_SCALE_BITS = 0x7FC00000
BAD_VALUES = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}
TENSORS = ("key", "value", "both")   # both: K and V of the same tokens
ROTATIONS = ("blockdiag", "none")
# 72: d / 2 = 36 is no multiple of 8, so cpu_simd's register loops (int4,
# fp16) do not take it: the generic decode-to-buffer path, for every KV dtype.
HEAD_SIZES = (64, 96, 72)

BLOCK_SIZE = 16
NUM_HEADS, NUM_KV_HEADS = 8, 2
GROUP = NUM_HEADS // NUM_KV_HEADS
# A decode, a prefill with history and a fresh prefill in one varlen batch.
SEQ_LENS, QUERY_LENS = [51, 41, 17], [1, 6, 17]
# (sequence, position, KV head, input channel) of each bad vector, each placed
# where a leak would show:
BAD_SPOTS = [
    # The decode sees it. Its row (row 3 of chunk 32..47) stays in the kernel's
    # chunk buffer, where the tile of the sequence's last, 3-row chunk (48..50)
    # reads row 3 as padding, for KV head 0 too.
    (0, 35, 1, 5),
    # Prefill tokens 35..40 run together: 35..39 load it but must not see it.
    # It is the last row of its chunk (32..40), whose padding columns a register
    # path's scores fill by repeating that row.
    (1, 40, 0, 60),
    # Tokens 0..5 must not see it; with a window of 8 neither must 14..16,
    # though 14 and 15 share a run (and loaded columns) with 8..13, which do.
    (2, 6, 1, 0),
]
WINDOWS = {"no_window": None, "window_8": 8}   # window 8: the decode (at 50) no longer sees 35


def case_name(kv_dtype, bad, tensor, rotation, head_size, *rest):
    return " ".join([kv_dtype, bad, tensor, rotation, f"d={head_size}", *map(str, rest)])


def token_index(batch, seq, position):
    """Row of the batch's key/value arrays holding `position` of sequence `seq`."""
    return int(np.concatenate([[0], np.cumsum(batch.seq_lens)])[seq]) + position


def query_positions(batch):
    """(sequence, position) of every query token."""
    return [(seq, int(batch.seq_lens[seq] - batch.query_lens[seq] + i))
            for seq in range(len(batch.seq_lens)) for i in range(batch.query_lens[seq])]


def rows_that_see(batch, spots, window):
    """bool [T, Hq]: which (query token, query head) rows attend a bad vector."""
    sees = np.zeros((batch.num_queries, NUM_HEADS), bool)
    for t, (seq, position) in enumerate(query_positions(batch)):
        for bad_seq, bad_position, kv_head, _ in spots:
            in_range = bad_position <= position and (window is None or bad_position > position - window)
            if bad_seq == seq and in_range:
                sees[t, kv_head * GROUP:(kv_head + 1) * GROUP] = True
    return sees


def write_batch(kv_dtype, head_size, rotation, tensor, bad, seed):
    """(batch, cache the backend wrote, the oracle's, the backend's from clean input)."""
    rng = np.random.default_rng(seed)
    batch = paged_batch(rng, SEQ_LENS, QUERY_LENS, BLOCK_SIZE)
    shape = (batch.num_tokens, NUM_KV_HEADS, head_size)
    clean = {"key": (rng.standard_normal(shape) * 2).astype(np.float16),
             "value": rng.standard_normal(shape).astype(np.float16)}
    dirty = {name: x.copy() for name, x in clean.items()}
    for name in TENSORS[:2] if tensor == "both" else [tensor]:
        for seq, position, kv_head, channel in BAD_SPOTS:
            dirty[name][token_index(batch, seq, position), kv_head, channel] = BAD_VALUES[bad]

    plan = kc.rotation_plan(head_size, rotation)
    cache = fresh_cache(batch, BLOCK_SIZE, NUM_KV_HEADS, head_size, kv_dtype, plan)
    expected, untouched = oracle_copy(cache), oracle_copy(cache)
    kc.reshape_and_cache(dirty["key"], dirty["value"], cache, batch.slot_mapping)
    reference.reshape_and_cache(dirty["key"], dirty["value"], expected, batch.slot_mapping)
    kc.reshape_and_cache(clean["key"], clean["value"], untouched, batch.slot_mapping)
    return batch, cache, expected, untouched


def bad_slots(batch):
    """(block, offset, KV head) of each bad vector in the cache."""
    slots = [int(batch.slot_mapping[token_index(batch, seq, position)]) for seq, position, _, _ in BAD_SPOTS]
    return [(*divmod(slot, BLOCK_SIZE), kv_head) for slot, (_, _, kv_head, _) in zip(slots, BAD_SPOTS)]


def as_words(tensor):
    """A cache tensor's bits, one unsigned word per stored value."""
    tensor = np.asarray(tensor)
    return tensor.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[tensor.itemsize])


def same_bits_or_both_nan(actual, expected):
    """Bitwise equality, except that any NaN equals any NaN: an "auto" cache stores
    what arithmetic made of a NaN, whose sign and payload IEEE leaves open."""
    nan = np.isnan(np.asarray(actual, np.float32))
    return np.array_equal(nan, np.isnan(np.asarray(expected, np.float32))) and \
        np.array_equal(as_words(actual)[~nan], as_words(expected)[~nan])


WRITE_CASES = [(kv_dtype, bad, tensor, rotation, head_size) for kv_dtype in KV_DTYPES for bad in BAD_VALUES
               for tensor in ("key", "value") for rotation in ROTATIONS for head_size in HEAD_SIZES]


@pytest.mark.parametrize("kv_dtype,bad,tensor,rotation,head_size", WRITE_CASES)
def test_a_nonfinite_vector_is_stored_as_nan_scale_and_zero_codes(kv_dtype, bad, tensor, rotation, head_size):
    case = case_name(kv_dtype, bad, tensor, rotation, head_size)
    batch, cache, expected, untouched = write_batch(kv_dtype, head_size, rotation, tensor, bad, seed=head_size)
    data_name, scale_name = ("key_cache", "k_scale_cache") if tensor == "key" else ("value_cache", "v_scale_cache")
    spots = bad_slots(batch)

    for name in ("key_cache", "value_cache", "k_scale_cache", "v_scale_cache"):
        actual = getattr(cache, name)
        if actual is None:
            continue
        if kv_dtype == "auto":
            assert same_bits_or_both_nan(actual, getattr(expected, name)), f"{case}: {name} differs from the oracle"
        else:
            assert np.array_equal(as_words(actual), as_words(getattr(expected, name))), \
                f"{case}: {name} bytes differ from the oracle's"
        # Every other vector is what clean input gives, bit for bit.
        others = np.ones(actual.shape[:3], bool)
        if name in (data_name, scale_name):
            for spot in spots:
                others[spot] = False
        assert np.array_equal(as_words(actual)[others], as_words(getattr(untouched, name))[others]), \
            f"{case}: {name} changed outside the bad vectors"

    for spot in spots:
        stored = getattr(cache, data_name)[spot]
        if kv_dtype == "auto":
            assert not np.isfinite(stored.astype(np.float32)).all(), f"{case}: {spot} stored as finite"
            continue
        assert int(getattr(cache, scale_name)[spot].view(np.uint32)) == NAN_SCALE_BITS, \
            f"{case}: {spot} scale word is not 0x7FC00000"
        assert not as_words(stored).any(), f"{case}: {spot} codes are not all 0"


QUANTIZERS = {"int4": reference.quantize_int4, "int8": reference.quantize_int8, "fp8": reference.quantize_fp8}


@pytest.mark.parametrize("bad", BAD_VALUES)
@pytest.mark.parametrize("kind", QUANTIZERS)
def test_the_oracle_quantizers_mark_a_nonfinite_vector(kind, bad):
    quantize = QUANTIZERS[kind]
    x = np.stack([np.linspace(-1, 1, 32, dtype=np.float32)] * 2)
    x[1, 7] = BAD_VALUES[bad]
    codes, scale = quantize(x)
    assert scale.view(np.uint32).tolist()[1] == NAN_SCALE_BITS, f"{kind} {bad}: scale word"
    assert not codes[1].any(), f"{kind} {bad}: codes"
    finite_codes, finite_scale = quantize(x[0])
    np.testing.assert_array_equal(codes[0], finite_codes, err_msg=f"{kind} {bad}: the finite vector's codes")
    assert scale[0].view(np.uint32) == finite_scale.view(np.uint32), f"{kind} {bad}: the finite vector's scale"
    if kind == "int4":
        step, zero_point = formats.decode_int4_scale(scale[1])
        assert np.isnan(step) and zero_point == 0, f"{bad}: the int4 word decodes as scale NaN, zero-point 0"


def test_only_the_vector_that_holds_the_bad_value_is_marked():
    """Rotation mixes the channels of one vector, never two vectors: the same
    token's other KV head, and its V when K is bad, stay finite."""
    batch, cache, _, _ = write_batch("int4_per_token_head", 64, "blockdiag", "key", "nan", seed=1)
    marked = np.isnan(cache.k_scale_cache)
    expected = np.zeros_like(marked)
    for spot in bad_slots(batch):
        expected[spot] = True
    np.testing.assert_array_equal(marked, expected)
    assert np.isfinite(cache.v_scale_cache).all()


def attend_both(batch, cache, query, **kwargs):
    args = dict(block_table=batch.block_table, seq_lens=batch.seq_lens, cu_seqlens_q=batch.cu_seqlens_q, **kwargs)
    return kc.paged_attention(query, cache, **args), reference.paged_attention(query, cache, **args)


def finite_rows(out):
    return np.isfinite(out).all(axis=-1)


ATTENTION_CASES = [(kv_dtype, bad, tensor, rotation, head_size, window) for kv_dtype in KV_DTYPES
                   for bad in BAD_VALUES for tensor in TENSORS for rotation in ROTATIONS
                   for head_size in HEAD_SIZES for window in WINDOWS]


@pytest.mark.parametrize("kv_dtype,bad,tensor,rotation,head_size,window", ATTENTION_CASES)
def test_attention_is_nonfinite_exactly_where_a_bad_vector_is_seen(kv_dtype, bad, tensor, rotation, head_size,
                                                                   window):
    case = case_name(kv_dtype, bad, tensor, rotation, head_size, window)
    batch, cache, _, _ = write_batch(kv_dtype, head_size, rotation, tensor, bad, seed=head_size + 1)
    query = np.random.default_rng(head_size).standard_normal((batch.num_queries, NUM_HEADS, head_size))
    with np.errstate(invalid="ignore"):   # the oracle's inf - inf
        out, expected = attend_both(batch, cache, query.astype(np.float32), sliding_window=WINDOWS[window])
    sees = rows_that_see(batch, BAD_SPOTS, WINDOWS[window])

    finite, oracle_finite = finite_rows(out), finite_rows(expected)
    assert finite[~sees].all(), f"{case}: {np.argwhere(~finite & ~sees).tolist()} non-finite, but see no bad vector"
    if kv_dtype == "auto" and tensor == "key" and bad != "nan":
        if rotation == "none":
            np.testing.assert_array_equal(finite, oracle_finite, err_msg=f"{case}: finite rows differ from the oracle's")
        finite &= oracle_finite   # compared below
    else:
        assert not finite[sees].any(), f"{case}: {np.argwhere(finite & sees).tolist()} finite, but see a bad vector"
        np.testing.assert_array_equal(oracle_finite, ~sees, err_msg=f"{case}: the oracle's finite rows")
    if kv_dtype != "auto":
        # A NaN scale reaches every channel: the whole row is NaN, as the oracle's.
        assert np.isnan(out[sees]).all() and np.isnan(expected[sees]).all(), f"{case}: rows only partly NaN"
    error = worst_row_error(out[finite], expected[finite])
    assert error <= ATTENTION_RTOL, f"{case}: finite rows differ from the oracle by {error:.2e}"


FEATURES = {"plain": {}, "softcap_and_sinks": {"softcap": 30.0, "sinks": "random"}}


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize("rotation", ROTATIONS)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_nan_key_never_gives_a_finite_output(kv_dtype, head_size, rotation, features):
    """Whatever its position: a decode batch of 40 sequences of 40 tokens, where
    sequence s holds a NaN key in one channel at position s, in KV head 0."""
    case = case_name(kv_dtype, "nan", "key", rotation, head_size, features)
    rng = np.random.default_rng(head_size)
    length = 40
    batch = paged_batch(rng, [length] * length, [1] * length, BLOCK_SIZE)
    shape = (batch.num_tokens, NUM_KV_HEADS, head_size)
    key = (rng.standard_normal(shape) * 2).astype(np.float16)
    value = rng.standard_normal(shape).astype(np.float16)
    for seq in range(length):
        key[token_index(batch, seq, seq), 0, seq % head_size] = np.nan
    cache = fresh_cache(batch, BLOCK_SIZE, NUM_KV_HEADS, head_size, kv_dtype,
                        kc.rotation_plan(head_size, rotation))
    kc.reshape_and_cache(key, value, cache, batch.slot_mapping)

    kwargs = dict(FEATURES[features])
    if "sinks" in kwargs:
        kwargs["sinks"] = rng.standard_normal(NUM_HEADS).astype(np.float32)
    query = rng.standard_normal((batch.num_queries, NUM_HEADS, head_size)).astype(np.float32)
    for name, out in zip(("backend", "oracle"), attend_both(batch, cache, query, **kwargs)):
        assert np.isnan(out[:, :GROUP]).all(), f"{case}: the {name} gave a finite value over a NaN key"
        assert np.isfinite(out[:, GROUP:]).all(), f"{case}: the {name} leaked the NaN to KV head 1"
