// The Hadamard rotation of docs/format.md in registers: a vector of d = ROWS * POW2
// values spread over a group of lanes, transformed with float64 butterflies
// and warp shuffles, bit for bit what cpu_kernels.rotate_rows computes.
// Vectors of 16-bit inputs try an integer path first that computes the same
// sums exactly where float64 does not round (exact_grid, at the end).
//
// Exactness: the CPU transform converts each float32 input to float64,
// applies the radix-2 Sylvester stages h = 1, 2, 4, ... (its radix-4 first
// step performs the same additions), then for kron the mix sum_a w[r][a] *
// row_a in the order a = 0, 1, ... starting from 0.0, then divides once and
// rounds once to float32. Every float64 operation here is that same addition
// of the same two operands: a + b commutes exactly, a - b is computed as
// a + (-b) (IEEE's definition of subtraction, signed zeros included; never as
// -(b - a), which gives -0 where a - b gives +0), and a sign is applied by
// flipping the sign bit (exactly a multiplication by -1).
#pragma once

#include "common.cuh"

namespace kvc {

// Where each value lives. Lane `rank` of a group holds, for every row a, the
// COLUMNS consecutive columns rank*COLUMNS .. +COLUMNS-1 of that row (slot
// a*COLUMNS + s holds element a*POW2 + rank*COLUMNS + s): the "initial" layout,
// in which inputs are loaded. Butterfly stages with h < COLUMNS are local.
// A stage with h = COLUMNS << k pairs lane bit k with its partner lane. The
// first kSwaps such stages exchange only half the values: the lane keeps the
// pairs whose column bit (log2 COLUMNS - 1 - k) equals its own lane bit k, and
// the two bits trade places. The remaining cross stages (when COLUMNS is too
// short to give up more bits) exchange all values. Afterwards ("final"
// layout) each lane holds runs of kRun consecutive columns, final_column says
// where; kRun >= 2 keeps the two values of an int4 byte in one lane. With one
// column a lane (kron with m = 20 or 28 rows: fewer registers), nothing is
// swapped and lanes 2i, 2i+1 hold the two values of a byte. Without
// a transform (ROTATED false), or with SWAPS false (every cross stage
// exchanges all values: the exact integer path's choice, see exact_rotation),
// nothing moves: the final layout is the initial one.
//
// CHUNK < COLUMNS (layouts without swaps only) spreads a lane's columns
// instead: chunks of CHUNK consecutive columns, chunk j of lane `rank` at
// column j * CHUNK * kLanes + rank * CHUNK (column()). A group's lanes then lie
// side by side in memory, so that a load or store instruction covers whole
// lines where runs of COLUMNS apart would make it touch a sector of each of 4x
// the lines. The butterflies pair the same values either way: the lane bits are
// column bits log2 CHUNK.. instead of the top ones, the slot bits the rest,
// and a Sylvester transform is the same product of H_2 over every bit.
template <int HEAD_SIZE, int POW2, int ROWS, int COLUMNS, bool ROTATED = true, bool SWAPS = true,
          int CHUNK = COLUMNS>
struct RotationLayout {
    static constexpr int kHeadSize = HEAD_SIZE;
    static constexpr int kPow2 = POW2;
    static constexpr int kRows = ROWS;
    static constexpr int kColumns = COLUMNS;
    static constexpr int kLanes = POW2 / COLUMNS;
    static constexpr int kValues = ROWS * COLUMNS;        // per lane
    static constexpr int kColumnBits = log2_of(COLUMNS);
    static constexpr int kLaneBits = log2_of(kLanes);
    static constexpr int kSwaps =
        !ROTATED || !SWAPS || kColumnBits <= 1 ? 0 : kLaneBits < kColumnBits - 1 ? kLaneBits : kColumnBits - 1;
    static constexpr int kRun = COLUMNS >> kSwaps;
    static constexpr int kRunsPerRow = 1 << kSwaps;

