"""What the benches time: the shapes of their cases and the groups the CUDA bench
runs (one shape each, kvcupy and its peers beside it)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .. import formats

QUANTIZED_KV_DTYPES = formats.QUANTIZED_KV_DTYPES
ALL_KV_DTYPES = QUANTIZED_KV_DTYPES + ("auto",)
BLOCK_SIZE = 16          # the CUDA bench's pages
STREAM_SPLITS = (32, 64, 128, 256, 512)
SDPA_BACKENDS = ("default", "flash", "cudnn")   # prefill; decode uses the default dispatch
GROUP_KINDS = ("decode", "sweep", "prefill", "prefill_sweep", "write", "rotate", "step")
# Whole-model steps are asked for by name: their caches fill most of the GPU and take minutes to time.
KINDS_OF_PHASE = {"all": ("decode", "sweep", "prefill", "prefill_sweep", "write", "rotate"),
                  "decode": ("decode", "sweep"), "prefill": ("prefill", "prefill_sweep")}
SHORT_NAMES = {"int4_per_token_head": "int4", "int8_per_token_head": "int8",
               "fp8_per_token_head": "fp8", "auto": "auto"}



@dataclass(frozen=True)
class Shape:
    """One benchmark case: decode (one new token per sequence) or causal prefill:
    of each sequence's seq_len tokens the last new_tokens are the query, the
    rest are cached (chunked prefill); new_tokens 0: the whole prompt is new."""

    phase: str
    num_seqs: int
    seq_len: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    new_tokens: int = 0

    @property
    def query_len(self) -> int:
        return 1 if self.phase == "decode" else (self.new_tokens or self.seq_len)

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads



def attended_tokens(shape: Shape) -> int:
    """Cached tokens summed over the query tokens that attend to them: the cache
    bytes read, in tokens, when each query reads its visible K/V once. Decode
    reads each sequence's cache once; a causal prefill of L tokens L(L+1)/2 rows."""
    first = shape.seq_len - shape.query_len + 1   # keys the first query token sees
    per_seq = (first + shape.seq_len) * shape.query_len // 2
    return shape.num_seqs * per_seq



@dataclass(frozen=True)
class WriteShape:
    """reshape_and_cache of num_tokens tokens, K and V [num_tokens, num_kv_heads, head_size]."""

    num_tokens: int
    num_kv_heads: int
    head_size: int


@dataclass(frozen=True)
class RotateShape:
    """kvcupy.rotate of num_vectors vectors of head_size (the default blockdiag plan)."""

    num_vectors: int
    head_size: int


@dataclass(frozen=True)
class Model:
    """The attention geometry of a model's decoder layers."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int


LLAMA_3_8B = Model("Llama-3-8B", 32, 32, 8, 128)
PHI_3_MINI = Model("Phi-3-mini", 32, 32, 32, 96)


@dataclass(frozen=True)
class StepShape:
    """A decode step of a whole model: in each of num_layers layers, one new token a
    sequence written into that layer's cache, then attention over seq_len tokens
    (the new one included)."""

    model: str
    num_layers: int
    num_seqs: int
    seq_len: int
    num_heads: int
    num_kv_heads: int
    head_size: int

    @classmethod
    def of(cls, model: Model, num_seqs: int, seq_len: int) -> "StepShape":
        return cls(model.name, model.num_layers, num_seqs, seq_len, model.num_heads, model.num_kv_heads,
                   model.head_size)

    @property
    def layer(self) -> Shape:
        """One layer's attention."""
        return Shape("decode", self.num_seqs, self.seq_len, self.num_heads, self.num_kv_heads, self.head_size)

    @property
    def layer_write(self) -> WriteShape:
        """One layer's write: a token a sequence."""
        return WriteShape(self.num_seqs, self.num_kv_heads, self.head_size)


