// Helpers the write, rotate and copy kernels share: storage traits over
// types.cuh, vectorised loads and stores of runs, and groups of lanes that hold
// one vector together.
#pragma once

#include "types.cuh"   // kvc::half, kvc::bfloat16, kvc::u8, kvc::i8: formats.CPP_TYPES' names

namespace kvc {

using i64 = long long;

__host__ __device__ constexpr int log2_of(int n) { return n <= 1 ? 0 : 1 + log2_of(n / 2); }
__host__ __device__ constexpr bool is_pow2(int n) { return n > 0 && (n & (n - 1)) == 0; }

// --- storage types --------------------------------------------------------
// Scalar<T>: how a model or cache dtype travels in registers (Bits, zero-extended
// in a u32) and converts; types.cuh's conversions round to nearest even, as
// NumPy's and ml_dtypes' astype do.
template <class T> struct Scalar;

template <> struct Scalar<float> {
    using Bits = u32;
    static __device__ __forceinline__ float to_float(u32 b) { return __uint_as_float(b); }
    static __device__ __forceinline__ u32 from_float(float f) { return __float_as_uint(f); }
};
// 16-bit types also convert two values at once (one cvt.rn.*x2.f32), first in the low half.
template <> struct Scalar<half> {
    using Bits = u16;
    static __device__ __forceinline__ float to_float(u32 b) { return kvc::to_float(half{u16(b)}); }
    static __device__ __forceinline__ u32 from_float(float f) { return kvc::from_float<half>(f).bits; }
    static __device__ __forceinline__ u32 from_float2(float a, float b) { return pack_half2(a, b); }
};
template <> struct Scalar<bfloat16> {
    using Bits = u16;
    static __device__ __forceinline__ float to_float(u32 b) { return __uint_as_float(b << 16); }
    static __device__ __forceinline__ u32 from_float(float f) { return kvc::from_float<bfloat16>(f).bits; }
    static __device__ __forceinline__ u32 from_float2(float a, float b) { return pack_bf162(a, b); }
};
template <> struct Scalar<u8> { using Bits = u8; };
template <> struct Scalar<i8> { using Bits = u8; };

// --- runs of bytes ---------------------------------------------------------
// A run is a short stretch of consecutive elements one lane loads or stores.
// Its bytes travel as 32-bit words (element i of a 2-byte type is half i % 2
// of word i / 2), so that two 16-bit values share one register. `align` is
// the alignment in bytes the host proved for every run start (pointer and
// strides together, a power of two); the widest access it allows is used.

template <int BYTES> struct Words { static constexpr int count = (BYTES + 3) / 4; u32 w[count]; };

template <int W> struct Access;
template <> struct Access<16> { using T = uint4; };
template <> struct Access<8> { using T = uint2; };
template <> struct Access<4> { using T = u32; };

template <int W, int BYTES>
__device__ __forceinline__ void load_as(const void* p, Words<BYTES>& out) {
    using T = typename Access<W>::T;
    union { T t[BYTES / W]; u32 w[BYTES / 4]; } u;
#pragma unroll
    for (int i = 0; i < BYTES / W; ++i) u.t[i] = static_cast<const T*>(p)[i];
#pragma unroll
    for (int i = 0; i < BYTES / 4; ++i) out.w[i] = u.w[i];
}

template <int W, int BYTES>
__device__ __forceinline__ void store_as(void* p, const Words<BYTES>& in) {
    using T = typename Access<W>::T;
    union { T t[BYTES / W]; u32 w[BYTES / 4]; } u;
#pragma unroll
    for (int i = 0; i < BYTES / 4; ++i) u.w[i] = in.w[i];
#pragma unroll
    for (int i = 0; i < BYTES / W; ++i) static_cast<T*>(p)[i] = u.t[i];
}

// Loads BYTES (a multiple of 2) from p; p is at least 2-byte aligned.
template <int BYTES>
__device__ __forceinline__ void load_run(const void* p, Words<BYTES>& out, int align) {
    static_assert(BYTES % 2 == 0, "runs hold whole 16-bit values");
    if constexpr (BYTES % 16 == 0) { if (align >= 16) { load_as<16>(p, out); return; } }
    if constexpr (BYTES % 8 == 0) { if (align >= 8) { load_as<8>(p, out); return; } }
    if constexpr (BYTES % 4 == 0) { if (align >= 4) { load_as<4>(p, out); return; } }
    const u16* h = static_cast<const u16*>(p);
#pragma unroll
    for (int i = 0; i < Words<BYTES>::count; ++i) {
        const u32 high = 2 * i + 1 < BYTES / 2 ? u32(h[2 * i + 1]) : 0u;
        out.w[i] = u32(h[2 * i]) | (high << 16);
    }
}

// Stores BYTES (any count) to p.
template <int BYTES>
__device__ __forceinline__ void store_run(void* p, const Words<BYTES>& in, int align) {
    if constexpr (BYTES % 16 == 0) { if (align >= 16) { store_as<16>(p, in); return; } }
    if constexpr (BYTES % 8 == 0) { if (align >= 8) { store_as<8>(p, in); return; } }
    if constexpr (BYTES % 4 == 0) { if (align >= 4) { store_as<4>(p, in); return; } }
    if constexpr (BYTES % 2 == 0) {
        if (align >= 2) {
            u16* h = static_cast<u16*>(p);
#pragma unroll
            for (int i = 0; i < BYTES / 2; ++i) h[i] = u16(in.w[i / 2] >> (16 * (i % 2)));
            return;
        }
    }
    u8* b = static_cast<u8*>(p);
#pragma unroll
    for (int i = 0; i < BYTES; ++i) b[i] = u8(in.w[i / 4] >> (8 * (i % 4)));
}

// Element i of a run of 16- or 32-bit values held as words.
template <int SIZE, int BYTES>
__device__ __forceinline__ u32 element_bits(const Words<BYTES>& run, int i) {
    if constexpr (SIZE == 4) return run.w[i];
    else return (run.w[i / 2] >> (16 * (i % 2))) & 0xffffu;
}

template <int SIZE, int BYTES>
__device__ __forceinline__ void set_element_bits(Words<BYTES>& run, int i, u32 bits) {
    if constexpr (SIZE == 4) {
        run.w[i] = bits;
    } else if constexpr (SIZE == 2) {
        if (i % 2 == 0) run.w[i / 2] = bits;
        else run.w[i / 2] |= bits << 16;
    } else {
        if (i % 4 == 0) run.w[i / 4] = bits;
        else run.w[i / 4] |= bits << (8 * (i % 4));
    }
}

// values[0 .. N-1] converted to T (round to nearest even) as a run of words.
template <class T, int N>
__device__ __forceinline__ void to_run(const float* values, Words<N * sizeof(typename Scalar<T>::Bits)>& run) {
    constexpr int kSize = sizeof(typename Scalar<T>::Bits);
    if constexpr (kSize == 2) {
#pragma unroll
        for (int i = 0; i + 1 < N; i += 2) run.w[i / 2] = Scalar<T>::from_float2(values[i], values[i + 1]);
        if constexpr (N % 2) run.w[N / 2] = Scalar<T>::from_float(values[N - 1]);
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) run.w[i] = Scalar<T>::from_float(values[i]);
    }
}