    static_assert(HEAD_SIZE == ROWS * POW2, "d = rows x pow2");
    static_assert(is_pow2(POW2) && is_pow2(COLUMNS), "power-of-two transform and runs");
    static_assert(COLUMNS <= POW2 && COLUMNS <= 32, "columns per lane <= min(pow2, 32)");
    static_assert(kLanes <= 32, "a vector spans at most one warp");
    static_assert(kRun >= 2 || COLUMNS == 1, "an int4 byte's two values stay in one lane, or in lanes 2i, 2i+1");
    static constexpr int kChunk = CHUNK;
    static_assert(is_pow2(CHUNK) && CHUNK <= COLUMNS && (CHUNK == COLUMNS || kSwaps == 0),
                  "chunks: a power of two, in layouts without swaps");
    // The final layout as pieces of consecutive columns: the runs, or the chunks.
    static constexpr int kPiece = CHUNK < COLUMNS ? CHUNK : kRun;
    static constexpr int kPiecesPerRow = COLUMNS / kPiece;

    // Column (within its row) of slot `slot` (0 .. COLUMNS-1) of lane `rank`, initial layout.
    static __device__ __forceinline__ int column(int rank, int slot) {
        return (slot / CHUNK) * (CHUNK * kLanes) + rank * CHUNK + slot % CHUNK;
    }

    // First column (within its row) of run t (0 .. kRunsPerRow-1) of lane `rank`, final layout.
    static __device__ __forceinline__ int final_column(int rank, int t) {
        int column = 0;
#pragma unroll
        for (int k = 0; k < kLaneBits; ++k) {
            const int lane_bit = (rank >> k) & 1;
            if (k < kSwaps) {
                column |= lane_bit << (kColumnBits - 1 - k);
                column |= ((t >> (kSwaps - 1 - k)) & 1) << (kColumnBits + k);
            } else {
                column |= lane_bit << (kColumnBits + k);
            }
        }
        return column;
    }

