// reshape_and_cache: rotate, quantize, pack and scatter K and V of every
// (token, KV head) in one launch, with no rotated copy in global memory.
//
// Specialised by (the launcher's write_defines):
//   KVC_HEAD_SIZE, KVC_POW2, KVC_ROWS, KVC_COLUMNS  the vector's layout (RotationLayout)
//   KVC_ROTATE (0/1), KVC_KRON (0/1)                 the transform
//   KVC_ROUND_TO_INPUT (0/1)                         the vllm preset's rounding
//   KVC_INPUT_T                                      key/value dtype (formats.CPP_TYPES)
//   KVC_KV_DTYPE, KVC_CACHE_T                        the cache (formats.KVDtype.kernel_defines)
//   KVC_THREADS, KVC_MIN_BLOCKS                      block size, blocks a multiprocessor
#include "common.cuh"
#include "rotation.cuh"
#include "quantize.cuh"

namespace {

using namespace kvc;
using Input = KVC_INPUT_T;
using CacheT = KVC_CACHE_T;
// 16-bit inputs rotated blockdiag try the exact integer path first (rotation.cuh).
constexpr bool kExact = KVC_ROTATE && !KVC_KRON && SignificantBits<Input>::value > 0;
using Layout = RotationLayout<KVC_HEAD_SIZE, KVC_POW2, KVC_ROWS, KVC_COLUMNS, KVC_ROTATE != 0, !kExact>;
using Group = LaneGroup<Layout::kLanes>;

#ifndef KVC_THREADS
#define KVC_THREADS 128
#endif
constexpr int kThreads = KVC_THREADS;
constexpr int kGroupsPerBlock = kThreads / Layout::kLanes;
constexpr int kInputSize = sizeof(typename Scalar<Input>::Bits);
constexpr int kInputRunBytes = Layout::kColumns * kInputSize;
static_assert(kThreads % Layout::kLanes == 0 && kGroupsPerBlock % 2 == 0, "whole groups, K and V alike");
// The next vector's loads go out before the current one is transformed,
// unless a lane holds so many values that the second buffer would spill.
constexpr bool kPrefetch = Layout::kValues <= 32;

// One vector's cache row (stored element 0) and scale word, or nothing for padding.
struct Destination {
    CacheT* row;
    float* scale;
};

// The lane's input runs (initial layout): row a's columns rank*C .. +C-1.
__device__ __forceinline__ void load_vector(const Input* __restrict__ vector, int rank, int align,
                                            Words<kInputRunBytes> (&runs)[Layout::kRows]) {
#pragma unroll
    for (int a = 0; a < Layout::kRows; ++a) {
        const i64 first = i64(a) * Layout::kPow2 + i64(rank) * Layout::kColumns;
        load_run(vector + first, runs[a], alignment_at(align, first * kInputSize));
    }
}

using Signs = LaneSigns<Layout, kInputSize == 2>;

#if KVC_ROUND_TO_INPUT
// The vllm preset: vLLM's transform returns the input dtype (rotation.round_for_cache).
__device__ __forceinline__ void round_to_input(float (&y)[Layout::kValues]) {
    Words<Layout::kValues * kInputSize> rounded;
    to_run<Input, Layout::kValues>(y, rounded);
#pragma unroll
    for (int i = 0; i < Layout::kValues; ++i) y[i] = Scalar<Input>::to_float(element_bits<kInputSize>(rounded, i));
}
#endif

// How the values of transformed() relate to the vector's.
struct Scaling {
    float unit;        // a power of two: the vector is y x unit
    bool ranged;       // the lane's extremes of y are known (range)
    LaneRange range;
};

// The values that get quantized (or stored, for auto), in the final layout: y
// times `unit`, a power of two (1 but on the integer path, whose float(n) * 2^-k
// it leaves to the quantizer: one multiply a vector instead of one a value, and
// the extremes from the integers).
__device__ __forceinline__ void transformed(Words<kInputRunBytes> (&runs)[Layout::kRows], const Group& group,
                                            const Signs& signs, const u32* __restrict__ rotation,
                                            float (&y)[Layout::kValues], Scaling& scaling) {
    constexpr int C = Layout::kColumns;
    scaling.unit = 1.0f;
    scaling.ranged = false;
    signs.apply(runs);
    float x[Layout::kValues];
#pragma unroll
    for (int i = 0; i < Layout::kValues; ++i)
        x[i] = Scalar<Input>::to_float(element_bits<kInputSize>(runs[i / C], i % C));
#if KVC_ROTATE
    u32 sign_bits[Layout::kRows];
    signs.bits(sign_bits);
    if constexpr (kExact) {
        float signed_x[Layout::kValues];
#pragma unroll
        for (int i = 0; i < Layout::kValues; ++i) signed_x[i] = negate_if(x[i], (sign_bits[i / C] >> (i % C)) & 1u);
        const ExactGrid grid = exact_grid_of<Input>(runs, signed_x, group);
        if (grid.ok) {
#if KVC_ROUND_TO_INPUT
            exact_rotation<Layout>(signed_x, grid, group, grid.unit, y);
            round_to_input(y);
#else
            exact_rotation<Layout, false>(signed_x, grid, group, grid.unit, y, &scaling.range);
            scaling.unit = grid.unit;
            scaling.ranged = true;
#endif
            return;
        }
    }
    double v[Layout::kValues];
    widen<Layout>(x, sign_bits, v);
    hadamard_rows<Layout>(v, group);
#if KVC_KRON
    mix_rows<Layout>(v, rotation + kForwardMix);
#endif
#pragma unroll
    for (int i = 0; i < Layout::kValues; ++i) y[i] = __double2float_rn(v[i]);
#if KVC_ROUND_TO_INPUT
    round_to_input(y);
#endif
#else
#pragma unroll
    for (int i = 0; i < Layout::kValues; ++i) y[i] = x[i];
#endif
}

// Quantize (or convert) the final-layout values y x unit (transformed) and store
// the lane's runs and, on rank 0, the scale.
template <int KV_DTYPE, class Cache = CacheT>   // dependent names: if constexpr drops the other branches
__device__ __forceinline__ void store_vector(const float (&y)[Layout::kValues], const Scaling& scaling,
                                             const Group& group, const Destination& to, int align) {
    const float unit = scaling.unit;
    constexpr int R = Layout::kRun;
    constexpr int C = Layout::kColumns;
    if constexpr (KV_DTYPE == kAuto) {
        constexpr int kSize = sizeof(Cache);
#pragma unroll
        for (int a = 0; a < Layout::kRows; ++a) {
#pragma unroll
            for (int t = 0; t < Layout::kRunsPerRow; ++t) {
                Words<R * kSize> run;
                float scaled[R];
#pragma unroll
                for (int r = 0; r < R; ++r) scaled[r] = __fmul_rn(y[a * C + t * R + r], unit);   // exact
                to_run<Cache, R>(scaled, run);
                const i64 first = i64(a) * Layout::kPow2 + Layout::final_column(group.rank, t);
                store_run(to.row + first, run, alignment_at(align, first * kSize));
            }
        }
    } else {
        const Quantizer<KV_DTYPE> quantizer(y, scaling.ranged ? &scaling.range : nullptr, group, unit);
        u8* row = reinterpret_cast<u8*>(to.row);
        if constexpr (KV_DTYPE == kInt4 && R == 1) {
            // One column a lane: lane 2i stores the byte of columns 2i (low nibble) and 2i+1.
#pragma unroll
            for (int a = 0; a < Layout::kRows; ++a) {
                const u32 code = quantizer.code(y[a]) & quantizer.keep;
                const u32 odd = group.exchange(code, 1);
                if ((group.rank & 1) == 0) row[(a * Layout::kPow2 + group.rank) / 2] = u8(code | (odd << 4));
            }
        } else {
            constexpr int kPerByte = KV_DTYPE == kInt4 ? 2 : 1;
#pragma unroll
            for (int a = 0; a < Layout::kRows; ++a) {
#pragma unroll
                for (int t = 0; t < Layout::kRunsPerRow; ++t) {
                    Words<R / kPerByte> run;
                    const float* values = y + a * C + t * R;
                    if constexpr ((R / kPerByte) % 4 == 0) {
                        // Whole words: each byte is the low byte of a code (int4: of a
                        // pair) whose higher bits need no clearing, four gathered by
                        // byte permutes (in place of a mask, shift and insert a byte).
#pragma unroll
                        for (int w = 0; w < R / kPerByte / 4; ++w) {
                            u32 bytes[4];
#pragma unroll
                            for (int b = 0; b < 4; ++b) {
                                const int r = kPerByte * (4 * w + b);
                                if constexpr (kPerByte == 2) bytes[b] = quantizer.pair_byte(values[r], values[r + 1]);
                                else bytes[b] = quantizer.code_byte(values[r]);
                            }
                            run.w[w] = __byte_perm(__byte_perm(bytes[0], bytes[1], 0x0040),
                                                   __byte_perm(bytes[2], bytes[3], 0x0040), 0x5410);
                        }
                    } else {
#pragma unroll
                        for (int r = 0; r < R; r += kPerByte) {
                            u32 byte = quantizer.code(values[r]);
                            if constexpr (kPerByte == 2)   // even value in the low nibble
                                byte |= quantizer.code(values[r + 1]) << 4;
                            set_element_bits<1>(run, r / kPerByte, byte);
                        }
                    }
#pragma unroll
                    for (int w = 0; w < Words<R / kPerByte>::count; ++w) run.w[w] &= quantizer.keep;
                    const i64 first = (i64(a) * Layout::kPow2 + Layout::final_column(group.rank, t)) / kPerByte;
                    store_run(row + first, run, alignment_at(align, first));
                }
            }
        }
        if (group.rank == 0) *reinterpret_cast<u32*>(to.scale) = quantizer.scale_word;
    }
}

// One tensor of the launch (K or V): where its vectors come from and go.
// The grid's stride is even, so a group always serves the same tensor
// (item = 2 * (token * heads + head) + t), and this is set up once.
struct Stream {
    const Input* input;
    i64 token_stride, head_stride;
    CacheT* cache;
    i64 cache_block, cache_slot, cache_head;
    float* scales;
    i64 scale_block, scale_slot, scale_head;
};

struct Common {
    const void* slot_mapping;
    int slot_is_int64;
    i64 slot_stride;
    int block_size;
    int block_shift;   // log2 of the block size where it is a power of two, else -1
    i64 num_slots;
    const u32* rotation;
    int input_align, cache_align;
};

// A vector of the launch: (token, head), walked with the grid's stride in
// pairs = token * heads + head, carried along without dividing.
struct Position {
    i64 token;
    int head;
};

// What one vector needs from memory before its transform: its input runs and
// its slot, loaded together (neither waits for the other).
struct Fetched {
    Words<kInputRunBytes> runs[Layout::kRows];
    i64 slot;
};

__device__ __forceinline__ void fetch(const Common& c, const Stream& s, const Position& at, int rank, Fetched& f) {
    f.slot = c.slot_is_int64 ? static_cast<const i64*>(c.slot_mapping)[at.token * c.slot_stride]
                             : i64(static_cast<const int*>(c.slot_mapping)[at.token * c.slot_stride]);
    load_vector(s.input + at.token * s.token_stride + at.head * s.head_stride, rank, c.input_align, f.runs);
}

__device__ __forceinline__ void write_vector(const Common& c, const Stream& s, const Position& at,
                                             const Group& group, const Signs& signs, Fetched& f) {
    // Padding (< 0) and ids outside the cache write nothing: no id, however
    // wrong, touches memory outside the cache (batch.py's policy).
    if (f.slot < 0 || f.slot >= c.num_slots) return;
    const i64 block = c.block_shift >= 0 ? f.slot >> c.block_shift : f.slot / c.block_size;
    const i64 offset = f.slot - block * c.block_size;
    float y[Layout::kValues];
    Scaling scaling;
    transformed(f.runs, group, signs, c.rotation, y, scaling);
    store_vector<KVC_KV_DTYPE>(y, scaling, group,
                               {s.cache + block * s.cache_block + offset * s.cache_slot + at.head * s.cache_head,
                                s.scales + block * s.scale_block + offset * s.scale_slot + at.head * s.scale_head},
                               c.cache_align);
}

}  // namespace

