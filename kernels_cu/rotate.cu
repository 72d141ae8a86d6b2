// rotate_rows: out[v, k] = y[write_order[k]] / divisor with y = H (s * x'[v])
// (forward) or s * (H^T x'[v]) (inverse), x'[v, i] = x[v, read_order[i]]:
// cpu_kernels.rotate_rows, one row per group of lanes.
//
// Specialised by (the launcher's rotate_defines):
//   KVC_HEAD_SIZE, KVC_POW2, KVC_ROWS, KVC_COLUMNS  the vector's layout (RotationLayout)
//   KVC_ROTATE (0/1), KVC_KRON (0/1)                 the transform (0: only orders and divisor)
//   KVC_INPUT_T, KVC_OUTPUT_T                        x and out dtypes (formats.CPP_TYPES)
//   KVC_ORDERS (0/1)                                 read_order / write_order may be given
//   KVC_MIN_BLOCKS                                   blocks a multiprocessor (launch bounds)
#include "common.cuh"
#include "rotation.cuh"

namespace {

using namespace kvc;
using Input = KVC_INPUT_T;
using Output = KVC_OUTPUT_T;
// 16-bit inputs rotated blockdiag try the exact integer path first (rotation.cuh).
constexpr bool kExact = KVC_ROTATE && !KVC_KRON && SignificantBits<Input>::value > 0;
// The exact path's layout (no swaps) spreads a lane's columns in 16-byte
// chunks of input where a group has several lanes (rotation.cuh): a group's
// loads and stores then cover whole lines. Heads of several rows keep their
// runs: their rows are short (d = 96: three rows of 32, two lanes), and
// chunks gain them nothing.
constexpr int kChunkColumns = 16 / sizeof(typename Scalar<Input>::Bits);
constexpr int kChunk = kExact && KVC_ROWS == 1 && kChunkColumns < KVC_COLUMNS && KVC_COLUMNS < KVC_POW2
                           ? kChunkColumns
                           : KVC_COLUMNS;
using Layout = RotationLayout<KVC_HEAD_SIZE, KVC_POW2, KVC_ROWS, KVC_COLUMNS, KVC_ROTATE != 0, !kExact, kChunk>;
using Group = LaneGroup<Layout::kLanes>;

// Fewer threads for very long lanes (odd head sizes whose pow2 factor is tiny),
// to keep the order staging below 48 KiB of shared memory.
constexpr int kThreads = Layout::kValues > 64 ? 32 : 128;
constexpr int kGroupsPerBlock = kThreads / Layout::kLanes;
constexpr int kInputSize = sizeof(typename Scalar<Input>::Bits);
constexpr int kOutputSize = sizeof(typename Scalar<Output>::Bits);
constexpr int kInputRunBytes = Layout::kColumns * kInputSize;
constexpr int kOutputRunBytes = Layout::kPiece * kOutputSize;
constexpr int kChunkBytes = Layout::kChunk * kInputSize;
static_assert(Layout::kChunk == Layout::kColumns || kChunkBytes % 4 == 0, "whole words a chunk");

// How the result is divided: not at all (divisor 1), by multiplying with the
// reciprocal (a power of two: exact, the same as dividing), or dividing.
enum Divide { kKeep = 0, kMultiply = 1, kDivide = 2 };

struct RotateParams {
    const Input* x;
    i64 x_row_stride;
    Output* out;
    i64 out_row_stride;
    const u32* rotation;
    int inverse;
    double divisor, reciprocal;
    int divide;
    const int* read_order;
    const int* write_order;
    int x_align, out_align;
};

struct Fetched {
    Words<kInputRunBytes> runs[Layout::kRows];
};

// The forward rotation's initial signs (rotation.cuh). 16-bit inputs in their
// given order hold them as masks on the raw words: one xor a word, where a
// sign bit a value cost a shift and a xor after its conversion. A read_order
// permutes the values first, and float32 inputs take the float64 path: those
// read them as sign bits for each row (widen).
constexpr bool kWordSigns = kInputSize == 2 && !KVC_ORDERS;
using Signs = LaneSigns<Layout, kWordSigns, kWordSigns>;

__device__ __forceinline__ void fetch(const RotateParams& p, i64 row, int rank, Fetched& f) {
    const Input* source = p.x + row * p.x_row_stride;
#pragma unroll
    for (int a = 0; a < Layout::kRows; ++a) {
        if constexpr (Layout::kChunk == Layout::kColumns) {
            const i64 first = i64(a) * Layout::kPow2 + i64(rank) * Layout::kColumns;
            load_run(source + first, f.runs[a], alignment_at(p.x_align, first * kInputSize));
        } else {   // chunk j's words are the run's words j * kChunkBytes / 4 ..
#pragma unroll
            for (int j = 0; j < Layout::kColumns / Layout::kChunk; ++j) {
                const i64 first = i64(a) * Layout::kPow2 + Layout::column(rank, j * Layout::kChunk);
                Words<kChunkBytes> chunk;
                load_run(source + first, chunk, alignment_at(p.x_align, first * kInputSize));
#pragma unroll
                for (int w = 0; w < kChunkBytes / 4; ++w) f.runs[a].w[j * kChunkBytes / 4 + w] = chunk.w[w];
            }
        }
    }
}

// float32's smallest normal and largest finite values: the unit's admissible range.
constexpr float kSmallestNormal = 1.17549435e-38f;
constexpr float kLargestFinite = 3.40282347e38f;

// y = the rotation of x (the lane's values, initial layout) divided as p says, final layout.
// runs: the lane's raw inputs (their order aside, the same values as x's).
// signs: the forward signs not yet applied to x (none for the inverse).
__device__ __forceinline__ void transformed(const RotateParams& p, const Group& group,
                                            const Words<kInputRunBytes> (&runs)[Layout::kRows],
                                            const Signs& lane_signs, float (&x)[Layout::kValues],
                                            float (&y)[Layout::kValues]) {
    constexpr int C = Layout::kColumns;
#if KVC_ROTATE
    u32 signs[Layout::kRows];
    lane_signs.bits(signs);
    if constexpr (kExact) {
        // The reciprocal of a power-of-two divisor folds into the grid's unit;
        // a product below float32's normal range, or another divisor, takes float64.
        float signed_x[Layout::kValues];
#pragma unroll
        for (int i = 0; i < Layout::kValues; ++i) signed_x[i] = negate_if(x[i], (signs[i / C] >> (i % C)) & 1u);
        const ExactGrid grid = exact_grid_of<Input>(runs, signed_x, group);
        const float unit = p.divide == kKeep ? grid.unit : __fmul_rn(grid.unit, float(p.reciprocal));
        if (grid.ok && p.divide != kDivide && unit >= kSmallestNormal && unit <= kLargestFinite) {
            exact_rotation<Layout>(signed_x, grid, group, unit, y);
            if (p.inverse) {
                u32 final[Layout::kRows];
                final_signs<Layout>(p.rotation, group.rank, final);
#pragma unroll
                for (int i = 0; i < Layout::kValues; ++i) y[i] = negate_if(y[i], (final[i / C] >> (i % C)) & 1u);
            }
            return;
        }
    }
    double v[Layout::kValues];
    widen<Layout>(x, signs, v);
    hadamard_rows<Layout>(v, group);
#if KVC_KRON
    mix_rows<Layout>(v, p.rotation + (p.inverse ? kInverseMix : kForwardMix));
#endif
    if (p.inverse) {
        final_signs<Layout>(p.rotation, group.rank, signs);
#pragma unroll
        for (int i = 0; i < Layout::kValues; ++i) v[i] = negate_if(v[i], (signs[i / C] >> (i % C)) & 1u);
    }
#else
    double v[Layout::kValues];
#pragma unroll
    for (int i = 0; i < Layout::kValues; ++i) v[i] = double(x[i]);
#endif
    if (p.divide == kDivide) {
#pragma unroll
        for (int i = 0; i < Layout::kValues; ++i) y[i] = __double2float_rn(__ddiv_rn(v[i], p.divisor));
    } else if (p.divide == kMultiply) {
#pragma unroll
        for (int i = 0; i < Layout::kValues; ++i) y[i] = __double2float_rn(__dmul_rn(v[i], p.reciprocal));
    } else {
#pragma unroll
        for (int i = 0; i < Layout::kValues; ++i) y[i] = __double2float_rn(v[i]);
    }
}

// staged: this group's slice of shared memory (KVC_ORDERS only).
__device__ __forceinline__ void rotate_row(const RotateParams& p, i64 row, const Group& group, const Fetched& f,
                                           const Signs& signs, float* staged) {
    constexpr int C = Layout::kColumns;
    constexpr int R = Layout::kPiece;
    Fetched signed_f = f;
    signs.apply(signed_f.runs);
    float x[Layout::kValues];
#pragma unroll
    for (int i = 0; i < Layout::kValues; ++i)
        x[i] = Scalar<Input>::to_float(element_bits<kInputSize>(signed_f.runs[i / C], i % C));
#if KVC_ORDERS
    if (p.read_order != nullptr) {
#pragma unroll
        for (int i = 0; i < Layout::kValues; ++i)
            staged[(i / C) * Layout::kPow2 + Layout::column(group.rank, i % C)] = x[i];
        group.sync();
#pragma unroll
        for (int i = 0; i < Layout::kValues; ++i)
            x[i] = staged[__ldg(p.read_order + (i / C) * Layout::kPow2 + Layout::column(group.rank, i % C))];
        group.sync();
    }
#endif

    float y[Layout::kValues];
    transformed(p, group, f.runs, signs, x, y);

#if KVC_ORDERS
    if (p.write_order != nullptr) {
        // y is in the final layout: stage y[j], then read y[write_order[k]] for
        // the lane's own final-layout outputs k.
#pragma unroll
        for (int a = 0; a < Layout::kRows; ++a)
#pragma unroll
            for (int t = 0; t < Layout::kPiecesPerRow; ++t)
#pragma unroll
                for (int r = 0; r < R; ++r)
                    staged[a * Layout::kPow2 + Layout::final_piece_column(group.rank, t) + r] = y[a * C + t * R + r];
        group.sync();
#pragma unroll
        for (int a = 0; a < Layout::kRows; ++a)
#pragma unroll
            for (int t = 0; t < Layout::kPiecesPerRow; ++t)
#pragma unroll
                for (int r = 0; r < R; ++r)
                    y[a * C + t * R + r] =
                        staged[__ldg(p.write_order + a * Layout::kPow2 + Layout::final_piece_column(group.rank, t) + r)];
        group.sync();   // the slice is free for the group's next row
    }
#endif

    Output* target = p.out + row * p.out_row_stride;
#pragma unroll
    for (int a = 0; a < Layout::kRows; ++a) {
#pragma unroll
        for (int t = 0; t < Layout::kPiecesPerRow; ++t) {
            Words<kOutputRunBytes> run;
            to_run<Output, R>(y + a * C + t * R, run);
            const i64 first = i64(a) * Layout::kPow2 + Layout::final_piece_column(group.rank, t);
            store_run(target + first, run, alignment_at(p.out_align, first * kOutputSize));
        }
    }
}

}  // namespace