    // First column of piece q (0 .. kPiecesPerRow-1) of lane `rank`, final layout.
    static __device__ __forceinline__ int final_piece_column(int rank, int q) {
        return CHUNK < COLUMNS ? column(rank, q * CHUNK) : final_column(rank, q);
    }
};

// -x for a set bit: the sign bit flipped, as a multiplication by -1 would.
__device__ __forceinline__ double negate_if(double x, u32 bit) {
    return __hiloint2double(__double2hiint(x) ^ int(bit << 31), __double2loint(x));
}
__device__ __forceinline__ float negate_if(float x, u32 bit) {
    return __uint_as_float(__float_as_uint(x) ^ (bit << 31));
}

// The words the host uploads per rotation plan (the launcher's rotation_words):
// sign bits (bit i set: s[i] = -1), then the kron mix as one word per row
// (bit a of word r set: M[r][a] = -1), forward and transposed.
constexpr int kSignWords = 8;                     // 256 bits
constexpr int kMixWords = 32;                     // rows <= 28
constexpr int kForwardMix = kSignWords;
constexpr int kInverseMix = kSignWords + kMixWords;

// `count` consecutive sign bits starting at bit `first` (a multiple of count <= 32).
__device__ __forceinline__ u32 sign_bits(const u32* __restrict__ words, int first, int count) {
    const u32 word = __ldg(words + (first >> 5)) >> (first & 31);
    return count >= 32 ? word : word & ((1u << count) - 1u);
}

// Butterflies of every row, h = 1 .. POW2/2; values in the initial layout on
// entry, in the final layout on return.
template <class Layout, class Group>
__device__ __forceinline__ void hadamard_rows(double (&v)[Layout::kValues], const Group& group) {
    constexpr int C = Layout::kColumns;
    // The CPU's order of stages, column bit 0 first: with chunks (rotation.cuh,
    // RotationLayout) the slot bits below log2 kChunk, then the lane bits, then
    // the slot bits above. The order changes no exact sum, but float64's
    // roundings and the signs of exact zeros follow it.
    const auto local_stage = [&](int h) {
#pragma unroll
        for (int a = 0; a < Layout::kRows; ++a) {
#pragma unroll
            for (int s = 0; s < C; ++s) {
                if (s & h) continue;
                const double x = v[a * C + s], y = v[a * C + s + h];
                v[a * C + s] = __dadd_rn(x, y);
                v[a * C + s + h] = __dsub_rn(x, y);
            }
        }
    };
#pragma unroll
    for (int h = 1; h < Layout::kChunk; h *= 2) local_stage(h);
#pragma unroll
    for (int k = 0; k < Layout::kSwaps; ++k) {
        const int b = 1 << (Layout::kColumnBits - 1 - k);   // the column bit traded for lane bit k
        const u32 upper = (group.rank >> k) & 1;
#pragma unroll
        for (int a = 0; a < Layout::kRows; ++a) {
#pragma unroll
            for (int s = 0; s < C; ++s) {
                if (s & b) continue;
                // The lower lane keeps slot s and sends slot s|b; the upper the reverse.
                const double lo = v[a * C + s], hi = v[a * C + (s | b)];
                const double sent = upper ? lo : hi;
                const double own = upper ? hi : lo;
                const double received = group.exchange(sent, 1 << k);
                // Lower: own + received, own - received. Upper: received + own,
                // received - own. IEEE defines x - y as x + (-y); -(own - received)
                // would differ from received - own in the sign of an exact zero.
                v[a * C + s] = __dadd_rn(own, received);
                v[a * C + (s | b)] = __dadd_rn(negate_if(own, upper), negate_if(received, upper ^ 1u));
            }
        }
    }
#pragma unroll
    for (int k = Layout::kSwaps; k < Layout::kLaneBits; ++k) {
        const u32 upper = (group.rank >> k) & 1;
#pragma unroll
        for (int i = 0; i < Layout::kValues; ++i) {
            const double received = group.exchange(v[i], 1 << k);
            // Lower: v + received. Upper: received - v = (-v) + received.
            v[i] = __dadd_rn(negate_if(v[i], upper), received);
        }
    }
#pragma unroll
    for (int h = Layout::kChunk; h < C; h *= 2) local_stage(h);
}

// The kron mix: row r becomes sum_a M[r][a] * row_a, summed a = 0, 1, ... from
// 0.0 (the CPU's order). mix_words: one sign word per row (forward or
// transposed). Every lane holds all rows of its columns, so this is local.
template <class Layout>
__device__ __forceinline__ void mix_rows(double (&v)[Layout::kValues], const u32* __restrict__ mix_words) {
    constexpr int C = Layout::kColumns;
    u32 negative[Layout::kRows];
#pragma unroll
    for (int r = 0; r < Layout::kRows; ++r) negative[r] = __ldg(mix_words + r);
    // One column at a time: kRows temporaries rather than a second copy of all values.
#pragma unroll
    for (int s = 0; s < C; ++s) {
        // Opaque per column: otherwise the compiler extracts all kRows^2 sign bits
        // once and keeps them live (across the K and V transforms too), which
        // costs hundreds of registers for m = 20, 28.
#pragma unroll
        for (int r = 0; r < Layout::kRows; ++r) opaque_register(negative[r]);
        double mixed[Layout::kRows];
#pragma unroll
        for (int r = 0; r < Layout::kRows; ++r) {
            double sum = 0.0;
#pragma unroll
            for (int a = 0; a < Layout::kRows; ++a)
                sum = __dadd_rn(sum, negate_if(v[a * C + s], (negative[r] >> a) & 1u));
            mixed[r] = sum;
        }
#pragma unroll
        for (int r = 0; r < Layout::kRows; ++r) v[r * C + s] = mixed[r];
    }
}

// Sign bits of the lane's values in the initial layout (forward) or the
// final layout (inverse), one bit per slot, slot order.
template <class Layout>
__device__ __forceinline__ void initial_signs(const u32* __restrict__ words, int rank, u32 (&bits)[Layout::kRows]) {
    constexpr int K = Layout::kChunk;
#pragma unroll
    for (int a = 0; a < Layout::kRows; ++a) {
        u32 row = 0;
#pragma unroll
        for (int j = 0; j < Layout::kColumns / K; ++j)
            row |= sign_bits(words, a * Layout::kPow2 + Layout::column(rank, j * K), K) << (j * K);
        bits[a] = row;
    }
}

template <class Layout>
__device__ __forceinline__ void final_signs(const u32* __restrict__ words, int rank, u32 (&bits)[Layout::kRows]) {
#pragma unroll
    for (int a = 0; a < Layout::kRows; ++a) {
        u32 row = 0;
#pragma unroll
        for (int q = 0; q < Layout::kPiecesPerRow; ++q)
            row |= sign_bits(words, a * Layout::kPow2 + Layout::final_piece_column(rank, q), Layout::kPiece)
                   << (q * Layout::kPiece);
        bits[a] = row;
    }
}

// A lane's forward signs. Short lanes (at most 32 values: the tuned layouts)
// set them up once per thread and hold them, the lane's columns never change
// as it walks vectors; longer lanes, whose registers are spoken for, read them
// again for each vector. Held, with ON_WORDS (16-bit inputs read in place, an
// even number of columns a lane), they become one xor mask per input word
// (bits 15 and 31: the word's two elements), applied to the raw runs before
// conversion (flipping a 16-bit sign bit is exactly a negation of the
// converted value); otherwise they are sign bits per row, applied by widen.
// `active` false: no signs (no rotation). HOLD false: read for each vector
// whatever the lane's length (the rotate kernel's float32 inputs and read
// orders, whose held bits cost it registers it spills).
template <class Layout, bool ON_WORDS, bool HOLD = true>
struct LaneSigns {
    static constexpr bool kHeld = HOLD && Layout::kValues <= 32;
    static constexpr bool kPerWord = kHeld && ON_WORDS && Layout::kColumns % 2 == 0;
    static constexpr int kRunWords = Layout::kColumns / 2;   // 16-bit elements, two a word
    const u32* rotation;
    int rank;
    bool active;
    u32 words[kPerWord ? Layout::kRows * kRunWords : 1];
    u32 held[Layout::kRows];   // unused (and dropped) unless kHeld

