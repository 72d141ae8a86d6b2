"""Generate with a transformers model over several KV caches in one process: speed,
peak GPU memory and KV bytes per token, kvcupy's paged caches beside transformers' own.

    python examples/transformers_generate.py --model random:llama-3-8b --layers 4 \
        --caches dynamic,int4_per_token_head,int8_per_token_head,fp8_per_token_head,hqq:4,quanto:4,fp8
    python examples/transformers_generate.py --model /path/to/checkpoint --device cuda --batch 16 \
        --prompt-len 8192 --new-tokens 256 --json

--model is a checkpoint (a local folder, or a hub id where the hub is reachable)
or random:NAME, a model of that family's real geometry with random weights
(--layers shortens it). --caches lists the caches to run, in turn on the same
model and prompts: one of kvcupy's KV dtypes (PagedCache, attn_implementation
"kvcupy"); "dynamic" (transformers' DynamicCache with sdpa, or eager where the
model has none: the baseline); "hqq:N", "quanto:N" (transformers'
QuantizedCache, N bits, with those packages installed) and "fp8" (its
per-tensor fp8 QuantizedCache). A cache whose backend cannot run here is
reported with the reason, not fatal. Prompts are random token ids,
left-padded when --ragged. Prefill and decode are timed apart: decode tokens/s
is (generate with N new tokens - generate with 1) over the N - 1 later tokens
of every row. Peak memory (CUDA) is the allocator's peak during the longest
generate, above what the model held before it.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

import kvcupy as kc
from kvcupy.integrations.transformers import PagedCache

# Real geometries (hidden, intermediate, layers, query heads, KV heads, head size, vocab).
PRESETS = {
    "llama-3-8b": (transformers.LlamaConfig, dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "phi-3-mini": (transformers.Phi3Config, dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=32, vocab_size=32064, sliding_window=2047)),
    "mistral-7b": (transformers.MistralConfig, dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=32000, sliding_window=4096)),
    "qwen2-7b": (transformers.Qwen2Config, dict(
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, vocab_size=152064,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "gemma-2-9b": (transformers.Gemma2Config, dict(
        hidden_size=3584, intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
        num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256, vocab_size=256000,
        sliding_window=4096)),
}
# transformers' attention for the baseline: sdpa where the family has it.
NO_SDPA = (transformers.Gemma2Config, transformers.GptOssConfig)


def load_model(name: str, layers: int | None, dtype: torch.dtype, device: str):
    if name.startswith("random:"):
        config_class, fields = PRESETS[name.removeprefix("random:")]
        config = config_class(**dict(fields, **({"num_hidden_layers": layers} if layers else {})))
        if getattr(config, "layer_types", None) is not None and layers:
            config.layer_types = config.layer_types[:layers]
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device)
    return model.eval()


def prompts(batch: int, length: int, ragged: bool, vocab: int, device: str):
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, vocab, (batch, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    if ragged:   # row b holds length - b * length / (2 * batch) real tokens, left-padded
        for row in range(batch):
            pads = row * length // (2 * batch)
            attention_mask[row, :pads] = 0
    return input_ids.to(device), attention_mask.to(device)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def cache_maker(kind: str, model, config, max_tokens: int, block_size: int):
    """(a function making a fresh cache of `kind`, the attention implementation it takes)."""
    own = "eager" if isinstance(config, NO_SDPA) else "sdpa"
    if kind in kc.KV_DTYPES:
        return (lambda: PagedCache(model, kind, max_tokens=max_tokens, block_size=block_size)), "kvcupy"
    if kind == "dynamic":
        return (lambda: transformers.DynamicCache(config=config)), own
    backend, _, bits = kind.partition(":")
    if backend in ("hqq", "quanto", "fp8"):
        options = {"nbits": int(bits)} if bits else {}
        return (lambda: transformers.QuantizedCache(backend, config, **options)), own
    raise ValueError(f"--caches: {kind!r} is not a KV dtype, dynamic, hqq:N, quanto:N or fp8")


def kv_bytes_per_token(kind: str, make_cache, config, dtype: torch.dtype) -> int | None:
    """What a cache holds a token, over every layer: kvcupy's format, or the model dtype's
    rows for DynamicCache; None for QuantizedCache (groups, scales and its full-precision
    residual tokens make it depend on the context)."""
    if kind in kc.KV_DTYPES:
        return make_cache().bytes_per_token
    if kind != "dynamic":
        return None
    head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_hidden_layers * 2 * num_kv_heads * head_size * torch.finfo(dtype).bits // 8


def run(args, model, kind: str) -> dict:
    dtype = getattr(torch, args.dtype)
    config = model.config.get_text_config(decoder=True)
    input_ids, attention_mask = prompts(args.batch, args.prompt_len, args.ragged, config.vocab_size, args.device)
    max_tokens = args.batch * (args.prompt_len + args.new_tokens + 16)
    cache, attention = cache_maker(kind, model, config, max_tokens, args.block_size)
    model.set_attn_implementation(attention)

    def timed(new_tokens: int) -> tuple[float, torch.Tensor]:
        past = cache()
        synchronize(args.device)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, past_key_values=past,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        synchronize(args.device)
        return time.perf_counter() - start, out

    record = {"model": args.model, "layers": config.num_hidden_layers, "cache": kind, "device": args.device,
              "dtype": args.dtype, "batch": args.batch, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "kvcupy": kc.__version__, "transformers": transformers.__version__}
    try:
        timed(2)   # warm-up: kernel compiles, allocator
    except Exception as error:   # e.g. a QuantizedCache backend whose package is not installed
        return {**record, "error": f"{type(error).__name__}: {error}"[:300]}
    prefill = min(timed(1)[0] for _ in range(args.repeat))
    cuda = args.device.startswith("cuda")
    if cuda:
        synchronize(args.device)
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    total, out = min((timed(args.new_tokens) for _ in range(args.repeat)), key=lambda r: r[0])
    decode = max(total - prefill, 1e-9)
    return {**record, "prefill_s": prefill, "prefill_tokens_per_s": int(attention_mask.sum()) / prefill,
            "decode_tokens_per_s": args.batch * (args.new_tokens - 1) / decode,
            "peak_memory_bytes": torch.cuda.max_memory_allocated() - held if cuda else None,
            "kv_bytes_per_token": kv_bytes_per_token(kind, cache, config, dtype),
            "last_tokens": out[0, -8:].tolist()}


def table(records: list) -> str:
    lines = ["| cache | prefill tokens/s | decode tokens/s | peak memory (MiB) | KV bytes/token |",
             "|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['cache']} | {r['error']} | | | |")
            continue
        peak = "-" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2 ** 20:.0f}"
        kv = "-" if r["kv_bytes_per_token"] is None else str(r["kv_bytes_per_token"])
        lines.append(f"| {r['cache']} | {r['prefill_tokens_per_s']:.1f} | {r['decode_tokens_per_s']:.1f} | "
                     f"{peak} | {kv} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:llama-3-8b",
                        help=f"a checkpoint, or random:NAME with NAME in {sorted(PRESETS)}")
    parser.add_argument("--layers", type=int, default=None, help="random models: this many layers")
    parser.add_argument("--caches", default="dynamic,int4_per_token_head,int8_per_token_head,fp8_per_token_head",
                        help="comma-separated: kvcupy KV dtypes, dynamic, hqq:N, quanto:N, fp8")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["float16", "bfloat16", "float32"],
                        help="model dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--ragged", action="store_true", help="left-pad rows to different lengths")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs; the fastest counts")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    model = load_model(args.model, args.layers, getattr(torch, args.dtype), args.device)
    records = [run(args, model, kind.strip()) for kind in args.caches.split(",") if kind.strip()]
    if args.json:
        print(json.dumps(records, indent=1))
        return
    print(f"{args.model} ({records[0]['layers']} layers, {args.dtype}) on {args.device}, batch {args.batch}, "
          f"prompts of {args.prompt_len}, {args.new_tokens} new tokens")
    print(table(records))


if __name__ == "__main__":
    main()
