"""The small decoder of `decoding.py` in JAX, on the CPU or a GPU.

    python examples/jax_decoder.py [cpu|cuda] [auto|int8_per_token_head|int4_per_token_head|...]

generates greedily with kvcupy's PagedKVCache and with JAX's own attention
over an unquantized cache, and prints how the two compare. JAX arrays are
immutable, so the paged cache is kvcupy's (NumPy or CuPy memory); queries,
keys and values go in as JAX arrays and attention comes back as JAX arrays on
the same device (DLPack, zero-copy). Matrix products run at full float32
precision ("highest"), so that the two attentions differ only in the order
of their sums, not by TF32 roundings of the model around them.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

try:
    from . import decoding
except ImportError:   # run as a script
    import decoding


def jax_device(device: str):
    """"cpu" or "cuda" / "cuda:i" as a JAX device."""
    kind, _, index = device.partition(":")
    return jax.devices("cpu" if kind == "cpu" else "gpu")[int(index or 0)]


def _norm(config: decoding.Config, x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + config.norm_eps) * scale


def _rope(x, cos, sin):
    """Rotate-half rotary embedding (GPT-NeoX / Phi-3 layout) of x [T, heads, d]."""
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


# Jitted around the attention call, which runs kvcupy (eagerly, outside jit): one
# compile per token count, not one per operation and shape.
@functools.partial(jax.jit, static_argnums=0)
def _project(config: decoding.Config, w: dict, x, cos, sin):
    """A layer's query [T, Hq, d], key and value [T, Hk, d]."""
    count, d = x.shape[0], config.head_size
    h = _norm(config, x, w["attn_norm"])
    query = _rope((h @ w["wq"]).reshape(count, config.num_heads, d), cos, sin)
    key = _rope((h @ w["wk"]).reshape(count, config.num_kv_heads, d), cos, sin)
    return query, key, (h @ w["wv"]).reshape(count, config.num_kv_heads, d)


@functools.partial(jax.jit, static_argnums=0)
def _finish(config: decoding.Config, w: dict, x, out):
    """The layer's output: attention projected back and added, then the MLP."""
    x = x + out.reshape(x.shape[0], -1) @ w["wo"]
    h = _norm(config, x, w["mlp_norm"])
    return x + (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]


class JaxDecoder:
    """forward(tokens, positions, attention) -> host logits [T, vocab], float32."""

    def __init__(self, config: decoding.Config, weights: dict[str, np.ndarray], device: str = "cpu"):
        self.config = config
        self.device = jax_device(device)
        placed = {name: jax.device_put(w, self.device) for name, w in weights.items()}
        self.layers = [{name.split(".", 1)[1]: w for name, w in placed.items() if name.startswith(f"{layer}.")}
                       for layer in range(config.num_layers)]
        self.weights = {name: w for name, w in placed.items() if "." not in name}

    def __call__(self, tokens: np.ndarray, positions: np.ndarray, attention) -> np.ndarray:
        with jax.default_matmul_precision("highest"):
            return np.asarray(self._forward(tokens, positions, attention))

    def _forward(self, tokens, positions, attention):
        config = self.config
        angles = jax.device_put(decoding.rope_angles(config, positions), self.device)
        cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
        x = self.weights["embed"][jax.device_put(tokens, self.device)]
        for layer, w in enumerate(self.layers):
            query, key, value = _project(config, w, x, cos, sin)
            x = _finish(config, w, x, attention(layer, query, key, value))
        return _norm(config, x, self.weights["final_norm"]) @ self.weights["lm_head"]


@jax.jit
def _append(buffer, rows, start):
    """buffer [capacity, Hk, d] float16 with rows written from position `start`."""
    return jax.lax.dynamic_update_slice(buffer, rows.astype(buffer.dtype), (start, 0, 0))


@jax.jit
def _attend(query, keys, values, length):
    """query [n, Hq, d], the last n of a sequence's `length` positions, over the
    sequence's buffers [capacity, Hk, d]; rows past `length` are masked out (their
    weights are exactly zero), so one compile serves every length."""
    n, capacity = query.shape[0], keys.shape[0]
    positions = length - n + jnp.arange(n)
    mask = jnp.arange(capacity)[None, :] <= positions[:, None]
    out = jax.nn.dot_product_attention(query[None], keys.astype(jnp.float32)[None],
                                       values.astype(jnp.float32)[None], mask=mask[None, None],
                                       implementation="xla")
    return out[0]


class JaxAttention:
    """The reference: each sequence's K/V per layer in JAX arrays, stored in
    float16 (an unquantized serving cache), attended by jax.nn.dot_product_attention
    in float32 with a causal mask (GQA by its own head grouping)."""

    def __init__(self, config: decoding.Config, device, capacity: int = 64):
        self.config = config
        empty = jnp.zeros((capacity, config.num_kv_heads, config.head_size), jnp.float16)
        self._empty = [jax.device_put(empty, device)] * config.num_layers
        self.keys: dict[int, list] = {}
        self.values: dict[int, list] = {}
        self.lengths: dict[int, int] = {}
        self._step = None

    def add(self) -> int:
        seq_id = len(self.keys)
        self.keys[seq_id], self.values[seq_id] = list(self._empty), list(self._empty)
        self.lengths[seq_id] = 0
        return seq_id

    def fork(self, seq_id: int) -> int:
        new_id = self.add()
        self.keys[new_id] = list(self.keys[seq_id])      # JAX arrays: sharing them is free and safe
        self.values[new_id] = list(self.values[seq_id])
        self.lengths[new_id] = self.lengths[seq_id]
        return new_id

    def begin(self, seq_ids: list, counts: list[int]) -> None:
        self._step = (list(seq_ids), list(counts))
        for seq_id, count in zip(seq_ids, counts):
            self.lengths[seq_id] += count

    def __call__(self, layer: int, query, key, value):
        seq_ids, counts = self._step
        bounds = np.cumsum(counts)[:-1]
        outputs = []
        for seq_id, q, k, v in zip(seq_ids, jnp.split(query, bounds), jnp.split(key, bounds),
                                   jnp.split(value, bounds)):
            length = self.lengths[seq_id]
            start = length - q.shape[0]
            self.keys[seq_id][layer] = _append(self.keys[seq_id][layer], k, start)
            self.values[seq_id][layer] = _append(self.values[seq_id][layer], v, start)
            outputs.append(_attend(q, self.keys[seq_id][layer], self.values[seq_id][layer], length))
        return jnp.concatenate(outputs)


def run(kv_dtype: str, device: str = "cpu", steps: int = 8, fork=(1, 3)):
    """(reference, kvcupy forced to the reference's tokens, kvcupy free) Generations."""
    config = decoding.Config()
    model = JaxDecoder(config, decoding.random_weights(config), device)
    return decoding.compare(config, model, JaxAttention(config, model.device), kv_dtype, device, steps, fork)


if __name__ == "__main__":
    decoding.main(run, "JAX", sys.argv)
