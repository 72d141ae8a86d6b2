// Probes of mfma.h, one kernel a wrapper, for tests only (no launcher builds
// this entry): compiled offline for gfx90a and gfx942, whose disassembly must
// hold each wrapper's v_mfma instruction, and by NVRTC through the emulation,
// which tests/gpu/test_mfma_emulation.py runs against NumPy.
//
// A block is whole waves of 64 lanes; wave w multiplies its own matrices:
// d[w] = a[w][0] * b[w][0] + ... + a[w][calls-1] * b[w][calls-1] + c[w], one
// instruction a product, each fragment loaded from row-major matrices by the
// lane layouts in mfma_on_cuda.cuh's header. A is 16 x K, B K x 16, C and D
// 16 x 16; elements are their bits (16-bit: half or bfloat16; 8-bit: int8 or
// e4m3fnuz).
#include "mfma.h"

namespace {

using kvc_mfma::u32;

__device__ __forceinline__ int probe_lane() { return threadIdx.x % 64; }
__device__ __forceinline__ int probe_wave() { return threadIdx.x / 64; }

// One operand register: the 4 / sizeof(T) elements of `m` (`columns` wide,
// row-major) from (row, col) along the row (A) or down the column (B), the first in the low bits.
template <class T>
__device__ __forceinline__ u32 along_row(const T* m, int columns, int row, int col) {
    u32 word = 0;
    for (int t = 0; t < int(4 / sizeof(T)); ++t) word |= u32(m[row * columns + col + t]) << (8 * sizeof(T) * t);
    return word;
}
template <class T>
__device__ __forceinline__ u32 down_column(const T* m, int columns, int row, int col) {
    u32 word = 0;
    for (int t = 0; t < int(4 / sizeof(T)); ++t) word |= u32(m[(row + t) * columns + col]) << (8 * sizeof(T) * t);
    return word;
}
__device__ __forceinline__ long long pair(u32 low, u32 high) {
    return static_cast<long long>((static_cast<unsigned long long>(high) << 32) | low);
}

// Lane l = 16 g + i holds A[i][4g .. 4g+3] and B[4g .. 4g+3][i] (16x16x16), or
// A[i][8g .. 8g+7] and B[8g .. 8g+7][i] (16x16x32); C and D[4g+e][i].
template <class Acc, class T>
__device__ __forceinline__ Acc load_acc(const T* c) {
    const int l = probe_lane();
    Acc acc;
    for (int e = 0; e < 4; ++e) acc[e] = c[(4 * (l / 16) + e) * 16 + l % 16];
    return acc;
}
template <class Acc, class T>
__device__ __forceinline__ void store_acc(const Acc& acc, T* d) {
    const int l = probe_lane();
    for (int e = 0; e < 4; ++e) d[(4 * (l / 16) + e) * 16 + l % 16] = acc[e];
}

// The four elements of a lane's 16x16x16 operand, as two words.
template <class T>
__device__ __forceinline__ void operands_x16(const T* a, const T* b, u32 (&a_words)[2], u32 (&b_words)[2]) {
    const int i = probe_lane() % 16, k = 4 * (probe_lane() / 16);
    a_words[0] = along_row(a, 16, i, k);
    a_words[1] = along_row(a, 16, i, k + 2);
    b_words[0] = down_column(b, 16, k, i);
    b_words[1] = down_column(b, 16, k + 2, i);
}

// The eight bytes of a lane's 16x16x32 operand.
__device__ __forceinline__ void operands_x32(const unsigned char* a, const unsigned char* b, long long& a_bytes,
                                             long long& b_bytes) {
    const int i = probe_lane() % 16, k = 8 * (probe_lane() / 16);
    a_bytes = pair(along_row(a, 32, i, k), along_row(a, 32, i, k + 4));
    b_bytes = pair(down_column(b, 16, k, i), down_column(b, 16, k + 4, i));
}

}  // namespace

#if KVC_MFMA_HAS_F16
extern "C" __global__ void mfma_f16_probe(const unsigned short* a, const unsigned short* b, const float* c, float* d,
                                          int calls) {
    const int w = probe_wave();
    kvc_mfma::f32x4 acc = load_acc<kvc_mfma::f32x4>(c + 256 * w);
    for (int n = 0; n < calls; ++n) {
        u32 a_words[2], b_words[2];
        operands_x16(a + 256 * (w * calls + n), b + 256 * (w * calls + n), a_words, b_words);
        acc = kvc_mfma::mfma_f32_16x16x16_f16(kvc_mfma::f16x4_of_words(a_words[0], a_words[1]),
                                              kvc_mfma::f16x4_of_words(b_words[0], b_words[1]), acc);
    }
    store_acc(acc, d + 256 * w);
}
#endif