// --- lanes that hold one vector -------------------------------------------
// LANES consecutive lanes of a wave (a power of two) share one vector.
// Shuffles stay inside the group (width = LANES), and the mask names only
// its lanes, so a group whose token is padding may leave early.
template <int LANES>
struct LaneGroup {
    static_assert(is_pow2(LANES) && LANES <= 32, "a vector spans a power of two of lanes, at most a warp");
    LaneMask mask;
    int rank;   // this lane's place in the group

    __device__ __forceinline__ LaneGroup() {
        const int lane = lane_in_wave();
        rank = lane & (LANES - 1);
        mask = segment_lanes<LANES>(lane);
    }
    template <class T>
    __device__ __forceinline__ T exchange(T value, int lane_mask) const {
        return exchange_lanes(mask, value, lane_mask, LANES);
    }
    __device__ __forceinline__ void sync() const { sync_lanes(mask); }
    __device__ __forceinline__ float min(float v) const {
#pragma unroll
        for (int o = 1; o < LANES; o *= 2) v = min_nan(v, exchange(v, o));
        return v;
    }
    __device__ __forceinline__ float max(float v) const {
#pragma unroll
        for (int o = 1; o < LANES; o *= 2) v = max_nan(v, exchange(v, o));
        return v;
    }
};

// The smallest and largest of the values one lane holds.
struct LaneRange {
    float lo, hi;
};

// Power-of-two alignment in bytes of (base + byte offset), given the base's.
__device__ __forceinline__ int alignment_at(int base_align, i64 byte_offset) {
    const int low = int(byte_offset & 15);
    return low == 0 ? base_align : min(base_align, low & -low);
}

}  // namespace kvc
