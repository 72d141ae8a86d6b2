"""PagedKVCache: slot mapping, all-or-nothing reserve, copy-on-write forks, accounting.

The stateful test drives random add / reserve+write / fork / free steps against
a plain Python model (each sequence's tokens, and which sequences share which
page) and checks page accounting and attention after every step.
"""

import itertools

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import kvcupy as kc
from kvcupy import reference
from kvcupy.formats import kv_dtype_info

from ..helpers import relative_error

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, NUM_HEADS = 2, 4, 2, 4
TOLERANCE = 1e-5   # cli/bounds.py, IMPL_BOUND: CPU attention within 1e-5 relative of the oracle


def manager(num_blocks=8, head_size=32, kv_dtype="int4_per_token_head", **kwargs):
    return kc.PagedKVCache(NUM_LAYERS, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_size,
                           kv_dtype=kv_dtype, dtype="float32", **kwargs)


def random_tokens(rng, num_tokens, head_size):
    """key and value [T, Hk, d] float32."""
    shape = (num_tokens, NUM_KV_HEADS, head_size)
    return (rng.standard_normal(shape).astype(np.float32),
            rng.standard_normal(shape).astype(np.float32))


def write_all_layers(mgr, rng, slot_mapping):
    """Write fresh tokens at slot_mapping in every layer; returns them per layer."""
    written = [random_tokens(rng, len(slot_mapping), mgr.layers[0].head_size)
               for _ in range(mgr.num_layers)]
    for layer, (key, value) in enumerate(written):
        mgr.write(layer, key, value, slot_mapping)
    return written


def oracle_attention(mgr, query, keys, values):
    """float64 attention of query [Lq, Hq, d] (the last Lq positions) over the
    model's own tokens keys/values [L, Hk, d], quantized as the cache stores them."""
    cache = mgr.layers[0]

    def stored(x):
        data, scale = reference.encode(x, cache.kv_dtype, mgr.rotation, cache.key_cache.dtype)
        return reference.decode_original(data, scale, cache.kv_dtype, mgr.rotation)

    return reference.attend(query, stored(keys), stored(values),
                            softmax_scale=1.0 / np.sqrt(cache.head_size))


def state(mgr):
    """Everything a rejected call must leave as it was."""
    return (mgr.stats(), {s: (mgr.block_table(s), mgr.seq_len(s)) for s in mgr.sequences},
            [np.asarray(t).tobytes() for layer in mgr.layers for t in layer.tensors()])


# --- reserve --------------------------------------------------------------

def test_reserve_maps_slots_across_page_boundaries():
    mgr = manager()
    a, b = mgr.add_sequence(), mgr.add_sequence()
    np.testing.assert_array_equal(mgr.reserve([a], 6), [0, 1, 2, 3, 4, 5])
    slots = mgr.reserve([a, b], [3, 2])
    assert slots.dtype == np.int64
    # a: positions 6, 7 finish page 1, position 8 opens page 2; b then opens page 3.
    np.testing.assert_array_equal(slots, [6, 7, 8, 12, 13])
    assert mgr.block_table(a) == (0, 1, 2) and mgr.seq_len(a) == 9
    assert mgr.block_table(b) == (3,) and mgr.seq_len(b) == 2


def test_reserve_same_count_for_every_sequence_and_zero_tokens():
    mgr = manager()
    a, b = mgr.add_sequence(), mgr.add_sequence()
    np.testing.assert_array_equal(mgr.reserve([a, b], 2), [0, 1, 4, 5])
    assert mgr.reserve([a, b], 0).shape == (0,)
    assert mgr.reserve([], 3).shape == (0,)
    assert mgr.stats().pages_used == 2


def test_add_sequence_ids():
    mgr = manager()
    assert mgr.add_sequence() == 0
    assert mgr.add_sequence("chat") == "chat"
    mgr.add_sequence(2)
    assert mgr.add_sequence() == 1
    assert mgr.add_sequence() == 3   # 2 is taken
    assert mgr.sequences == (0, "chat", 2, 1, 3)