#ifndef KVC_MIN_BLOCKS
#define KVC_MIN_BLOCKS 1
#endif
// The register cap of KVC_MIN_BLOCKS blocks per SM suits the short blockdiag
// lanes only; longer lanes and the kron mix would spill under it.
constexpr int kMinBlocks = Layout::kValues <= 32 && !KVC_KRON ? KVC_MIN_BLOCKS : 1;

// key/value [T, Hk, d] with element strides (token, head); slot_mapping [T]
// (int32 or int64, element stride); caches with element strides (block, slot,
// head) for K, V and both scale tensors; rotation: the launcher's rotation_words.
// *_align: the alignment in bytes of every vector's row start (host-proved).
//
// A persistent grid: each group of lanes walks the vectors (K and V of every
// token and head) with the grid's stride and loads the next vector's input
// before transforming the current one, so that memory latency hides behind
// the float64 work (with one vector per group, then exit, every load would be
// exposed: the ~12 warps a multiprocessor holds compute for longer than a load takes).
extern "C" __global__ void __launch_bounds__(kThreads, kMinBlocks) reshape_and_cache(
    const Input* __restrict__ key, const Input* __restrict__ value,
    i64 key_token_stride, i64 key_head_stride, i64 value_token_stride, i64 value_head_stride,
    const void* __restrict__ slot_mapping, int slot_is_int64, i64 slot_stride,
    int num_tokens, int num_heads,
    CacheT* __restrict__ key_cache, CacheT* __restrict__ value_cache,
    float* __restrict__ k_scale_cache, float* __restrict__ v_scale_cache,
    i64 kc_block, i64 kc_slot, i64 kc_head, i64 vc_block, i64 vc_slot, i64 vc_head,
    i64 ks_block, i64 ks_slot, i64 ks_head, i64 vs_block, i64 vs_slot, i64 vs_head,
    int block_size, i64 num_slots,
    const u32* __restrict__ rotation, int input_align, int cache_align) {
    const Group group;
    const i64 first = i64(blockIdx.x) * kGroupsPerBlock + threadIdx.x / Layout::kLanes;
    const bool is_value = first & 1;
    const Stream s = is_value
        ? Stream{value, value_token_stride, value_head_stride, value_cache, vc_block, vc_slot, vc_head,
                 v_scale_cache, vs_block, vs_slot, vs_head}
        : Stream{key, key_token_stride, key_head_stride, key_cache, kc_block, kc_slot, kc_head,
                 k_scale_cache, ks_block, ks_slot, ks_head};
    const int block_shift = (block_size & (block_size - 1)) == 0 ? __ffs(block_size) - 1 : -1;
    const Common c{slot_mapping, slot_is_int64, slot_stride, block_size, block_shift, num_slots, rotation,
                   input_align, cache_align};
    const Signs signs(rotation, group.rank, KVC_ROTATE != 0);
    const i64 pairs = i64(num_tokens) * num_heads;
    const i64 stride = i64(gridDim.x) * kGroupsPerBlock / 2;   // in pairs: kGroupsPerBlock is even
    i64 pair = first >> 1;
    if (pair >= pairs) return;
    // The two divisions of the whole walk: the start and the stride in (tokens, heads).
    Position at{pair / num_heads, int(pair % num_heads)};
    const i64 stride_tokens = stride / num_heads;
    const int stride_heads = int(stride % num_heads);
    Fetched current, next;
    fetch(c, s, at, group.rank, current);
    for (;;) {
        const i64 following = pair + stride;
        const bool more = following < pairs;   // the same for the whole group
        Position then{at.token + stride_tokens, at.head + stride_heads};
        if (then.head >= num_heads) then.head -= num_heads, ++then.token;
        if (kPrefetch && more) fetch(c, s, then, group.rank, next);
        write_vector(c, s, at, group, signs, current);
        if (!more) break;
        if (kPrefetch) current = next;
        else fetch(c, s, then, group.rank, current);
        pair = following;
        at = then;
    }
}