@dataclass(frozen=True)
class Group:
    """Cases timed on one shape. kind: "decode", "prefill", "write", "rotate" or "step";
    sweep: a decode context length or a prefill prompt length added for --plot's sweeps."""

    kind: str
    shape: Shape | WriteShape | RotateShape | StepShape
    kv_dtypes: tuple[str, ...]
    sweep: bool = False

    @property
    def label(self) -> str:
        s = self.shape
        if self.kind in ("decode", "prefill"):
            if self.kind == "prefill" and s.query_len < s.seq_len:
                tokens = f"{s.num_seqs} x {s.query_len} new over {s.seq_len - s.query_len} cached, causal"
            else:
                tokens = f"{s.num_seqs} x {s.seq_len}" + (" causal" if self.kind == "prefill" else "")
            return f"{self.kind} {tokens}, {s.num_heads}/{s.num_kv_heads} heads, d = {s.head_size}"
        if self.kind == "write":
            return f"write {s.num_tokens} tokens x {s.num_kv_heads} KV heads, d = {s.head_size}"
        if self.kind == "step":
            return (f"step {s.model} ({s.num_layers} layers, {s.num_heads}/{s.num_kv_heads} heads, "
                    f"d = {s.head_size}), {s.num_seqs} x {s.seq_len}")
        return f"rotate {s.num_vectors} vectors, d = {s.head_size}"


@dataclass(frozen=True)
class Case:
    """One timed thing: impl "kvcupy", "sdpa", "copy" or "stream"; in a step group
    "kvcupy", "dense" (torch bf16) or "flashinfer". kv_dtype: kvcupy's KV dtype, or
    the one whose bytes a copy or stream moves (FlashInfer's: STEP_FLASHINFER_KV).
    graphed: a step group's case, replayed from one CUDA graph a step (True) or
    issued eagerly (False); None outside step groups. writes: the step writes each
    layer's new token (False: attention alone, to weigh the writes)."""

    impl: str
    kv_dtype: str | None = None
    sdpa_backend: str | None = None
    splits: int | None = None
    graphed: bool | None = None
    writes: bool = True
    device_metadata: bool = False   # kvcupy attention given device tensors and host bounds, no plan

    @property
    def name(self) -> str:
        short = SHORT_NAMES.get(self.kv_dtype, "")
        if self.graphed is not None:
            what = {"kvcupy": f"kvcupy {short}", "dense": "torch dense bf16",
                    "flashinfer": f"flashinfer {self.kv_dtype}"}[self.impl]
            return f"{what} {'graphed' if self.graphed else 'eager'}" + ("" if self.writes else ", no writes")
        if self.impl == "kvcupy":
            if self.device_metadata:
                return f"kvcupy {short}, device metadata"
            return f"kvcupy {short}" if self.kv_dtype else "kvcupy rotate"
        if self.impl == "sdpa":
            return "torch sdpa" + ("" if self.sdpa_backend == "default" else f" {self.sdpa_backend}")
        if self.impl == "copy":
            return f"copy ({short} bytes)" if self.kv_dtype else "copy"
        return f"stream {short}, {self.splits} splits"


# Shapes of the targets (targets.py; a Llama-3-8B-like layer: 32 query / 8 KV heads).
DECODE_MAIN = Shape("decode", 32, 32768, 32, 8, 128)
DECODE_D96 = Shape("decode", 32, 32768, 32, 8, 96)
DECODE_SHORT = Shape("decode", 32, 8192, 32, 8, 128)
DECODE_FEW = Shape("decode", 8, 32768, 32, 8, 128)
PREFILL_MAIN = Shape("prefill", 4, 8192, 32, 8, 128)
PREFILL_D96 = Shape("prefill", 4, 8192, 32, 8, 96)
PREFILL_SHORT = Shape("prefill", 64, 128, 32, 8, 128)
PREFILL_CHUNKED = Shape("prefill", 4, 32768, 32, 8, 128, new_tokens=2048)   # 2048 new over 30720 cached
WRITE_MAIN = WriteShape(32768, 8, 128)
ROTATE_HEAD_SIZES = (64, 96, 128, 256)
STEP_MAIN = StepShape.of(LLAMA_3_8B, 32, 32768)
STEP_SHORT = StepShape.of(LLAMA_3_8B, 32, 8192)
STEP_MODELS = (LLAMA_3_8B, PHI_3_MINI)
STEP_BATCHES = (1, 8, 32, 64)
STEP_SEQ_LENS = (1024, 8192, 32768)
# FlashInfer's paged decode, with its own KV storage: bf16, or fp8 e4m3 under one scale a tensor.
STEP_FLASHINFER_KV = ("bf16", "fp8_e4m3")