@pytest.mark.parametrize("case", ["new pages", "copy on write"])
def test_cache_full_changes_nothing(case):
    mgr = manager(num_blocks=4)
    rng = np.random.default_rng(0)
    a, b = mgr.add_sequence(), mgr.add_sequence()
    if case == "new pages":
        write_all_layers(mgr, rng, mgr.reserve([a, b], [8, 3]))   # 3 pages, 1 free
        asked, counts, needed, free = [a, b], [1, 4], 2, 1         # a fits alone, b does not
    else:
        write_all_layers(mgr, rng, mgr.reserve([a], 14))   # 4 pages, the last half full
        b = mgr.fork(a)
        asked, counts, needed, free = [b], 1, 1, 0         # the copy of the shared page
    before = state(mgr)
    with pytest.raises(kc.CacheFullError, match=f"needs {needed} free pages; {free} of 4"):
        mgr.reserve(asked, counts)
    assert state(mgr) == before


def test_cache_full_error_is_a_runtime_error():
    assert issubclass(kc.CacheFullError, RuntimeError)


# --- fork and copy-on-write -----------------------------------------------

def test_fork_then_write_copies_the_shared_partial_page():
    mgr = manager()
    rng = np.random.default_rng(1)
    a = mgr.add_sequence()
    tokens = write_all_layers(mgr, rng, mgr.reserve([a], 6))   # pages 0 (full) and 1 (half)
    query = rng.standard_normal((1, NUM_HEADS, 32)).astype(np.float32)
    before = [mgr.attention(layer, query, [a]) for layer in range(NUM_LAYERS)]

    b = mgr.fork(a)
    assert mgr.block_table(b) == (0, 1) and mgr.ref_count(0) == mgr.ref_count(1) == 2
    new_tokens = write_all_layers(mgr, rng, mgr.reserve([b], 1))
    assert mgr.block_table(a) == (0, 1)
    assert mgr.block_table(b) == (0, 2), "b appends into a private copy of page 1"
    assert (mgr.ref_count(0), mgr.ref_count(1), mgr.ref_count(2)) == (2, 1, 1)
    for layer in range(NUM_LAYERS):
        after = mgr.attention(layer, query, [a])
        np.testing.assert_array_equal(after, before[layer], err_msg=f"layer {layer}")
        keys, values = (np.concatenate([tokens[layer][i], new_tokens[layer][i]]) for i in (0, 1))
        forked = mgr.attention(layer, query, [b])
        expected = oracle_attention(mgr, query, keys, values)
        assert relative_error(forked, expected) < TOLERANCE, f"layer {layer}"


def test_fork_of_full_pages_shares_them_without_copying():
    mgr = manager()
    a = mgr.add_sequence()
    mgr.reserve([a], 8)
    b = mgr.fork(a)
    mgr.reserve([a, b], 1)
    assert mgr.block_table(a) == (0, 1, 2) and mgr.block_table(b) == (0, 1, 3)
    assert mgr.stats().pages_used == 4


def test_last_holder_appending_keeps_the_shared_page():
    """Both holders of a half-full page append in one call: one copy, not two."""
    mgr = manager(num_blocks=3)
    a = mgr.add_sequence()
    mgr.reserve([a], 6)
    b = mgr.fork(a)
    mgr.reserve([a, b], 1)   # exactly one free page: enough
    assert mgr.block_table(a) == (0, 2) and mgr.block_table(b) == (0, 1)
    assert mgr.stats().pages_free == 0


# --- free and stats -------------------------------------------------------

def test_free_returns_pages_when_no_sequence_holds_them():
    mgr = manager()
    a = mgr.add_sequence()
    mgr.reserve([a], 6)
    b = mgr.fork(a)
    mgr.free(a)
    assert mgr.stats().pages_used == 2 and mgr.ref_count(0) == 1
    mgr.free(b)
    assert mgr.stats().pages_used == 0 and mgr.sequences == ()
    assert mgr.ref_count(0) == mgr.ref_count(1) == 0


@pytest.mark.parametrize("kv_dtype, stored_bytes, scale_bytes", [
    ("int4_per_token_head", 16, 4), ("int8_per_token_head", 32, 4),
    ("fp8_per_token_head", 32, 4), ("auto", 128, 0)])
