"""transformers models generate over kvcupy's paged cache as over their own.

Six real model classes, each with random weights from its family's config
scaled down in layers and width (head size, GQA ratio, rope base, biases,
window and softcap kept or stated): generate(past_key_values=PagedCache(model,
kv_dtype)) with attn_implementation="kvcupy" against the same model with
transformers' own attention over its DynamicCache (sdpa; eager for Gemma-2 and
gpt-oss, which have no sdpa path). Greedy, three left-padded prompts of 5, 11 and 17 tokens
in one batch, 8 new tokens.

- "auto" (the model dtype, float32, stored as is) generates the same tokens,
  and its logits agree to float32 rounding (on a GPU: to the kernels' fp16
  operands, AUTO_BOUND_GPU).
- int8 / fp8 / int4 are given the reference's tokens (a logits processor forces
  them; generate records the logits before it), so every step's logits compare
  at the same context; their relative error is bounded and reported.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList  # noqa: E402

import kvcupy as kc  # noqa: E402
from kvcupy.integrations.transformers import PagedCache  # noqa: E402

PROMPT_LENS = (5, 11, 17)
NEW_TOKENS = 8
VOCAB = 512
# Trained models attend sharply; freshly initialised ones almost uniformly
# (score std about 0.1 at initializer_range 0.02). Scaling q_proj and k_proj by
# 4 each gives scores of std about 1.6 and peaks near 6, so that quantization
# error reaches the softmax as it would in a real model, and softcap bends.
QK_SHARPEN = 4.0

# Relative logits error, max over rows and steps of |l - l_ref| / |l_ref|.
# "auto" stores float32 as given: what remains is float32 rounding of a
# reassociated sum (measured <= 1e-6). The quantized bounds follow each format's
# rounding step relative to a vector's spread (int8: absmax / 127; fp8 e4m3:
# 2^-4 of each value; int4: range / 15, about 16 times int8's), and sit about
# twice above the largest measured on these six models on the CPU (int8 0.021,
# fp8 0.064, int4 0.28): random weights have no outlier channels and small
# logit margins, so these are larger than trained models show.
LOGITS_BOUND = {"auto": 1e-5, "int8_per_token_head": 0.04, "fp8_per_token_head": 0.13,
                "int4_per_token_head": 0.5}
# On a GPU "auto" runs the model in float16 (the kernels attend over 16-bit or
# quantized rows): both sides read the same fp16 rows, and what differs is the
# kernels' fp16 probabilities (2^-11 relative) and fp32 sums in another order,
# attention within 2e-3 of exact (tests/gpu/test_attention.py), which the logits
# inherit. A greedy token may flip where the reference's top two logits lie
# closer than that.
AUTO_BOUND_GPU = 5e-3
AUTO_MODEL_DTYPE = {"cpu": torch.float32, "cuda": torch.float16}
QUANTIZED = ("int8_per_token_head", "fp8_per_token_head", "int4_per_token_head")

_COMMON = dict(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=512, pad_token_id=0,
               bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)


def _llama():
    # Llama-3-8B: head size 128, 32/8 heads (GQA 4), rope base 500000.
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
        head_dim=128, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        rms_norm_eps=1e-5, **_COMMON)


def _phi3():
    # Phi-3-mini: head size 96 (3072 / 32), no GQA, fused qkv_proj, window 2047.
    return transformers.Phi3ForCausalLM, transformers.Phi3Config(
        hidden_size=192, intermediate_size=384, num_attention_heads=2, num_key_value_heads=2,
        sliding_window=2047, original_max_position_embeddings=4096, **_COMMON)


def _mistral():
    # Mistral-7B: sliding window on every layer (4096 there; 8 here, so prompts and
    # decode both cross it), GQA 4 -> 2.
    return transformers.MistralForCausalLM, transformers.MistralConfig(
        hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, sliding_window=8, **_COMMON)


def _gemma2():
    # Gemma-2-2B: head size 256, scale 1/sqrt(query_pre_attn_scalar), sliding and full
    # layers alternating, attention softcap (50 there; 3 here, where scores peak near 3.4)
    # and final-logit softcap.
    return transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=256, query_pre_attn_scalar=256, sliding_window=8, attn_logit_softcapping=3.0,
        final_logit_softcapping=30.0, layer_types=["sliding_attention", "full_attention"], **_COMMON)


def _qwen2():
    # Qwen2-0.5B: head size 64, biases in q/k/v (random here, not zero), rope base 1e6;
    # 7 query heads on one KV head.
    return transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        hidden_size=448, intermediate_size=512, num_attention_heads=7, num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **_COMMON)


def _gpt_oss():
    # gpt-oss-20b: a learned sink logit per query head, sliding and full layers
    # alternating, biases in q/k/v/o, YaRN rope, mixture of experts (4 here, 2 a token).
    return transformers.GptOssForCausalLM, transformers.GptOssConfig(
        hidden_size=128, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], **dict(_COMMON, max_position_embeddings=131072))


MODELS = {"llama3": _llama, "phi3": _phi3, "mistral": _mistral, "gemma2": _gemma2, "qwen2": _qwen2,
          "gpt_oss": _gpt_oss}
# transformers' own attention for each family (Gemma-2 and gpt-oss refuse sdpa: softcap, sinks).
REFERENCE_ATTENTION = {"gemma2": "eager", "gpt_oss": "eager"}

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def build_model(name: str, device: str = "cpu", dtype=torch.float32):
    """The family's model with seeded random weights, attention sharpened, on `device`."""
    model_class, config = MODELS[name]()
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "q_proj"):
                module.q_proj.weight.mul_(QK_SHARPEN)
                module.k_proj.weight.mul_(QK_SHARPEN)
                for projection in (module.q_proj, module.k_proj, module.v_proj):
                    if projection.bias is not None:
                        projection.bias.normal_(0.0, 0.5)
            if hasattr(module, "sinks"):   # gpt-oss initialises them at zero
                module.sinks.normal_(0.0, 1.0)
            elif hasattr(module, "qkv_proj"):   # Phi-3: [q; k; v] rows
                rows = (config.num_attention_heads + config.num_key_value_heads) * module.head_dim
                module.qkv_proj.weight[:rows].mul_(QK_SHARPEN)
    return model.to(device, dtype)


