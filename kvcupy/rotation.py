"""Rotation plans: the Hadamard transform applied to each K/V vector before quantizing.

A plan is the whole description of one rotation: which matrix (`blockdiag`,
`kron` or `none`), the +-1 sign vector, and whether the rotated vector is
rounded to the input dtype before quantizing (the `vllm` preset). Every
backend builds its transform from a plan; `matrix()` gives the dense matrix
the float64 oracle multiplies by.

For a plan, the rotation is y = H (s * x) with H = M (x) H_P, where H_P is the
Sylvester matrix of order P (a power of two) and M is either the identity of
order `blocks` (blockdiag: one H_b per block) or the real Hadamard matrix H_m
of order m in {1, 12, 20, 28} (kron). Then H^T H = norm * I with norm = P for
blockdiag and norm = d for kron, so the inverse is x = s * (H^T y) / norm.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from importlib import resources

import numpy as np

from ._hadamard_tables import HADAMARD_ROWS

KINDS = ("blockdiag", "kron", "none")
PRESETS = ("kvcupy", "vllm")
KRON_ORDERS = (1, 12, 20, 28)
MIN_HEAD_SIZE, MAX_HEAD_SIZE = 32, 256
# Seed of kvcupy's own sign vectors (the golden-ratio constant vLLM also uses;
# any fixed value would do, it only has to never change).
KVCUPY_SIGN_SEED = 0x9E3779B9


@dataclass(frozen=True)
class RotationPlan:
    head_size: int
    kind: str
    preset: str | None
    pow2_size: int          # P: order of the Sylvester factor
    mix_size: int           # order of M: number of blocks (blockdiag) or m (kron)
    signs: tuple[int, ...]  # length head_size (blockdiag: the block's signs, tiled)

    def __hash__(self) -> int:
        # Plans key the backends' memos at every call: the signs (head_size ints)
        # are hashed once, not at each lookup.
        found = self.__dict__.get("_hash")
        if found is None:
            found = hash((self.head_size, self.kind, self.preset, self.pow2_size, self.mix_size, self.signs))
            object.__setattr__(self, "_hash", found)
        return found

    def __getstate__(self) -> dict:
        # Without the hash: str hashes differ from one process to the next.
        return {name: value for name, value in self.__dict__.items() if name != "_hash"}

    @property
    def is_identity(self) -> bool:
        return self.kind == "none"

    @property
    def block(self) -> int:
        """Width of one independent transform: b for blockdiag, d for kron."""
        if self.kind == "blockdiag":
            return self.pow2_size
        return self.head_size if self.kind == "kron" else 1

    @property
    def blocks(self) -> int:
        return self.head_size // self.block

    @property
    def norm(self) -> int:
        """H^T H = norm * I: dot products of rotated vectors grow by this factor."""
        return {"blockdiag": self.pow2_size, "kron": self.head_size, "none": 1}[self.kind]

    @property
    def rounds_to_input_dtype(self) -> bool:
        """vLLM rounds the rotated vector to the input dtype before quantizing."""
        return self.preset == "vllm"

    def describe(self) -> str:
        d = self.head_size
        if self.kind == "blockdiag":
            return f"{d} = {self.pow2_size} x {self.mix_size} (block-diagonal H_{self.pow2_size})"
        if self.kind == "kron":
            return f"{d} = {self.mix_size} x {self.pow2_size} (H_{self.mix_size} (x) H_{self.pow2_size})"
        return f"{d}: no rotation"

    def __repr__(self) -> str:
        # One line; the signs (head_size of them) are left out: the preset names them.
        return (f"RotationPlan(kind={self.kind!r}, head_size={self.head_size}, preset={self.preset!r}, "
                f"structure={self.describe()!r})")

    def mix_matrix(self) -> np.ndarray:
        """M as float64: identity for blockdiag, H_m for kron."""
        if self.kind == "kron":
            return hadamard_matrix(self.mix_size)
        return np.eye(self.mix_size)

    def sign_vector(self) -> np.ndarray:
        return np.array(self.signs, dtype=np.float64)

    def matrix(self) -> np.ndarray:
        """The dense d x d rotation H (without the signs), float64."""
        return np.kron(self.mix_matrix(), sylvester(self.pow2_size))


def sylvester(order: int) -> np.ndarray:
    """Unnormalised Sylvester Hadamard matrix of a power-of-two order, float64."""
    if order < 1 or order & (order - 1):
        raise ValueError(f"order={order} is not a power of two")
    matrix = np.ones((1, 1))
    while matrix.shape[0] < order:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    return matrix


def hadamard_matrix(order: int) -> np.ndarray:
    """A real Hadamard matrix of order 1, 12, 20, 28 or a power of two, float64."""
    if order in HADAMARD_ROWS:
        rows = HADAMARD_ROWS[order]
        return np.array([[1.0 if c == "+" else -1.0 for c in row] for row in rows])
    return sylvester(order)


def largest_pow2_divisor(n: int) -> int:
    return n & -n


def kron_factors(head_size: int) -> tuple[int, int] | None:
    """(m, P) with head_size = m * P, m in {1, 12, 20, 28}, P a power of two."""
    for m in KRON_ORDERS:
        if head_size % m == 0:
            p = head_size // m
            if p & (p - 1) == 0:
                return m, p
    return None


@functools.lru_cache(maxsize=None)
def vllm_signs(block: int) -> tuple[int, ...]:
    text = resources.files("kvcupy").joinpath("data/vllm_rht_signs.json").read_text()
    return tuple(int(v) for v in json.loads(text)["signs"][str(block)])


def kvcupy_signs(length: int) -> tuple[int, ...]:
    """kvcupy's own signs: the top bit of splitmix64 over a fixed seed.

    Written out rather than drawn from NumPy's generators, whose streams are
    not promised to stay the same across versions; a cache's bytes depend on
    these signs.
    """
    mask = (1 << 64) - 1
    state = KVCUPY_SIGN_SEED
    signs = []
    for _ in range(length):
        state = (state + 0x9E3779B97F4A7C15) & mask
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        z ^= z >> 31
        signs.append(-1 if z >> 63 else 1)
    return tuple(signs)


def check_head_size(head_size) -> int:
    """head_size as an int, or the error docs/format.md's range (even, 32..256) calls for."""
    if isinstance(head_size, bool) or not isinstance(head_size, (int, np.integer)):
        raise TypeError(f"head_size={head_size!r} must be an int")
    head_size = int(head_size)
    if head_size % 2 or not MIN_HEAD_SIZE <= head_size <= MAX_HEAD_SIZE:
        raise ValueError(
            f"head_size={head_size} is not supported: expected an even size in "
            f"{MIN_HEAD_SIZE}..{MAX_HEAD_SIZE}")
    return head_size


