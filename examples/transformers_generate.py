"""Generate with a transformers model over kvcupy's paged cache; print speed and KV bytes.

    python examples/transformers_generate.py --model random:llama-3-8b --layers 4 --kv-dtype int4_per_token_head
    python examples/transformers_generate.py --model /path/to/checkpoint --device cuda --dtype bfloat16 --json

--model is a checkpoint (a local folder, or a hub id where the hub is reachable)
or random:NAME, a model of that family's real geometry with random weights
(--layers shortens it). --kv-dtype is one of kvcupy's KV dtypes, or "dynamic":
transformers' own DynamicCache and attention (sdpa, or eager where the model has
none), the baseline. Prompts are random token ids, left-padded when --ragged.
Prefill and decode are timed apart: decode tokens/s is (generate with N new
tokens - generate with 1) over the N - 1 later tokens of every row.
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


def run(args) -> dict:
    dtype = getattr(torch, args.dtype)
    model = load_model(args.model, args.layers, dtype, args.device)
    config = model.config.get_text_config(decoder=True)
    input_ids, attention_mask = prompts(args.batch, args.prompt_len, args.ragged, config.vocab_size, args.device)
    max_tokens = args.batch * (args.prompt_len + args.new_tokens + 16)

    def cache():
        if args.kv_dtype == "dynamic":
            return transformers.DynamicCache(config=config)
        return PagedCache(model, args.kv_dtype, max_tokens=max_tokens, block_size=args.block_size)

    model.set_attn_implementation("kvcupy" if args.kv_dtype != "dynamic" else
                                  "eager" if isinstance(config, NO_SDPA) else "sdpa")

    def timed(new_tokens: int) -> tuple[float, torch.Tensor]:
        past = cache()
        synchronize(args.device)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, past_key_values=past,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        synchronize(args.device)
        return time.perf_counter() - start, out

    timed(2)   # warm-up: kernel compiles, allocator
    prefill = min(timed(1)[0] for _ in range(args.repeat))
    total, out = min((timed(args.new_tokens) for _ in range(args.repeat)), key=lambda r: r[0])
    decode = max(total - prefill, 1e-9)
    if args.kv_dtype == "dynamic":
        head_size = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        kv_bytes = config.num_hidden_layers * 2 * num_kv_heads * head_size * torch.finfo(dtype).bits // 8
    else:
        kv_bytes = cache().bytes_per_token
    real_prompt_tokens = int(attention_mask.sum())
    return {
        "model": args.model, "layers": config.num_hidden_layers, "kv_dtype": args.kv_dtype,
        "device": args.device, "dtype": args.dtype, "batch": args.batch, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "kvcupy": kc.__version__, "transformers": transformers.__version__,
        "prefill_s": prefill, "prefill_tokens_per_s": real_prompt_tokens / prefill,
        "decode_tokens_per_s": args.batch * (args.new_tokens - 1) / decode,
        "kv_bytes_per_token": kv_bytes, "last_tokens": out[0, -8:].tolist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:llama-3-8b",
                        help=f"a checkpoint, or random:NAME with NAME in {sorted(PRESETS)}")
    parser.add_argument("--layers", type=int, default=None, help="random models: this many layers")
    parser.add_argument("--kv-dtype", default="int4_per_token_head", choices=[*kc.KV_DTYPES, "dynamic"])
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
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return
    print(f"{result['model']} ({result['layers']} layers, {args.dtype}) on {args.device}, "
          f"KV {args.kv_dtype}: {result['kv_bytes_per_token']} bytes/token")
    print(f"prefill {result['prefill_tokens_per_s']:.1f} tokens/s ({result['prefill_s'] * 1e3:.1f} ms), "
          f"decode {result['decode_tokens_per_s']:.1f} tokens/s (batch {args.batch})")


if __name__ == "__main__":
    main()