    __device__ __forceinline__ LaneSigns(const u32* __restrict__ rotation_words, int lane_rank, bool on)
        : rotation(rotation_words), rank(lane_rank), active(on) {
        if constexpr (kHeld) {
#pragma unroll
            for (int a = 0; a < Layout::kRows; ++a) held[a] = 0u;
            if (active) initial_signs<Layout>(rotation, rank, held);
        }
        if constexpr (kPerWord) {
#pragma unroll
            for (int a = 0; a < Layout::kRows; ++a) {
#pragma unroll
                for (int w = 0; w < kRunWords; ++w)
                    words[a * kRunWords + w] =
                        (((held[a] >> (2 * w)) & 1u) << 15) | (((held[a] >> (2 * w + 1)) & 1u) << 31);
                held[a] = 0u;   // carried by the masks
            }
        }
    }

    // The sign bits widen applies (none where the word masks carry them).
    __device__ __forceinline__ void bits(u32 (&out)[Layout::kRows]) const {
#pragma unroll
        for (int a = 0; a < Layout::kRows; ++a) out[a] = kHeld ? held[a] : 0u;
        if constexpr (!kHeld) {
            if (active) initial_signs<Layout>(rotation, rank, out);
        }
    }

    // Applies the word masks to a lane's raw input runs (where they are used).
    template <class Run>
    __device__ __forceinline__ void apply(Run (&runs)[Layout::kRows]) const {
        if constexpr (kPerWord) {
#pragma unroll
            for (int a = 0; a < Layout::kRows; ++a)
#pragma unroll
                for (int w = 0; w < kRunWords; ++w) runs[a].w[w] ^= words[a * kRunWords + w];
        }
    }
};

// x (the lane's values, initial layout, float32) -> double, with the signs
// `bits` applied (forward rotation) or not (bits all zero).
template <class Layout>
__device__ __forceinline__ void widen(const float (&x)[Layout::kValues], const u32 (&bits)[Layout::kRows],
                                      double (&v)[Layout::kValues]) {
    constexpr int C = Layout::kColumns;
#pragma unroll
    for (int i = 0; i < Layout::kValues; ++i)
        v[i] = double(negate_if(x[i], (bits[i / C] >> (i % C)) & 1u));
}

// --- the exact integer path ----------------------------------------------
// For nearly every vector of 16-bit inputs the float64 transform above never
// rounds: each partial sum fits in float64. It then equals the same sums done
// in 32-bit integers on a common grid, which cost a fraction of the float64
// adds and their conversions (a quarter of the add rate on sm_90; together
// they bound the write and rotate kernels). A group takes this path when
// every |x| * 2^k is an integer below 2^22, for the k its largest magnitude
// sets (largest * 2^k < 2^22):
//   - a sum of POW2 <= 256 such integers stays below 2^30, so the int32 adds
//     are exact, as the float64 adds were;
//   - an input with P significant bits lands on the grid when it is at least
//     2^(22 - P) times the largest (14 binades for bfloat16, 11 for half).
//     A vector with a smaller value, a NaN or inf, or a grid outside
//     float32's normal range takes the float64 path;
//   - so does a vector holding a zero: float64's butterflies can give -0 from
//     zero inputs ((-0) + (-0), or -0 less an exact cancellation's +0) where
//     the integers give +0. Without zero inputs every zero result is +0 in both.
// float(n) * 2^-k then rounds the exact sum once to float32, as
// __double2float_rn does (scaling a normal float by a power of two is exact).
template <class T> struct SignificantBits { static constexpr int value = 0; };   // 0: no integer path
template <> struct SignificantBits<bfloat16> { static constexpr int value = 8; };
template <> struct SignificantBits<half> { static constexpr int value = 11; };

// x * 2^k + 1.5 * 2^23 holds the integer x * 2^k (|x * 2^k| < 2^22) in its low
// bits, offset by the magic's own bits: one FMA converts a value to the grid.
constexpr float kGridMagic = 12582912.0f;
constexpr u32 kGridMagicBits = 0x4b400000u;

struct ExactGrid {
    bool ok;         // the vector fits: take the integer path
    float to_grid;   // 2^k
    float unit;      // 2^-k
};

// A lane's largest and smallest |x|, exact_grid's inputs.
struct Extremes {
    float largest;    // NaN where an x is NaN
    float smallest;
};

template <int VALUES>
__device__ __forceinline__ Extremes lane_extremes(const float (&x)[VALUES]) {
    float largest = 0.0f, smallest = __uint_as_float(0x7f800000u);
#pragma unroll
    for (int i = 0; i < VALUES; ++i) {
        largest = max_nan(largest, fabsf(x[i]));   // NaN: exponent field 255, rejected below
        smallest = fminf(smallest, fabsf(x[i]));
    }
    return {largest, smallest};
}

// The same from the raw words of 16-bit inputs (two a word, signs applied or
// not): |x| orders as its bits less the sign, NaN and inf above every finite
// value, so one u16x2 max and one min (a single VIMNMX each on sm_90) take two
// values at once, where the float path spends two FMNMX a value.
template <class T, int ROWS, int BYTES>   // T: a 16-bit type (SignificantBits > 0)
__device__ __forceinline__ Extremes lane_extremes_of_bits(const Words<BYTES> (&runs)[ROWS]) {
    u32 high = 0u, low = ~0u;
#pragma unroll
    for (int a = 0; a < ROWS; ++a) {
#pragma unroll
        for (int w = 0; w < Words<BYTES>::count; ++w) {
            const u32 magnitudes = runs[a].w[w] & 0x7fff7fffu;
            high = __vmaxu2(high, magnitudes);
            low = __vminu2(low, magnitudes);
        }
    }
    return {Scalar<T>::to_float(max(high & 0xffffu, high >> 16)), Scalar<T>::to_float(min(low & 0xffffu, low >> 16))};
}

template <int SIGNIFICANT_BITS, class Group>
__device__ __forceinline__ ExactGrid exact_grid(const Extremes& lane, const Group& group) {
    const float largest = group.max(lane.largest);
    const float smallest = group.min(lane.smallest);
    // largest in [2^(top-127), 2^(top-126)): k = 148 - top puts it below 2^22.
    // A zero fails the smallest's test: see the note above.
    const int top = int((__float_as_uint(largest) >> 23) & 0xffu);
    const bool ok = top >= 22 && top <= 254 &&   // non-finite (255), or a subnormal grid
                    smallest >= __uint_as_float(u32(top + SIGNIFICANT_BITS - 22) << 23);
    return {ok, __uint_as_float(u32(275 - top) << 23), __uint_as_float(u32(top - 21) << 23)};
}

// exact_grid for a group's 16-bit inputs T: from their raw words on sm_90, from
// the lane's values x (the same numbers, signs applied or not) elsewhere.
template <class T, int ROWS, int BYTES, int VALUES, class Group>
__device__ __forceinline__ ExactGrid exact_grid_of(const Words<BYTES> (&runs)[ROWS], const float (&x)[VALUES],
                                                   const Group& group) {
#if __CUDA_ARCH__ >= 900
    const Extremes lane = lane_extremes_of_bits<T>(runs);
#else
    const Extremes lane = lane_extremes(x);
#endif
    return exact_grid<SignificantBits<T>::value>(lane, group);
}

// hadamard_rows on the grid: y = float(H x * 2^k) * unit, for a layout
// without swaps (every cross stage exchanges all values: one shuffle and one
// multiply-add each, fewer instructions than a swap's selects). The adds
// run on the offset values (magic + n) in wrapping u32 arithmetic: a
// Sylvester row other than the first sums to zero, so the offsets cancel
// everywhere but in column 0 of each row, which drops POW2 of them.
// SCALED false leaves y = float(H x * 2^k): the caller applies `unit` (write.cu
// folds it into the quantizer's reciprocal scale), and gets the lane's smallest
// and largest y in `extremes` (from the integers, three at a time: float()
// keeps their order).

template <class Layout, bool SCALED = true, class Group>
__device__ __forceinline__ void exact_rotation(const float (&x)[Layout::kValues], const ExactGrid& grid,
                                               const Group& group, float unit, float (&y)[Layout::kValues],
                                               LaneRange* extremes = nullptr) {
    static_assert(Layout::kSwaps == 0, "the integer stages keep the initial layout");
    constexpr int C = Layout::kColumns;
    u32 n[Layout::kValues];
#pragma unroll
    for (int i = 0; i < Layout::kValues; ++i) n[i] = __float_as_uint(__fmaf_rn(x[i], grid.to_grid, kGridMagic));
    // Local stages two at a time (h and 2h: three-input adds), the last one alone.
#pragma unroll
    for (int h = 1; h < C; h *= 4) {
#pragma unroll
        for (int a = 0; a < Layout::kRows; ++a) {
            u32* row = n + a * C;
#pragma unroll
            for (int s = 0; s < C; ++s) {
                if (4 * h <= C) {
                    if (s & (3 * h)) continue;
                    const u32 p = row[s] + row[s + h], q = row[s] - row[s + h];
                    const u32 c = row[s + 2 * h], d = row[s + 3 * h];
                    row[s] = p + c + d;
                    row[s + h] = q + c - d;
                    row[s + 2 * h] = p - c - d;
                    row[s + 3 * h] = q - c + d;
                } else {
                    if (s & h) continue;
                    const u32 p = row[s] + row[s + h], q = row[s] - row[s + h];
                    row[s] = p;
                    row[s + h] = q;
                }
            }
        }
    }
#pragma unroll
    for (int k = 0; k < Layout::kLaneBits; ++k) {
        const u32 sign = (group.rank >> k) & 1 ? ~0u : 1u;   // upper lane: received - own
#pragma unroll
        for (int i = 0; i < Layout::kValues; ++i) n[i] = n[i] * sign + group.exchange(n[i], 1 << k);
    }
    if (group.rank == 0) {
#pragma unroll
        for (int a = 0; a < Layout::kRows; ++a) n[a * C] -= kGridMagicBits * u32(Layout::kPow2);
    }
#pragma unroll
    for (int i = 0; i < Layout::kValues; ++i) {
        y[i] = __int2float_rn(int(n[i]));
        if (SCALED) y[i] = __fmul_rn(y[i], unit);
    }
    if (!SCALED && extremes != nullptr) {
        int lo = int(n[0]), hi = int(n[0]);
#pragma unroll
        for (int i = 1; i < Layout::kValues; i += 2) {
            const int second = i + 1 < Layout::kValues ? int(n[i + 1]) : int(n[i]);
            lo = __vimin3_s32(lo, int(n[i]), second);
            hi = __vimax3_s32(hi, int(n[i]), second);
        }
        *extremes = {__int2float_rn(lo), __int2float_rn(hi)};
    }
}

}  // namespace kvc