@dataclass(frozen=True)
class Sizes:
    decode: tuple[Shape, ...]
    sweep: Shape                    # geometry of the sweep; its seq_len is unused
    sweep_seq_lens: tuple[int, ...]
    prefill: tuple[Shape, ...]
    prefill_sweep: Shape            # geometry of the prefill sweep; num_seqs and seq_len unused
    prefill_sweep_seq_lens: tuple[int, ...]
    prefill_sweep_tokens: int       # prompts a length: this many tokens / the length (at least one)
    write: tuple[WriteShape, ...]
    rotate: tuple[RotateShape, ...]
    step: tuple[StepShape, ...] = ()

    def prefill_sweep_shape(self, seq_len: int) -> Shape:
        geometry = self.prefill_sweep
        return Shape("prefill", max(1, self.prefill_sweep_tokens // seq_len), seq_len, geometry.num_heads,
                     geometry.num_kv_heads, geometry.head_size)


FULL_SIZES = Sizes(
    decode=(DECODE_MAIN, DECODE_D96, DECODE_SHORT, DECODE_FEW),
    sweep=DECODE_MAIN, sweep_seq_lens=tuple(1024 << k for k in range(8)),   # 1k .. 128k
    prefill=(PREFILL_MAIN, PREFILL_D96, Shape("prefill", 1, 2048, 32, 8, 128), PREFILL_SHORT, PREFILL_CHUNKED),
    prefill_sweep=PREFILL_MAIN, prefill_sweep_seq_lens=tuple(512 << k for k in range(6)),   # 512 .. 16k
    prefill_sweep_tokens=16384,
    write=(WRITE_MAIN,),
    rotate=tuple(RotateShape(1 << 20, d) for d in ROTATE_HEAD_SIZES),
    step=tuple(StepShape.of(model, batch, seq_len) for model in STEP_MODELS
               for batch in STEP_BATCHES for seq_len in STEP_SEQ_LENS))
# A smoke test: every path, small shapes, seconds.
QUICK_SIZES = Sizes(
    decode=(Shape("decode", 4, 2048, 8, 2, 128), Shape("decode", 4, 2048, 8, 2, 96)),
    sweep=Shape("decode", 4, 2048, 8, 2, 128), sweep_seq_lens=(512, 2048, 8192),
    prefill=(Shape("prefill", 2, 512, 8, 2, 128), Shape("prefill", 2, 1024, 8, 2, 128, new_tokens=256)),
    prefill_sweep=Shape("prefill", 2, 512, 8, 2, 128), prefill_sweep_seq_lens=(128, 256), prefill_sweep_tokens=512,
    write=(WriteShape(2048, 2, 128),),
    rotate=(RotateShape(1 << 14, 64), RotateShape(1 << 14, 96)),
    # Both models' real geometry, their smallest batches and context: every path in seconds.
    step=tuple(StepShape.of(model, batch, 1024) for model in STEP_MODELS for batch in (1, 8)))


def sweep_kv_dtypes(kv_dtypes: tuple[str, ...]) -> tuple[str, ...]:
    """The sweep times int4 (or the first KV dtype asked for, without int4)."""
    return ("int4_per_token_head",) if "int4_per_token_head" in kv_dtypes else kv_dtypes[:1]


def step_kv_dtypes(kv_dtypes: tuple[str, ...]) -> tuple[str, ...]:
    """The quantized KV dtypes asked for: a step's bf16 bar is torch's dense cache."""
    return tuple(kv for kv in kv_dtypes if kv in QUANTIZED_KV_DTYPES)


def plan_groups(kinds: tuple[str, ...], kv_dtypes: tuple[str, ...], sizes: Sizes) -> tuple[Group, ...]:
    """The groups of `kinds` (GROUP_KINDS), in run order. A sweep length that a
    decode (prefill) group already times is not timed twice."""
    groups = []
    if "decode" in kinds:
        groups += [Group("decode", shape, kv_dtypes) for shape in sizes.decode]
    if "sweep" in kinds:
        timed = {group.shape for group in groups}
        for seq_len in sizes.sweep_seq_lens:
            shape = Shape("decode", sizes.sweep.num_seqs, seq_len, sizes.sweep.num_heads,
                          sizes.sweep.num_kv_heads, sizes.sweep.head_size)
            if shape not in timed:
                groups.append(Group("decode", shape, sweep_kv_dtypes(kv_dtypes), sweep=True))
    if "prefill" in kinds:
        groups += [Group("prefill", shape, kv_dtypes) for shape in sizes.prefill]
    if "prefill_sweep" in kinds:
        timed = {group.shape for group in groups}
        for seq_len in sizes.prefill_sweep_seq_lens:
            shape = sizes.prefill_sweep_shape(seq_len)
            if shape not in timed:
                groups.append(Group("prefill", shape, sweep_kv_dtypes(kv_dtypes), sweep=True))
    if "write" in kinds:
        groups += [Group("write", shape, kv_dtypes) for shape in sizes.write]
    if "rotate" in kinds:
        groups += [Group("rotate", shape, ()) for shape in sizes.rotate]
    if "step" in kinds:
        groups += [Group("step", shape, step_kv_dtypes(kv_dtypes)) for shape in sizes.step]
    return tuple(groups)


def stream_splits(shape: Shape) -> tuple[int, ...]:
    """Split counts the streaming kernel runs at: STREAM_SPLITS up to one page a split."""
    pages = math.ceil(shape.seq_len / BLOCK_SIZE)
    return tuple(s for s in STREAM_SPLITS if s <= pages) or (pages,)


def step_cases(group: Group) -> tuple[Case, ...]:
    """Each kvcupy KV dtype eager, graphed and graphed without the writes; torch dense
    bf16 eager and graphed; FlashInfer's KV storages eager and graphed. The cases of
    one implementation and KV dtype share their caches (step_storage)."""
    cases = []
    for kv_dtype in group.kv_dtypes:
        cases += [Case("kvcupy", kv_dtype, graphed=False), Case("kvcupy", kv_dtype, graphed=True),
                  Case("kvcupy", kv_dtype, graphed=True, writes=False)]
    cases += [Case("dense", graphed=False), Case("dense", graphed=True)]
    for kv in STEP_FLASHINFER_KV:
        cases += [Case("flashinfer", kv, graphed=False), Case("flashinfer", kv, graphed=True)]
    return tuple(cases)


def step_storage(case: Case) -> tuple[str, str | None]:
    """The caches a step case runs on: one implementation's, of one KV dtype."""
    return case.impl, case.kv_dtype


def group_cases(group: Group) -> tuple[Case, ...]:
    if group.kind == "step":
        return step_cases(group)
    kvcupy_cases = tuple(Case("kvcupy", kv_dtype) for kv_dtype in group.kv_dtypes)
    copies = tuple(Case("copy", kv_dtype) for kv_dtype in group.kv_dtypes)
    if group.kind == "rotate":
        return Case("kvcupy"), Case("copy")
    if group.kind == "write":
        return kvcupy_cases + copies
    if group.kind == "prefill":
        # int4 again with its metadata as device tensors beside max_query_len / max_seq_len
        # (as flash-attn's varlen call takes them): the planner sees bounds, not lengths.
        devices = () if group.sweep or "int4_per_token_head" not in group.kv_dtypes else (
            Case("kvcupy", "int4_per_token_head", device_metadata=True),)
        return kvcupy_cases + devices + tuple(Case("sdpa", sdpa_backend=b) for b in SDPA_BACKENDS)
    streams = tuple(Case("stream", kv_dtype, splits=splits)
                    for kv_dtype in group.kv_dtypes for splits in stream_splits(group.shape))
    return kvcupy_cases + (Case("sdpa", sdpa_backend="default"),) + copies + streams
