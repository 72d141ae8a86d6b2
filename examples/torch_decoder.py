"""The small decoder of `decoding.py` in torch, on the CPU or a CUDA device.

    python examples/torch_decoder.py [cpu|cuda] [auto|int8_per_token_head|int4_per_token_head|...]

generates greedily with kvcupy's PagedKVCache and with torch's own attention
over an unquantized cache, and prints how the two compare. kvcupy takes the
torch tensors as they are (DLPack, zero-copy) and answers with torch tensors
on the same device, on torch's current stream.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

try:
    from . import decoding
except ImportError:   # run as a script
    import decoding


class TorchDecoder:
    """forward(tokens, positions, attention) -> host logits [T, vocab], float32."""

    def __init__(self, config: decoding.Config, weights: dict[str, np.ndarray], device: str = "cpu"):
        self.config = config
        self.device = torch.device(device)
        self.weights = {name: torch.from_numpy(w).to(self.device) for name, w in weights.items()}

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        scale = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.config.norm_eps)
        return x * scale * self.weights[name]

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half rotary embedding (GPT-NeoX / Phi-3 layout) of x [T, heads, d]."""
        first, second = x.chunk(2, dim=-1)
        return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)

    def __call__(self, tokens: np.ndarray, positions: np.ndarray, attention) -> np.ndarray:
        config, w = self.config, self.weights
        angles = torch.from_numpy(decoding.rope_angles(config, positions)).to(self.device)
        cos, sin = torch.cos(angles)[:, None, :], torch.sin(angles)[:, None, :]
        x = w["embed"][torch.from_numpy(tokens).to(self.device)]
        count = x.shape[0]
        for layer in range(config.num_layers):
            h = self._norm(x, f"{layer}.attn_norm")
            query = self._rope((h @ w[f"{layer}.wq"]).view(count, config.num_heads, config.head_size), cos, sin)
            key = self._rope((h @ w[f"{layer}.wk"]).view(count, config.num_kv_heads, config.head_size), cos, sin)
            value = (h @ w[f"{layer}.wv"]).view(count, config.num_kv_heads, config.head_size)
            out = attention(layer, query, key, value)
            x = x + out.reshape(count, -1) @ w[f"{layer}.wo"]
            h = self._norm(x, f"{layer}.mlp_norm")
            gated = torch.nn.functional.silu(h @ w[f"{layer}.w_gate"]) * (h @ w[f"{layer}.w_up"])
            x = x + gated @ w[f"{layer}.w_down"]
        return (self._norm(x, "final_norm") @ w["lm_head"]).cpu().numpy()


class TorchAttention:
    """The reference: each sequence's K/V per layer in torch tensors, stored in
    float16 (an unquantized serving cache), attended by torch's
    scaled_dot_product_attention in float32 with a causal mask."""

    def __init__(self, config: decoding.Config):
        self.config = config
        self.keys: dict[int, list] = {}
        self.values: dict[int, list] = {}
        self._step = None

    def add(self) -> int:
        seq_id = len(self.keys)
        self.keys[seq_id] = [None] * self.config.num_layers
        self.values[seq_id] = [None] * self.config.num_layers
        return seq_id

    def fork(self, seq_id: int) -> int:
        new_id = self.add()
        self.keys[new_id] = list(self.keys[seq_id])      # tensors are only ever replaced, never changed
        self.values[new_id] = list(self.values[seq_id])
        return new_id

    def begin(self, seq_ids: list, counts: list[int]) -> None:
        self._step = (list(seq_ids), list(counts))

    def __call__(self, layer: int, query, key, value):
        seq_ids, counts = self._step
        outputs = []
        for seq_id, q, k, v in zip(seq_ids, query.split(counts), key.split(counts), value.split(counts)):
            keys = self._append(self.keys[seq_id], layer, k)
            values = self._append(self.values[seq_id], layer, v)
            outputs.append(self._attend(q, keys.float(), values.float()))
        return torch.cat(outputs)

    @staticmethod
    def _append(per_layer: list, layer: int, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.to(torch.float16)
        per_layer[layer] = rows if per_layer[layer] is None else torch.cat([per_layer[layer], rows])
        return per_layer[layer]

    def _attend(self, query, keys, values):
        """query [n, Hq, d], the sequence's last n positions, over keys/values [L, Hk, d]."""
        n, length = query.shape[0], keys.shape[0]
        group = self.config.num_heads // self.config.num_kv_heads
        keys, values = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (keys, values))
        # Query i sits at position length - n + i and sees positions up to it.
        mask = torch.arange(length, device=query.device)[None, :] <= torch.arange(
            length - n, length, device=query.device)[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(query.transpose(0, 1), keys, values, attn_mask=mask)
        return out.transpose(0, 1)


def run(kv_dtype: str, device: str = "cpu", steps: int = 8, fork=(1, 3)):
    """(reference, kvcupy forced to the reference's tokens, kvcupy free) Generations."""
    config = decoding.Config()
    model = TorchDecoder(config, decoding.random_weights(config), device)
    return decoding.compare(config, model, TorchAttention(config), kv_dtype, device, steps, fork)


if __name__ == "__main__":
    decoding.main(run, "torch", sys.argv)
