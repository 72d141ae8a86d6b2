// The HIP API the kernels_hip builds use, for NVRTC on an NVIDIA GPU: 64
// consecutive threads of a block (two warps) act as one AMD wave, so that the
// HIP builds' wave64 code paths run, and can be tested, without an AMD GPU.
//
// A cross-lane operation whose partner lanes lie in the caller's own warp
// (a segment of at most 32 lanes) is the warp's own shuffle over that
// segment; any other stages the values in shared memory between two
// barriers of the wave's 64 threads, and then, as on AMD, every lane of the
// wave must take part (HIP 5.2's semantics: ROCm's amd_warp_functions.h).
#pragma once

namespace kvc_wave64 {

typedef unsigned int u32;
typedef unsigned long long u64;

constexpr int kLanes = 64;
constexpr int kMaxWaves = 15;   // named barriers 1 .. 15, one a wave: at most 960 threads a block

__device__ __forceinline__ int lane() { return threadIdx.x & (kLanes - 1); }
__device__ __forceinline__ int wave() { return threadIdx.x / kLanes; }

// The threads of this wave in the block (a partial last wave has fewer), a multiple of 32.
__device__ __forceinline__ void wave_barrier() {
    const int present = min(kLanes, int(blockDim.x) - wave() * kLanes);
    asm volatile("bar.sync %0, %1;" ::"r"(1 + wave()), "r"((present + 31) & ~31) : "memory");
}

// The value lane `source` of the wave holds (every lane of the wave calls this).
__device__ __noinline__ u32 gather(u32 value, int source) {
    __shared__ u32 staged[kMaxWaves][kLanes];
    staged[wave()][lane()] = value;
    wave_barrier();
    const u32 found = staged[wave()][source];
    wave_barrier();
    return found;
}

// The mask, within this lane's warp, of the `width`-lane segment that holds it.
__device__ __forceinline__ u32 segment_in_warp(int width) {
    return width >= 32 ? 0xffffffffu : ((1u << width) - 1u) << (threadIdx.x & 31 & ~(width - 1));
}

// Values of any 4- or 8-byte type, a 32-bit word at a time: the warp's own
// shuffle (warp_shuffle, of a word) where `in_warp` (the source lies in this
// lane's segment of at most 32 lanes), else lane `source` of the wave, gathered.
template <class T, class WarpShuffle>
__device__ __forceinline__ T shuffle(T value, int source, bool in_warp, WarpShuffle warp_shuffle) {
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "4- or 8-byte values");
    u32 words[sizeof(T) / 4];
    memcpy(words, &value, sizeof(T));
#pragma unroll
    for (int i = 0; i < int(sizeof(T) / 4); ++i) words[i] = in_warp ? warp_shuffle(words[i]) : gather(words[i], source);
    memcpy(&value, words, sizeof(T));
    return value;
}

// Lane l + offset, or l where that leaves l's `width`-lane segment (__shfl_down, __shfl_up).
__device__ __forceinline__ int shifted_source(int offset, int width) {
    const int l = lane(), within = (l & (width - 1)) + offset;
    return within < 0 || within >= width ? l : l + offset;
}

}  // namespace kvc_wave64

__device__ __forceinline__ int __lane_id() { return kvc_wave64::lane(); }

// value of lane (l ^ lane_mask), or l's own where that lies in a later segment.
template <class T>
__device__ __forceinline__ T __shfl_xor(T value, int lane_mask, int width = kvc_wave64::kLanes) {
    const int l = kvc_wave64::lane();
    const int target = l ^ lane_mask;
    const int source = target >= ((l + width) & ~(width - 1)) ? l : target;
    const unsigned segment = kvc_wave64::segment_in_warp(width);
    return kvc_wave64::shuffle(value, source, width <= 32 && lane_mask < width,
                               [&](unsigned word) { return __shfl_xor_sync(segment, word, lane_mask, width); });
}

// value of lane `source` (taken modulo width) of this lane's segment.
template <class T>
__device__ __forceinline__ T __shfl(T value, int source, int width = kvc_wave64::kLanes) {
    const int from = (kvc_wave64::lane() & ~(width - 1)) + (source & (width - 1));
    const unsigned segment = kvc_wave64::segment_in_warp(width);
    return kvc_wave64::shuffle(value, from, width <= 32,
                               [&](unsigned word) { return __shfl_sync(segment, word, source, width); });
}

// value of lane l + delta, or l's own where that leaves the segment. A delta of the
// segment's width or more leaves it from every lane (and PTX's shuffle would read
// only its low five bits).
template <class T>
__device__ __forceinline__ T __shfl_down(T value, unsigned delta, int width = kvc_wave64::kLanes) {
    if (delta >= unsigned(width)) return value;
    const unsigned segment = kvc_wave64::segment_in_warp(width);
    return kvc_wave64::shuffle(value, kvc_wave64::shifted_source(int(delta), width), width <= 32,
                               [&](unsigned word) { return __shfl_down_sync(segment, word, delta, width); });
}

// value of lane l - delta, or l's own where that leaves the segment (as __shfl_down).
template <class T>
__device__ __forceinline__ T __shfl_up(T value, unsigned delta, int width = kvc_wave64::kLanes) {
    if (delta >= unsigned(width)) return value;
    const unsigned segment = kvc_wave64::segment_in_warp(width);
    return kvc_wave64::shuffle(value, kvc_wave64::shifted_source(-int(delta), width), width <= 32,
                               [&](unsigned word) { return __shfl_up_sync(segment, word, delta, width); });
}

// Bit l set where lane l's predicate holds: each warp's ballot, then the two
// joined. (HIP's __ballot, __any and __all: CUDA declares those names itself.)
__device__ __forceinline__ unsigned long long __ballot64(int predicate) {
    const kvc_wave64::u32 own = __ballot_sync(0xffffffffu, predicate);
    const kvc_wave64::u64 low = kvc_wave64::gather(own, 0), high = kvc_wave64::gather(own, 32);
    return low | (high << 32);
}

namespace kvc_hip {

// The lanes of `mask` see each other's shared-memory writes: a warp's
// __syncwarp where they are all in this lane's warp, else the wave's barrier.
__device__ __forceinline__ void sync_wave_lanes(unsigned long long mask) {
    const unsigned own = unsigned(mask >> (threadIdx.x & 32)), other = unsigned(mask >> (32 - (threadIdx.x & 32)));
    if (other == 0u) __syncwarp(own);
    else kvc_wave64::wave_barrier();
}
__device__ __forceinline__ void opaque(unsigned& x) { asm volatile("" : "+r"(x)); }

}  // namespace kvc_hip