def rotation_plan(head_size: int, kind: str = "blockdiag", preset: str | None = "kvcupy") -> RotationPlan:
    """The rotation for one head size.

    kind: "blockdiag" (any even head size), "kron" (head_size = m * 2^k with
    m in {1, 12, 20, 28}) or "none". preset: "kvcupy" (kvcupy's own signs) or
    "vllm" (vLLM's signs, and rounding to the input dtype; blockdiag only).
    """
    head_size = check_head_size(head_size)
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not a rotation kind; expected one of {KINDS}")
    if kind == "none":
        return RotationPlan(head_size, "none", None, 1, head_size, (1,) * head_size)
    if preset not in PRESETS:
        raise ValueError(f"preset={preset!r} is not a rotation preset; expected one of {PRESETS}")

    if kind == "blockdiag":
        block = largest_pow2_divisor(head_size)
        block_signs = vllm_signs(block) if preset == "vllm" else kvcupy_signs(block)
        return RotationPlan(head_size, kind, preset, block, head_size // block,
                            block_signs * (head_size // block))

    if preset == "vllm":
        raise ValueError("preset='vllm' exists only for kind='blockdiag': vLLM has no kron rotation")
    factors = kron_factors(head_size)
    if factors is None:
        raise ValueError(
            f"head_size={head_size} has no kron rotation: it must be m * 2^k with m in "
            f"{KRON_ORDERS}; use kind='blockdiag'")
    m, pow2 = factors
    return RotationPlan(head_size, kind, preset, pow2, m, kvcupy_signs(head_size))


# --- rules every backend reproduces ----------------------------------------

def query_divisor(plan: RotationPlan | None, softmax_scale: float) -> float:
    """What a query is divided by so that its dot products with cached (rotated)
    keys are the softmax logits: q'.k' = norm * (q.k) in the rotated domain, and
    logits are softmax_scale * q.k, so q'' = q' / (norm / softmax_scale)."""
    norm = 1 if plan is None or plan.is_identity else plan.norm
    return norm / softmax_scale


def round_for_cache(rotated32: np.ndarray, input_dtype: np.dtype, plan: RotationPlan | None) -> np.ndarray:
    """The float32 vectors that get quantized, from the float32 rotation of input
    of `input_dtype`: the vllm preset rounds them to the input dtype first
    (vLLM's transform returns the input dtype), other plans keep float32."""
    if plan is not None and plan.rounds_to_input_dtype and np.dtype(input_dtype) != np.float32:
        return rotated32.astype(input_dtype).astype(np.float32)
    return rotated32
