"""What PagedCache and attn_implementation="kvcupy" cannot honour, they refuse:
each case raises an error that names the way out, rather than computing
something else."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

import kvcupy as kc  # noqa: E402
from kvcupy.integrations.transformers import PagedCache  # noqa: E402

from .test_transformers_generate import MODELS, build_model, padded_prompts  # noqa: E402


@pytest.fixture(scope="module")
def model():
    return build_model("llama3")


def forward(model, cache, input_ids, attention_mask=None):
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=cache)


def test_the_cache_refuses_another_attention(model):
    model.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match=r"set_attn_implementation\('kvcupy'\)"):
        forward(model, PagedCache(model, "int8_per_token_head"), torch.tensor([[5, 6, 7]]))


def test_the_attention_refuses_another_cache(model):
    model.set_attn_implementation("kvcupy")
    with pytest.raises(ValueError, match=r"past_key_values=PagedCache"):
        forward(model, DynamicCache(config=model.config), torch.tensor([[5, 6, 7]]))


def test_a_hole_in_a_row_is_refused(model):
    """A row whose real tokens are not one run (here: real, pad, real) would need a
    mask inside a sequence; kvcupy attends causally over each row's tokens."""
    model.set_attn_implementation("kvcupy")
    input_ids = torch.tensor([[5, 6, 0, 8], [5, 6, 7, 8]])
    attention_mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match="row 0: its real tokens are not one contiguous run"):
        forward(model, PagedCache(model, "auto"), input_ids, attention_mask)


def test_right_padding_then_more_tokens_is_refused(model):
    """Right padding is fine for one pass; a later real token after the pads is a hole."""
    model.set_attn_implementation("kvcupy")
    cache = PagedCache(model, "auto")
    forward(model, cache, torch.tensor([[5, 6, 0], [5, 6, 7]]), torch.tensor([[1, 1, 0], [1, 1, 1]]))
    with pytest.raises(ValueError, match="row 0"):
        forward(model, cache, torch.tensor([[9], [9]]), torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]]))


def test_a_mask_that_disagrees_with_the_cache_is_refused(model):
    model.set_attn_implementation("kvcupy")
    cache = PagedCache(model, "auto")
    forward(model, cache, torch.tensor([[5, 6, 7]]), torch.tensor([[1, 1, 1]]))
    with pytest.raises(ValueError, match="marks 2 earlier real tokens; the cache holds 3"):
        forward(model, cache, torch.tensor([[9]]), torch.tensor([[0, 1, 1, 1]]))


def test_bidirectional_attention_is_refused():
    model = build_model("llama3")
    model.config.is_causal = False
    model.set_attn_implementation("kvcupy")
    with pytest.raises(NotImplementedError, match="mask pattern"):
        forward(model, PagedCache(model, "auto"), torch.tensor([[5, 6, 7]]))


def test_gradients_are_refused(model):
    model.set_attn_implementation("kvcupy")
    with pytest.raises(NotImplementedError, match="no backward"):
        model(input_ids=torch.tensor([[5, 6, 7]]), past_key_values=PagedCache(model, "auto"))


def test_crop_is_refused(model):
    with pytest.raises(NotImplementedError, match="only grows"):
        PagedCache(model, "auto").crop(-1)


def test_another_batch_size_is_refused(model):
    model.set_attn_implementation("kvcupy")
    cache = PagedCache(model, "auto")
    forward(model, cache, torch.tensor([[5, 6, 7]]))
    with pytest.raises(ValueError, match="the batch has 2 rows; this cache holds 1"):
        forward(model, cache, torch.tensor([[8], [9]]))


def test_a_full_cache_names_max_tokens(model):
    model.set_attn_implementation("kvcupy")
    input_ids, attention_mask = padded_prompts()
    with pytest.raises(kc.CacheFullError, match=r"max_tokens"):
        forward(model, PagedCache(model, "int4_per_token_head", max_tokens=16), input_ids, attention_mask)


def test_unsupported_layer_types_are_refused():
    model = build_model("mistral")
    model.config.layer_types = ["chunked_attention"] * model.config.num_hidden_layers
    model.config.attention_chunk_size = 4
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        PagedCache(model, "auto")


def test_reset_frees_every_page(model):
    model.set_attn_implementation("kvcupy")
    cache = PagedCache(model, "int8_per_token_head")
    input_ids, attention_mask = padded_prompts()
    forward(model, cache, input_ids, attention_mask)
    assert cache.manager.stats().tokens == sum((5, 11, 17))   # pads are never stored
    cache.reset()
    assert cache.manager.stats().pages_used == 0 and cache.get_seq_length() == 0
    forward(model, cache, input_ids, attention_mask)          # and the cache serves a new batch


def test_float32_rows_off_the_cpu_are_refused():
    """The GPU kernels attend over 16-bit or quantized rows: an auto cache of a float32
    model on a GPU is refused when made, naming the ways out (a meta-device model
    stands in for a GPU one: the check reads only where the parameters live)."""
    model_class, config = MODELS["llama3"]()
    with torch.device("meta"):
        on_meta = model_class(config)
    with pytest.raises(ValueError, match="float16 or bfloat16 or take a quantized kv_dtype"):
        PagedCache(on_meta, "auto")
