"""Greedy decoding of a small random-weight transformer, framework-neutral parts.

The model is Phi-3-like, scaled down: RMSNorm, rotary embeddings, grouped-query
attention with head size 96 (Phi-3's), a SwiGLU MLP, untied embeddings.
`torch_decoder.py` and `jax_decoder.py` implement its forward pass; both take
their weights from `random_weights`, so the two frameworks run the same model.

A forward pass hands each layer's attention to an *attention* object: K/V of
the step's new tokens go in, their attention output comes out. Two kinds:

- `PagedAttention` (here): kvcupy's PagedKVCache, any KV dtype; the arrays
  pass through in the caller's framework, on its device.
- a framework-native one (in each decoder module): K/V kept per sequence,
  rounded to float16 as an unquantized serving cache stores them, and the
  framework's own attention in float32. This is the reference.

`generate` runs prefill, then decode steps, over several sequences of
different lengths, forking one of them mid-way (the fork starts from its
parent's second-best token, so that the two then differ).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import kvcupy as kc


@dataclass(frozen=True)
class Config:
    vocab_size: int = 512
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2          # GQA: two query heads per KV head
    head_size: int = 96            # Phi-3's head size (not a power of two)
    intermediate_size: int = 768
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def hidden_size(self) -> int:
        return self.num_heads * self.head_size


def random_weights(config: Config, seed: int = 3) -> dict[str, np.ndarray]:
    """float32 weights, each matrix scaled by 1/sqrt(fan_in) so that activations
    and logits stay of order one through the layers."""
    rng = np.random.default_rng(seed)
    hidden, inner = config.hidden_size, config.intermediate_size
    kv_width = config.num_kv_heads * config.head_size

    def matrix(rows, columns):
        return (rng.standard_normal((rows, columns)) / np.sqrt(rows)).astype(np.float32)

    weights = {"embed": rng.standard_normal((config.vocab_size, hidden)).astype(np.float32),
               "final_norm": np.ones(hidden, np.float32),
               "lm_head": matrix(hidden, config.vocab_size)}
    for layer in range(config.num_layers):
        weights.update({
            f"{layer}.attn_norm": np.ones(hidden, np.float32),
            f"{layer}.wq": matrix(hidden, hidden),
            f"{layer}.wk": matrix(hidden, kv_width),
            f"{layer}.wv": matrix(hidden, kv_width),
            f"{layer}.wo": matrix(hidden, hidden),
            f"{layer}.mlp_norm": np.ones(hidden, np.float32),
            f"{layer}.w_gate": matrix(hidden, inner),
            f"{layer}.w_up": matrix(hidden, inner),
            f"{layer}.w_down": matrix(inner, hidden),
        })
    return weights


def rope_angles(config: Config, positions: np.ndarray) -> np.ndarray:
    """[T, head_size / 2] rotation angles of each token's position (float32)."""
    half = config.head_size // 2
    inverse_frequencies = config.rope_theta ** (-np.arange(half, dtype=np.float64) / half)
    return (positions[:, None] * inverse_frequencies[None, :]).astype(np.float32)


class PagedAttention:
    """Attention through kvcupy's PagedKVCache: a step reserves the new tokens'
    slots once; each layer writes its K/V there and attends over its pages."""

    def __init__(self, config: Config, kv_dtype: str, device: str = "cpu", num_blocks: int = 32,
                 block_size: int = 16):
        self.cache = kc.PagedKVCache(config.num_layers, num_blocks, block_size, config.num_kv_heads,
                                     config.head_size, kv_dtype=kv_dtype, device=device, dtype="float16")
        self._step = None

    def add(self):
        return self.cache.add_sequence()

    def fork(self, seq_id):
        return self.cache.fork(seq_id)

    def begin(self, seq_ids: list, counts: list[int]) -> None:
        self._step = (list(seq_ids), list(counts), self.cache.reserve(seq_ids, counts))

    def __call__(self, layer: int, query, key, value):
        seq_ids, counts, slot_mapping = self._step
        self.cache.write(layer, key, value, slot_mapping)
        return self.cache.attention(layer, query, seq_ids, query_lens=counts)


@dataclass
class Generation:
    """tokens[i]: the tokens sequence i generated (i = prompt index; the fork is
    the last); logits[i]: the logits each of those tokens was chosen from."""

    tokens: list[list[int]] = field(default_factory=list)
    logits: list[list[np.ndarray]] = field(default_factory=list)


def prompts(config: Config, lengths=(5, 17, 30), seed: int = 1) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, config.vocab_size, n) for n in lengths]