def test_stats(kv_dtype, stored_bytes, scale_bytes):
    mgr = manager(num_blocks=8, kv_dtype=kv_dtype)   # head_size 32, float32 model dtype
    a, b = mgr.add_sequence(), mgr.add_sequence()
    mgr.reserve([a, b], [5, 3])
    mgr.fork(a)
    vector_bytes = stored_bytes + scale_bytes        # one token, one head, K or V
    token_bytes = NUM_LAYERS * 2 * NUM_KV_HEADS * vector_bytes
    assert mgr.stats() == kc.cache.CacheStats(
        pages_total=8, pages_used=3, pages_free=5, sequences=3, tokens=13,
        bytes=8 * BLOCK_SIZE * token_bytes, bytes_per_token=token_bytes)
    assert token_bytes == NUM_LAYERS * kv_dtype_info(kv_dtype).bytes_per_token(
        NUM_KV_HEADS, 32, np.dtype(np.float32))


def test_layers_share_one_rotation():
    plan = kc.rotation_plan(96, "kron")
    mgr = kc.PagedKVCache(3, 4, BLOCK_SIZE, NUM_KV_HEADS, 96, rotation=plan)
    assert mgr.rotation is plan and all(layer.rotation is plan for layer in mgr.layers)
    default = manager(head_size=96)
    assert default.rotation.kind == "blockdiag"
    assert all(layer.rotation is default.rotation for layer in default.layers)


def test_attention_forwards_options_to_paged_attention():
    mgr = manager()
    rng = np.random.default_rng(3)
    a, b = mgr.add_sequence(), mgr.add_sequence()
    write_all_layers(mgr, rng, mgr.reserve([a, b], [7, 3]))
    query = rng.standard_normal((3, NUM_HEADS, 32)).astype(np.float32)
    options = dict(softmax_scale=0.3, sliding_window=2, softcap=5.0,
                   sinks=rng.standard_normal(NUM_HEADS).astype(np.float32))
    out = np.empty_like(query)
    result = mgr.attention(1, query, [a, b], query_lens=[2, 1], out=out, **options)
    assert result is out
    expected = kc.paged_attention(query, mgr.layers[1], block_table=np.array([[0, 1], [2, 0]]),
                                  seq_lens=np.array([7, 3]), cu_seqlens_q=np.array([0, 2, 3]),
                                  **options)
    np.testing.assert_array_equal(out, expected)


# --- errors ---------------------------------------------------------------

def _query():
    return np.zeros((1, NUM_HEADS, 32), np.float32)


def _kv(num_tokens):
    return np.zeros((num_tokens, NUM_KV_HEADS, 32), np.float32)


BAD_CALLS = [
    ("unknown seq in reserve", lambda m: m.reserve([7], 1), KeyError, "seq_id=7"),
    ("seq_ids not a list", lambda m: m.reserve(0, 1), TypeError, "seq_ids"),
    ("seq listed twice", lambda m: m.reserve([0, 0], 1), ValueError, "more than once"),
    ("negative count", lambda m: m.reserve([0, 1], [1, -1]), ValueError, r"num_new_tokens\[1\]"),
    ("float count", lambda m: m.reserve([0], 1.5), TypeError, "num_new_tokens"),
    ("one count short", lambda m: m.reserve([0, 1], [1]), ValueError, "one per sequence"),
    ("fork unknown", lambda m: m.fork(9), KeyError, "seq_id=9"),
    ("fork onto a live id", lambda m: m.fork(0, 1), ValueError, "already"),
    ("free unknown", lambda m: m.free("x"), KeyError, "seq_id='x'"),
    ("duplicate id", lambda m: m.add_sequence(1), ValueError, "already"),
    ("unhashable id", lambda m: m.add_sequence([1]), TypeError, "hashable"),
    ("layer out of range", lambda m: m.write(2, _kv(1), _kv(1), np.array([9])), ValueError,
     "layer=2"),
    ("layer not an int", lambda m: m.attention(0.0, _query(), [0]), TypeError, "layer"),
    ("page out of range", lambda m: m.ref_count(8), ValueError, "page=8"),
    ("slot_mapping too short", lambda m: m.write(0, _kv(2), _kv(2), np.array([9])), ValueError,
     "slot_mapping"),
    ("too many queries", lambda m: m.attention(0, _query(), [1], query_lens=[3]), ValueError,
     "query_lens"),
    # The caller gave no cu_seqlens_q: the message names what they did give.
    ("query count mismatch", lambda m: m.attention(0, _query(), [0, 1]), ValueError,
     r"query has 1 token; query_lens=None \(one each, decode\) asks 2 for the 2 sequence\(s\) of seq_ids"),
    ("query count mismatch, lens given", lambda m: m.attention(0, _query(), [0, 1], query_lens=[1, 2]),
     ValueError, r"query has 1 token; query_lens=\[1, 2\] asks 3"),
]