// x [num_rows, d], out [num_rows, d]: element row strides, last axis contiguous.
// rotation: the launcher's rotation_words. divide: kKeep, kMultiply (by
// `reciprocal`, for a power-of-two divisor) or kDivide (by `divisor`).
// A persistent grid: each group walks rows with the grid's stride and loads
// the next row before transforming the current one (write.cu says why).
#ifndef KVC_MIN_BLOCKS
#define KVC_MIN_BLOCKS 1
#endif
// The register cap of KVC_MIN_BLOCKS blocks per SM suits the short blockdiag
// lanes only; longer lanes and the kron mix would spill under it.
constexpr int kMinBlocks = Layout::kValues <= 32 && !KVC_KRON ? KVC_MIN_BLOCKS : 1;
extern "C" __global__ void __launch_bounds__(kThreads, kMinBlocks) rotate_rows(
    const Input* __restrict__ x, i64 x_row_stride, Output* __restrict__ out, i64 out_row_stride,
    i64 num_rows, const u32* __restrict__ rotation, int inverse, double divisor, double reciprocal,
    int divide, const int* __restrict__ read_order, const int* __restrict__ write_order,
    int x_align, int out_align) {
    const RotateParams p{x, x_row_stride, out, out_row_stride, rotation, inverse, divisor, reciprocal, divide,
                         read_order, write_order, x_align, out_align};
    const Group group;
#if KVC_ORDERS
    // A row is staged here when an order permutes it: read_order gathers the
    // input, write_order the output (both through the same group-private slice).
    __shared__ float staged_rows[kGroupsPerBlock][KVC_HEAD_SIZE];
    float* staged = staged_rows[threadIdx.x / Layout::kLanes];
#else
    float* staged = nullptr;
#endif
    const i64 stride = i64(gridDim.x) * kGroupsPerBlock;
    i64 row = i64(blockIdx.x) * kGroupsPerBlock + threadIdx.x / Layout::kLanes;
    if (row >= num_rows) return;
    const Signs signs(p.rotation, group.rank, KVC_ROTATE != 0 && !p.inverse);   // the inverse's come after
    Fetched current, next;
    fetch(p, row, group.rank, current);
    for (;;) {
        const i64 following = row + stride;
        const bool more = following < num_rows;   // the same for the whole group
        if (more) fetch(p, following, group.rank, next);
        rotate_row(p, row, group, current, signs, staged);
        if (!more) break;
        current = next;
        row = following;
    }
}
