"""The oracle's probability-weighted sums (reference.seen_sums): its one batched
product, taken where every value is finite, against the sum a query at a time
over the values it sees; and a non-finite value a query does not see never
reaching it."""

import numpy as np
import pytest

from kvcupy import reference


def attention_inputs(rng, num_queries, seq_len, num_heads, head_size, window):
    """probs [Hq, Lq, L] as attend forms them (zero where hidden), values, visible."""
    query_pos = seq_len - num_queries + np.arange(num_queries)[:, None]
    key_pos = np.arange(seq_len)[None, :]
    visible = key_pos <= query_pos
    if window is not None:
        visible &= key_pos > query_pos - window
    scores = np.where(visible[None], rng.standard_normal((num_heads, num_queries, seq_len)), -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = weights / weights.sum(axis=-1, keepdims=True)
    values = rng.standard_normal((seq_len, num_heads, head_size))
    return probs, values, visible


@pytest.mark.parametrize("num_queries,seq_len,window", [(1, 1, None), (7, 7, None), (5, 300, None), (64, 200, 17),
                                                        (40, 90, 1)])
def test_one_product_equals_the_sums_a_query_at_a_time(num_queries, seq_len, window):
    rng = np.random.default_rng(seq_len)
    probs, values, visible = attention_inputs(rng, num_queries, seq_len, 4, 24, window)
    batched = reference.seen_sums(probs, values, visible)
    by_query = reference.seen_sums_by_query(probs, values, visible)
    assert batched.shape == by_query.shape == (num_queries, 4, 24)
    np.testing.assert_allclose(batched, by_query, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_nonfinite_value_reaches_only_the_queries_that_see_it(bad):
    rng = np.random.default_rng(3)
    probs, values, visible = attention_inputs(rng, 6, 10, 2, 8, window=3)
    values[5, 1, 2] = bad   # key 5: seen by the queries at positions 5, 6 and 7 (window 3)
    out = reference.seen_sums(probs, values, visible)
    sees = visible[:, 5]
    assert sees.tolist() == [False, True, True, True, False, False]
    assert not np.isfinite(out[sees, 1, 2]).any()
    assert np.isfinite(np.delete(out, np.flatnonzero(sees), axis=0)).all()
    assert np.isfinite(out[:, 0]).all() and np.isfinite(np.delete(out[:, 1], 2, axis=-1)).all()