@pytest.mark.parametrize("call, error, match", [c[1:] for c in BAD_CALLS],
                         ids=[c[0] for c in BAD_CALLS])
def test_bad_calls_raise_and_change_nothing(call, error, match):
    mgr = manager()
    a, b = mgr.add_sequence(), mgr.add_sequence()
    write_all_layers(mgr, np.random.default_rng(2), mgr.reserve([a, b], [5, 2]))
    before = state(mgr)
    with pytest.raises(error, match=match):
        call(mgr)
    assert state(mgr) == before


def test_bad_calls_never_name_an_argument_the_caller_did_not_pass():
    mgr = manager()
    a, b = mgr.add_sequence(), mgr.add_sequence()
    write_all_layers(mgr, np.random.default_rng(2), mgr.reserve([a, b], 1))
    with pytest.raises(ValueError) as raised:
        mgr.attention(0, _query(), [a, b])
    for internal in ("cu_seqlens_q", "block_table", "seq_lens", "batch"):
        assert internal not in str(raised.value), raised.value


# --- attention before write -------------------------------------------------

def test_attention_before_write_raises_and_changes_nothing():
    """reserve() advances the lengths at once; attending over a layer before its
    write would read whatever the reserved slots held."""
    mgr = manager()
    rng = np.random.default_rng(5)
    a, b = mgr.add_sequence(), mgr.add_sequence()
    write_all_layers(mgr, rng, mgr.reserve([a, b], 3))
    slot_mapping = mgr.reserve([a], 1)
    query = rng.standard_normal((1, NUM_HEADS, 32)).astype(np.float32)
    before = state(mgr)
    for layer in range(NUM_LAYERS):
        message = (rf"layer {layer} does not hold the 1 token reserve\(\) gave sequence 0 yet: "
                   rf"call write\({layer}, key, value, slot_mapping\)")
        with pytest.raises(RuntimeError, match=message):
            mgr.attention(layer, query, [a])
    assert state(mgr) == before
    mgr.attention(0, query, [b])   # b reserved nothing since its write
    key, value = random_tokens(rng, 1, 32)
    mgr.write(0, key, value, slot_mapping)
    mgr.attention(0, query, [a])
    with pytest.raises(RuntimeError, match="layer 1 does not hold"):
        mgr.attention(1, query, [a])
    mgr.write(1, key, value, slot_mapping)
    mgr.attention(1, query, [a])


def test_a_fork_waits_for_its_parents_write_and_a_freed_sequence_is_forgotten():
    mgr = manager()
    rng = np.random.default_rng(6)
    a = mgr.add_sequence()
    write_all_layers(mgr, rng, mgr.reserve([a], 3))
    slot_mapping = mgr.reserve([a], 2)
    b = mgr.fork(a)
    query = rng.standard_normal((1, NUM_HEADS, 32)).astype(np.float32)
    with pytest.raises(RuntimeError, match="sequence 1 yet"):
        mgr.attention(0, query, [b])
    mgr.free(a)
    with pytest.raises(RuntimeError, match="sequence 1 yet"):
        mgr.attention(0, query, [b])
    write_all_layers(mgr, rng, slot_mapping)
    mgr.attention(0, query, [b])
    mgr.free(b)
    assert mgr._unwritten == []


