"""What `kvcupy.updated_cache` costs with and without donation (the README's figures).

    PYTHONPATH=. python3 tools/updated_cache_cost.py [cpu|gpu]

An int8 layer cache of 2048 pages x 16 tokens x 8 KV heads x 128 (69 MB with
its scales) in JAX arrays; 32 new tokens a call. Prints the median seconds of
a call without donation, with donate=True, and of the write kernel alone
(`reshape_and_cache` into a staging cache of one slot per token), after
warm-up calls (JAX compiles the scatter once per form). Needs jax.
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvcupy as kc

PAGES, BLOCK, HEADS, HEAD_SIZE, TOKENS = 2048, 16, 8, 128, 32
KV_DTYPE = "int8_per_token_head"


def median_seconds(call, repeats: int = 15) -> float:
    for _ in range(3):
        jax.block_until_ready(call())
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - begin)
    return float(np.median(times))


def main() -> None:
    platform = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    device = jax.devices(platform)[0]
    template = kc.allocate_cache(PAGES, BLOCK, HEADS, HEAD_SIZE, kv_dtype=KV_DTYPE)
    tensors = [jax.device_put(t, device) for t in template.tensors()]
    rng = np.random.default_rng(0)
    key = jax.device_put(rng.standard_normal((TOKENS, HEADS, HEAD_SIZE)).astype(np.float32), device)
    slots = jax.device_put(np.arange(TOKENS, dtype=np.int32) * 7, device)
    state = {"cache": kc.wrap_cache(*tensors, kv_dtype=KV_DTYPE)}

    def copying():
        return kc.updated_cache(key, key, state["cache"], slots).key_cache

    def donating():
        state["cache"] = kc.updated_cache(key, key, state["cache"], slots, donate=True)
        return state["cache"].key_cache

    staging = kc.allocate_cache(TOKENS, 1, HEADS, HEAD_SIZE, kv_dtype=KV_DTYPE,
                                device="cpu" if platform == "cpu" else "cuda")

    def write_kernel():
        kc.reshape_and_cache(key, key, staging, np.arange(TOKENS))
        return key

    cache_bytes = sum(t.nbytes for t in tensors)
    print(json.dumps({"platform": platform, "cache_mb": round(cache_bytes / 1e6, 1), "tokens": TOKENS,
                      "copying_s": median_seconds(copying), "donating_s": median_seconds(donating),
                      "write_kernel_s": median_seconds(write_kernel)}))


if __name__ == "__main__":
    main()