def generate(forward, attention, prompt_tokens: list[np.ndarray], steps: int, fork: tuple[int, int],
             forced: Generation | None = None) -> Generation:
    """Prefill every prompt in one batch, then `steps` decode steps; before decode
    step fork[1], sequence fork[0] is forked. forward(tokens, positions, attention)
    -> [T, vocab] host logits. forced: feed these tokens instead of the argmax
    (teacher forcing), so that logits stay comparable after a first disagreement."""
    fork_parent, fork_step = fork
    ids = [attention.add() for _ in prompt_tokens]
    lengths = [len(p) for p in prompt_tokens]
    result = Generation([[] for _ in prompt_tokens], [[] for _ in prompt_tokens])

    def choose(i: int, row: np.ndarray, rank: int = 0) -> None:
        """Sequence i's next token: forced, else the rank-th best of its logits."""
        made = len(result.tokens[i])
        result.tokens[i].append(forced.tokens[i][made] if forced else int(np.argsort(row)[-1 - rank]))
        result.logits[i].append(row)

    logits = _step(forward, attention, ids, lengths, [0] * len(ids), np.concatenate(prompt_tokens))
    for i, end in enumerate(np.cumsum(lengths)):
        choose(i, logits[end - 1])
    for step in range(steps):
        if step == fork_step:
            ids.append(attention.fork(ids[fork_parent]))
            lengths.append(lengths[fork_parent])
            result.tokens.append([])
            result.logits.append([])
            choose(len(ids) - 1, result.logits[fork_parent][-1], rank=1)
        new_tokens = np.array([tokens[-1] for tokens in result.tokens])
        logits = _step(forward, attention, ids, [1] * len(ids), lengths, new_tokens)
        lengths = [n + 1 for n in lengths]
        for i, row in enumerate(logits):
            choose(i, row)
    return result


def _step(forward, attention, ids: list, counts: list[int], starts: list[int], tokens: np.ndarray) -> np.ndarray:
    """One forward pass over counts[i] new tokens of each sequence (positions from starts[i])."""
    attention.begin(ids, counts)
    positions = np.concatenate([np.arange(start, start + n) for start, n in zip(starts, counts)])
    return forward(tokens, positions, attention)


@dataclass(frozen=True)
class Agreement:
    """How a run compares with the reference: relative logit error (Frobenius norm
    over every step and sequence; and the worst step's), the share of steps whose
    argmax is the reference's argmax under teacher forcing, and the share of freely
    generated tokens equal to the reference's."""

    logit_error: float
    worst_step_error: float
    top1_agreement: float
    token_agreement: float

    def __str__(self) -> str:
        return (f"logit error {self.logit_error:.2e} (worst step {self.worst_step_error:.2e}), "
                f"top-1 agreement {self.top1_agreement:.1%}, tokens equal {self.token_agreement:.1%}")


def agreement(reference: Generation, forced: Generation, free: Generation) -> Agreement:
    """forced: a run fed the reference's tokens; free: the same model generating on its own."""
    ref = np.concatenate([np.stack(rows) for rows in reference.logits])
    got = np.concatenate([np.stack(rows) for rows in forced.logits])
    step_errors = np.linalg.norm(got - ref, axis=1) / np.linalg.norm(ref, axis=1)
    return Agreement(
        logit_error=float(np.linalg.norm(got - ref) / np.linalg.norm(ref)),
        worst_step_error=float(step_errors.max()),
        top1_agreement=float(np.mean(np.argmax(got, axis=1) == np.argmax(ref, axis=1))),
        token_agreement=float(np.mean(np.concatenate(free.tokens) == np.concatenate(reference.tokens))))


def compare(config: Config, model, reference_attention, kv_dtype: str, device: str, steps: int,
            fork: tuple[int, int]) -> tuple[Generation, Generation, Generation]:
    """(reference, kvcupy forced to the reference's tokens, kvcupy free): one model
    generating over its framework's attention and over kvcupy's paged cache."""
    prompt_tokens = prompts(config)
    reference = generate(model, reference_attention, prompt_tokens, steps, fork)
    forced = generate(model, PagedAttention(config, kv_dtype, device=device), prompt_tokens, steps, fork,
                      forced=reference)
    free = generate(model, PagedAttention(config, kv_dtype, device=device), prompt_tokens, steps, fork)
    return reference, forced, free


def main(run, name: str, argv: list[str]) -> None:
    """`python examples/<name>_decoder.py [device] [kv_dtype]`: print the agreement."""
    device = argv[1] if len(argv) > 1 else "cpu"
    kv_dtype = argv[2] if len(argv) > 2 else "auto"
    reference, forced, free = run(kv_dtype, device)
    print(f"{name} decoder, {kv_dtype} cache on {device}: {agreement(reference, forced, free)}")