def test_a_write_with_a_copy_of_the_slot_mapping_counts():
    """A serving engine may hand write() its own copy (a device array, say): it
    cannot be traced to one reserve() call, so it never causes a refusal."""
    mgr = manager()
    rng = np.random.default_rng(7)
    a = mgr.add_sequence()
    slot_mapping = mgr.reserve([a], 4)
    write_all_layers(mgr, rng, slot_mapping.copy())
    mgr.attention(0, rng.standard_normal((1, NUM_HEADS, 32)).astype(np.float32), [a])


# --- repr and the docstring's loop ------------------------------------------

def test_repr_is_one_line_of_geometry_format_and_occupancy():
    mgr = manager(head_size=96)
    a = mgr.add_sequence()
    mgr.add_sequence("chat")
    write_all_layers(mgr, np.random.default_rng(8), mgr.reserve([a], 6))
    assert repr(mgr) == (
        "PagedKVCache(num_layers=2, kv_dtype='int4_per_token_head', head_size=96, num_kv_heads=2, "
        "block_size=4, pages=2/8 used, sequences=2, tokens=6, device=cpu, "
        "rotation='96 = 32 x 3 (block-diagonal H_32), preset kvcupy')")
    assert str(mgr) == repr(mgr)


def test_the_docstring_example_runs_as_a_doctest():
    """PagedKVCache's docstring: a serving loop from add_sequence to free, its output and repr."""
    import doctest
    from kvcupy import cache as cache_module

    finder = doctest.DocTestFinder()
    [test] = [t for t in finder.find(cache_module) if t.name.endswith(".PagedKVCache")]
    assert any("add_sequence" in example.source for example in test.examples)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    result = runner.run(test)
    assert result.attempted >= 8 and result.failed == 0, result


@pytest.mark.parametrize("num_layers, error", [(0, ValueError), (1.0, TypeError), (True, TypeError)])
def test_bad_num_layers(num_layers, error):
    with pytest.raises(error, match="num_layers"):
        kc.PagedKVCache(num_layers, 4, BLOCK_SIZE, NUM_KV_HEADS, 32)


# --- stateful: random steps against a plain model -------------------------

MACHINE_PAGES, MACHINE_HEAD_SIZE, MAX_SEQUENCES = 12, 64, 5