def padded_prompts(device: str = "cpu"):
    """input_ids and attention_mask of PROMPT_LENS prompts, left-padded with token 0."""
    generator = torch.Generator().manual_seed(1)
    width = max(PROMPT_LENS)
    input_ids = torch.randint(3, VOCAB, (len(PROMPT_LENS), width), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, length in enumerate(PROMPT_LENS):
        input_ids[row, :width - length] = 0
        attention_mask[row, :width - length] = 0
    return input_ids.to(device), attention_mask.to(device)


class ForceTokens(LogitsProcessor):
    """Makes generate pick `sequences`' next token at every step."""

    def __init__(self, sequences):
        self.sequences = sequences

    def __call__(self, input_ids, scores):
        forced = self.sequences[:, input_ids.shape[1]]
        out = torch.full_like(scores, -math.inf)
        out[torch.arange(len(forced)), forced] = 0.0
        return out


def generate(model, attention: str, past_key_values, device: str, **kwargs):
    model.set_attn_implementation(attention)
    input_ids, attention_mask = padded_prompts(device)
    with torch.no_grad():
        return model.generate(input_ids=input_ids, attention_mask=attention_mask,
                              max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True,
                              output_logits=True, past_key_values=past_key_values, **kwargs)


def reference(model, name: str, device: str, **kwargs):
    config = model.config.get_text_config(decoder=True)
    return generate(model, REFERENCE_ATTENTION.get(name, "sdpa"), DynamicCache(config=config), device, **kwargs)


def logits_error(result, expected) -> float:
    """Max over steps and rows of the relative L2 error of the logits."""
    return max(float(((got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1)).max())
               for got, want in zip(result.logits, expected.logits))


def auto_bound(device: str) -> float:
    return LOGITS_BOUND["auto"] if device == "cpu" else AUTO_BOUND_GPU


def assert_same_tokens(result, expected, case: str, device: str) -> None:
    """Equal tokens; on a GPU, a first difference only where the reference's top two
    logits at that step lie within the GPU's error of each other (a near-tie)."""
    new = result.sequences.shape[1] - len(result.logits)
    differ = (result.sequences[:, new:] != expected.sequences[:, new:]).any(dim=0).nonzero()
    if not differ.numel():
        return
    step = int(differ[0])
    assert device != "cpu", f"{case}: tokens differ from step {step}\n{result.sequences}\n{expected.sequences}"
    logits = expected.logits[step].float()
    top2 = logits.topk(2, dim=-1).values
    margin = float(((top2[:, 0] - top2[:, 1]) / logits.norm(dim=-1)).min())
    assert margin <= 2 * AUTO_BOUND_GPU, (
        f"{case}: tokens differ from step {step}, where the reference's margin is {margin:.1e}")


def require_device(device: str) -> None:
    if device == "cpu":
        return
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    if not kc.backends.status("cuda").usable:
        pytest.skip(f"kvcupy's CUDA backend is not usable here: {kc.backends.status('cuda').detail}")


class _ErrorTable:
    """A pytest plugin: prints the logits errors measured, in the terminal summary."""

    def __init__(self):
        self.errors: dict = {}

    def pytest_terminal_summary(self, terminalreporter):
        if not self.errors:
            return
        terminalreporter.section("kvcupy in transformers: relative logits error (max over rows and steps)")
        for (name, device), errors in sorted(self.errors.items()):
            cells = "  ".join(f"{kv_dtype.split('_')[0]} {errors[kv_dtype]:.2e}"
                              for kv_dtype in LOGITS_BOUND if kv_dtype in errors)
            terminalreporter.write_line(f"{name:8s} {device:5s} {cells}")


@pytest.fixture(scope="module")
def measured(request):
    """name, device -> kv_dtype -> logits error; the terminal summary shows them."""
    table = _ErrorTable()
    request.config.pluginmanager.register(table)
    return table.errors


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_auto_cache_generates_the_reference_tokens(name, device, measured):
    require_device(device)
    model = build_model(name, device, AUTO_MODEL_DTYPE[device])
    expected = reference(model, name, device)
    result = generate(model, "kvcupy", PagedCache(model, "auto"), device)
    assert_same_tokens(result, expected, f"{name} on {device}", device)
    forced = generate(model, "kvcupy", PagedCache(model, "auto"), device,
                      logits_processor=LogitsProcessorList([ForceTokens(expected.sequences)]))
    error = logits_error(forced, expected)
    measured.setdefault((name, device), {})["auto"] = error
    assert error <= auto_bound(device), f"{name} on {device}: auto logits error {error:.2e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_quantized_cache_logits_error_is_bounded(name, device, measured, record_property):
    require_device(device)
    model = build_model(name, device)
    expected = reference(model, name, device)
    force = LogitsProcessorList([ForceTokens(expected.sequences)])
    for kv_dtype in QUANTIZED:
        result = generate(model, "kvcupy", PagedCache(model, kv_dtype), device, logits_processor=force)
        assert torch.equal(result.sequences, expected.sequences)
        error = logits_error(result, expected)
        measured.setdefault((name, device), {})[kv_dtype] = error
        record_property(f"logits_error_{kv_dtype}", error)
        assert error <= LOGITS_BOUND[kv_dtype], (
            f"{name} on {device}, {kv_dtype}: relative logits error {error:.3e} > {LOGITS_BOUND[kv_dtype]}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["llama3", "gemma2"])
def test_chunked_prefill_generates_the_reference_tokens(name, device):
    """generate's prefill_chunk_size: 4-token chunks, the short rows' first chunks all padding."""
    require_device(device)
    model = build_model(name, device, AUTO_MODEL_DTYPE[device])
    expected = reference(model, name, device)
    force = LogitsProcessorList([ForceTokens(expected.sequences)])
    result = generate(model, "kvcupy", PagedCache(model, "auto"), device, prefill_chunk_size=4,
                      logits_processor=force)
    assert logits_error(result, expected) <= auto_bound(device)
    result = generate(model, "kvcupy", PagedCache(model, "auto"), device, prefill_chunk_size=4)
    assert_same_tokens(result, expected, f"{name} on {device}, chunked prefill", device)


def test_beam_search_forks_rows():
    """Beam search reorders rows every step: forks of kvcupy sequences, pages shared.
    (On the CPU, where "auto" is exact: beam scores have near-ties a GPU's rounding may flip.)"""
    device = "cpu"
    model = build_model("mistral", device)
    expected = reference(model, "mistral", device, num_beams=3)
    result = generate(model, "kvcupy", PagedCache(model, "auto"), device, num_beams=3)
    assert torch.equal(result.sequences, expected.sequences)


def test_a_second_generate_continues_the_cache():
    """The same cache, given the first call's sequences plus one more token: generate
    feeds only the new positions, as with transformers' own cache."""
    device = "cpu"
    model = build_model("qwen2", device)
    results = []
    for attention, cache in (("sdpa", DynamicCache(config=model.config)), ("kvcupy", PagedCache(model, "auto"))):
        first = generate(model, attention, cache, device)
        sequences = torch.cat([first.sequences, torch.full_like(first.sequences[:, :1], 7)], dim=1)
        _, attention_mask = padded_prompts(device)
        attention_mask = torch.cat([attention_mask, torch.ones_like(sequences[:, attention_mask.shape[1]:])], 1)
        with torch.no_grad():
            results.append(model.generate(input_ids=sequences, attention_mask=attention_mask,
                                          past_key_values=cache, max_new_tokens=4, do_sample=False))
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("device", DEVICES)
def test_cache_bytes_per_token(device):
    """int4 stores d/2 bytes and a float32 scale per head and token, K and V, every layer."""
    require_device(device)
    model = build_model("llama3", device, AUTO_MODEL_DTYPE[device])
    config = model.config
    assert PagedCache(model, "int4_per_token_head").bytes_per_token == (
        config.num_hidden_layers * 2 * config.num_key_value_heads * (config.head_dim // 2 + 4))
    itemsize = torch.tensor([], dtype=AUTO_MODEL_DTYPE[device]).element_size()   # auto keeps the model's rows
    assert PagedCache(model, "auto").bytes_per_token == (
        config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * itemsize)


def test_the_readme_recipe_runs_as_written():
    """README.md's transformers snippet, with a model and inputs of these tests."""
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    recipe = next(block for block in re.findall(r"```python\n(.*?)```", readme, re.S)
                  if block.startswith("from kvcupy.integrations.transformers"))
    input_ids, attention_mask = padded_prompts()
    namespace = dict(model=build_model("llama3"), inputs=dict(input_ids=input_ids, attention_mask=attention_mask))
    with torch.no_grad():
        exec(compile(recipe, "README.md (transformers recipe)", "exec"), namespace)
    assert namespace["out"].shape[0] == len(PROMPT_LENS) and namespace["out"].shape[1] > input_ids.shape[1]


def test_the_example_bench_runs_every_cache_kind_in_one_process():
    """examples/transformers_generate.py: kvcupy's caches beside DynamicCache and
    transformers' fp8 QuantizedCache on one model; a backend that is not installed
    (quanto here) is reported, not fatal."""
    import argparse
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "examples" / "transformers_generate.py"
    spec = importlib.util.spec_from_file_location("transformers_generate", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(model="tiny llama", dtype="float32", device="cpu", batch=2, prompt_len=8,
                              new_tokens=3, block_size=16, ragged=True, repeat=1)
    model = build_model("llama3")
    records = [bench.run(args, model, kind) for kind in ("dynamic", "int4_per_token_head", "fp8")]
    assert [r["cache"] for r in records] == ["dynamic", "int4_per_token_head", "fp8"]
    for record in records:
        assert "error" not in record, record
        assert record["decode_tokens_per_s"] > 0 and record["prefill_tokens_per_s"] > 0
    dense, int4 = records[0]["kv_bytes_per_token"], records[1]["kv_bytes_per_token"]
    assert int4 < 0.3 * dense, (int4, dense)
    missing = bench.run(args, model, "quanto:4") if importlib.util.find_spec("optimum") is None else None
    assert missing is None or "error" in missing
    assert "| int4_per_token_head |" in bench.table(records)