#if KVC_MFMA_HAS_BF16
extern "C" __global__ void mfma_bf16_probe(const unsigned short* a, const unsigned short* b, const float* c, float* d,
                                           int calls) {
    const int w = probe_wave();
    kvc_mfma::f32x4 acc = load_acc<kvc_mfma::f32x4>(c + 256 * w);
    for (int n = 0; n < calls; ++n) {
        u32 a_words[2], b_words[2];
        operands_x16(a + 256 * (w * calls + n), b + 256 * (w * calls + n), a_words, b_words);
        acc = kvc_mfma::mfma_f32_16x16x16_bf16(kvc_mfma::bf16x4_of_words(a_words[0], a_words[1]),
                                               kvc_mfma::bf16x4_of_words(b_words[0], b_words[1]), acc);
    }
    store_acc(acc, d + 256 * w);
}
#endif

#if KVC_MFMA_HAS_I8_16X16X16
// One word a lane: A[i][4g .. 4g+3] and B[4g .. 4g+3][i], a byte each.
extern "C" __global__ void mfma_i8_16x16x16_probe(const unsigned char* a, const unsigned char* b, const int* c, int* d,
                                                  int calls) {
    const int w = probe_wave(), i = probe_lane() % 16, k = 4 * (probe_lane() / 16);
    kvc_mfma::i32x4 acc = load_acc<kvc_mfma::i32x4>(c + 256 * w);
    for (int n = 0; n < calls; ++n) {
        const unsigned char *an = a + 256 * (w * calls + n), *bn = b + 256 * (w * calls + n);
        acc = kvc_mfma::mfma_i32_16x16x16_i8(int(along_row(an, 16, i, k)), int(down_column(bn, 16, k, i)), acc);
    }
    store_acc(acc, d + 256 * w);
}

// The decomposition gfx90a's 16x16x32 wrapper uses, run where 16x16x16 exists.
extern "C" __global__ void mfma_i8_16x16x32_halves_probe(const unsigned char* a, const unsigned char* b, const int* c,
                                                         int* d, int calls) {
    const int w = probe_wave();
    kvc_mfma::i32x4 acc = load_acc<kvc_mfma::i32x4>(c + 256 * w);
    for (int n = 0; n < calls; ++n) {
        long long a_bytes, b_bytes;
        operands_x32(a + 512 * (w * calls + n), b + 512 * (w * calls + n), a_bytes, b_bytes);
        acc = kvc_mfma::mfma_i32_16x16x32_i8_by_halves(a_bytes, b_bytes, acc);
    }
    store_acc(acc, d + 256 * w);
}
#endif

#if KVC_MFMA_HAS_I8_16X16X32
extern "C" __global__ void mfma_i8_16x16x32_probe(const unsigned char* a, const unsigned char* b, const int* c, int* d,
                                                  int calls) {
    const int w = probe_wave();
    kvc_mfma::i32x4 acc = load_acc<kvc_mfma::i32x4>(c + 256 * w);
    for (int n = 0; n < calls; ++n) {
        long long a_bytes, b_bytes;
        operands_x32(a + 512 * (w * calls + n), b + 512 * (w * calls + n), a_bytes, b_bytes);
        acc = kvc_mfma::mfma_i32_16x16x32_i8(a_bytes, b_bytes, acc);
    }
    store_acc(acc, d + 256 * w);
}
#endif

#if KVC_MFMA_HAS_FP8
extern "C" __global__ void mfma_fp8_probe(const unsigned char* a, const unsigned char* b, const float* c, float* d,
                                          int calls) {
    const int w = probe_wave();
    kvc_mfma::f32x4 acc = load_acc<kvc_mfma::f32x4>(c + 256 * w);
    for (int n = 0; n < calls; ++n) {
        long long a_bytes, b_bytes;
        operands_x32(a + 512 * (w * calls + n), b + 512 * (w * calls + n), a_bytes, b_bytes);
        acc = kvc_mfma::mfma_f32_16x16x32_fp8(a_bytes, b_bytes, acc);
    }
    store_acc(acc, d + 256 * w);
}
#endif

#if defined(KVC_MFMA_EMULATED)
// The emulation's e4m3fnuz decoder over all 256 codes (one block of 256 threads).
extern "C" __global__ void e4m3fnuz_probe(float* out) {
    out[threadIdx.x] = kvc_mfma_emu::e4m3fnuz_to_float(threadIdx.x);
}
#endif
