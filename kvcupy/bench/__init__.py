"""The CUDA bench (`kvcupy bench --backend cuda`): kvcupy on the GPU against its
peers and the physical limits, in one run.

Every group of cases shares one shape. A group times kvcupy (each KV dtype)
and, beside it:
- torch `scaled_dot_product_attention` in bf16 on dense K/V (when torch is
  installed): the bar any quantized cache must beat;
- a device-to-device copy (cudaMemcpyAsync) moving as many bytes as the case
  reads and writes: the copy-bandwidth line;
- decode only: the bench's own `kernels_cu/stream_pages.cu` (kernels.py),
  which reads the same pages of the same cache through the same block table
  on a split-KV grid and does nothing else: the ceiling of paged decode. It runs at several split
  counts; the fastest is the ceiling.

Groups: decode (batch 32 x 32768, 32/8 heads, d = 128 and 96; 32 x 8192;
8 x 32768), the decode sweep over context lengths that `--plot` draws, causal
prefill (4 x 8192 at d = 128 and 96, 1 x 2048, 64 x 128, and chunked: 4
sequences of 2048 new tokens over 30720 cached), the prefill sweep over
prompt lengths (16384 tokens a batch, as FlashAttention's benchmarks count
them) that `--plot` draws too, the write path (`reshape_and_cache`) and
`rotate`. The step group, asked for by name (`--groups step`), times a whole
model's decode step (step.py): Llama-3-8B's and Phi-3-mini's 32 layers at
batch 1 to 64 and contexts 1k to 32k, each layer's write and attention, kvcupy
eager and in one CUDA graph beside torch dense bf16 and FlashInfer.

Accounting. TB/s = bytes the case must read and write / median time.
Attention must read every cached token's K and V once, scales included
(`formats.bytes_per_token`), and read the query and write the output; a
prefill tile re-read from L2 is not counted. SDPA's bytes are those of the
same attention over dense model-dtype K/V with num_kv_heads heads. The write
path reads K and V and writes the packed cache; rotate reads and writes each
vector once. Index arrays (block table, slot mapping) are left out: under
0.3% of any case of the full run. TFLOP/s = 4 * head_size * num_heads *
(keys each query token sees, summed), i.e. 4 Lq Lk d Hq per sequence, the
triangle for a causal prefill (a chunked one: its cached keys in full, the
new tokens' own triangle). A copy case copies half its partner's bytes, so
it moves as many bytes in all and its TB/s compares with the partner's
directly.

Timing. CUDA events around each call, on the one stream torch and CuPy share
(the legacy default stream). A case is first called `warmup` times untimed
(kernels compile there). Each timed series is queued behind `hold_stream`, a
kernel that sleeps on the GPU while the host issues the series, so calls run
back to back and the events time the GPU, not Python's launch rate; the host
time of one call and the GPU's idle time between timed calls (zero when the
queue stayed ahead) are reported beside. When a case moves less than
L2_ROTATE_FACTOR x the L2 size, it gets several input sets (caches, tensors)
and the calls rotate among them, so no call finds its data in L2. Rounds
interleave the cases of a group, as the CPU bench does, and each case's
median over all rounds is reported.

A peer that cannot run here (torch missing, an SDPA backend torch does not
have) is reported as skipped with the reason; a case whose set-up or call
raises is reported as failed with the error. Neither ends the run.

Modules: shapes.py (what is timed), accounting.py (bytes and FLOPs),
kernels.py (the bench's own kernels), run.py (configuration, rounds,
records), targets.py (the goals), runner.py (the CUDA runner), step.py (the
step group's cases on the GPU), tables.py (the report as tables). The names below are what the CLI calls.
"""

from .run import DEFAULT_REPEATS, BenchConfig, make_config, run_bench, total_steps
from .runner import CudaRunner
from .tables import tables

__all__ = ["BenchConfig", "CudaRunner", "DEFAULT_REPEATS", "make_config", "run_bench", "tables", "total_steps"]