class CacheMachine(RuleBasedStateMachine):
    """The model: per sequence, its tokens ([layer][K or V] -> list of [Hk, d])
    and its pages as abstract ids, shared between the sequences a fork made."""

    kv_dtype = "int4_per_token_head"

    def __init__(self):
        super().__init__()
        self.mgr = kc.PagedKVCache(NUM_LAYERS, MACHINE_PAGES, BLOCK_SIZE, NUM_KV_HEADS,
                                   MACHINE_HEAD_SIZE, kv_dtype=self.kv_dtype, dtype="float32")
        self.tokens = {}   # seq_id -> [layer] -> (keys list, values list)
        self.pages = {}    # seq_id -> abstract page ids
        self.page_ids = itertools.count()
        self.rng = np.random.default_rng(0)

    def live(self, data):
        return data.draw(st.sampled_from(sorted(self.tokens)))

    def model_append(self, pages, seq_id, count) -> int:
        """Append `count` tokens in the model (to `pages`); returns the pages it takes."""
        table, length = pages[seq_id], len(self.tokens[seq_id][0][0])
        taken = 0
        shared = bool(table) and any(table[-1] in other
                                     for other_id, other in pages.items() if other_id != seq_id)
        if count and length % BLOCK_SIZE and shared:
            table[-1] = next(self.page_ids)
            taken += 1
        while len(table) * BLOCK_SIZE < length + count:
            table.append(next(self.page_ids))
            taken += 1
        return taken

    @precondition(lambda self: len(self.tokens) < MAX_SEQUENCES)
    @rule()
    def add(self):
        seq_id = self.mgr.add_sequence()
        assert seq_id not in self.tokens
        self.tokens[seq_id] = [([], []) for _ in range(NUM_LAYERS)]
        self.pages[seq_id] = []

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def reserve_and_write(self, data):
        seq_ids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1,
                                     max_size=3, unique=True))
        counts = data.draw(st.lists(st.integers(0, 6), min_size=len(seq_ids),
                                    max_size=len(seq_ids)))
        pages = {s: list(t) for s, t in self.pages.items()}
        needed = sum(self.model_append(pages, s, n) for s, n in zip(seq_ids, counts))
        if needed > self.mgr.stats().pages_free:
            before = state(self.mgr)
            with pytest.raises(kc.CacheFullError):
                self.mgr.reserve(seq_ids, counts)
            assert state(self.mgr) == before
            return
        written = write_all_layers(self.mgr, self.rng, self.mgr.reserve(seq_ids, counts))
        self.pages = pages
        starts = np.cumsum([0] + counts)
        for seq_id, start, end in zip(seq_ids, starts, starts[1:]):
            for layer, (key, value) in enumerate(written):
                self.tokens[seq_id][layer][0].extend(key[start:end])
                self.tokens[seq_id][layer][1].extend(value[start:end])

    @precondition(lambda self: self.tokens and len(self.tokens) < MAX_SEQUENCES)
    @rule(data=st.data())
    def fork(self, data):
        seq_id = self.live(data)
        new_id = self.mgr.fork(seq_id)
        self.tokens[new_id] = [(list(k), list(v)) for k, v in self.tokens[seq_id]]
        self.pages[new_id] = list(self.pages[seq_id])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = self.live(data)
        self.mgr.free(seq_id)
        del self.tokens[seq_id], self.pages[seq_id]

    @invariant()
    def pages_are_accounted_for(self):
        stats, mgr = self.mgr.stats(), self.mgr
        holders = np.zeros(MACHINE_PAGES, int)
        for seq_id in self.tokens:
            assert mgr.seq_len(seq_id) == len(self.tokens[seq_id][0][0]), f"seq {seq_id}"
            np.add.at(holders, list(mgr.block_table(seq_id)), 1)
        assert stats.pages_used + stats.pages_free == stats.pages_total == MACHINE_PAGES
        assert stats.pages_used == np.count_nonzero(holders)
        assert [mgr.ref_count(p) for p in range(MACHINE_PAGES)] == holders.tolist()
        assert stats.sequences == len(self.tokens)
        # The model's sharing and the manager's agree: abstract and physical
        # pages correspond one to one.
        physical_of = {}
        for seq_id, model_pages in self.pages.items():
            assert len(model_pages) == len(mgr.block_table(seq_id)), f"seq {seq_id}"
            for model_page, page in zip(model_pages, mgr.block_table(seq_id)):
                assert physical_of.setdefault(model_page, page) == page, f"seq {seq_id}"
        assert len(set(physical_of.values())) == len(physical_of)

    @invariant()
    def attention_matches_the_oracle(self):
        seq_ids = [s for s in sorted(self.tokens) if self.mgr.seq_len(s)]
        if not seq_ids:
            return
        query_lens = [min(self.mgr.seq_len(s), 2) for s in seq_ids]   # decode and prefill rows
        query = self.rng.standard_normal((sum(query_lens), NUM_HEADS, MACHINE_HEAD_SIZE),
                                         dtype=np.float32)
        starts = np.cumsum([0] + query_lens)
        for layer in range(NUM_LAYERS):
            out = self.mgr.attention(layer, query, seq_ids, query_lens=query_lens)
            for seq_id, start, end in zip(seq_ids, starts, starts[1:]):
                keys, values = (np.stack(x) for x in self.tokens[seq_id][layer])
                expected = oracle_attention(self.mgr, query[start:end], keys, values)
                error = relative_error(out[start:end], expected)
                assert error < TOLERANCE, f"{self.kv_dtype} layer {layer} seq {seq_id}: {error:.2e}"


def machine_test(kv_dtype):
    machine = type(f"CacheMachine_{kv_dtype}", (CacheMachine,), {"kv_dtype": kv_dtype})
    return settings(max_examples=25, stateful_step_count=15, deadline=None)(machine).TestCase


TestCacheMachineInt4 = machine_test("int4_per_token_head")
TestCacheMachineInt8 = machine_test("int8_per_token_head")
TestCacheMachineFp8 = machine_test("fp8_per_token_head")
