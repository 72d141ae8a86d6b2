// Hopper warpgroup products (wgmma.mma_async, sm_90a): a warpgroup of 4 warps
// computes D[64 x N] += A[64 x 16] . B[16 x N], fp16 operands (bf16 ones with
// Products' BF16), fp32 accumulators, asynchronously: issue, commit, wait.
//
// Register layouts are those of mma.sync.m16n8k16, warp w of the warpgroup
// holding rows 16 w .. 16 w + 15: accumulator d[j][i] of lane (g, t) is row
// g + 8 (i / 2), column 8 j + 2t + i % 2; an A fragment from registers is the
// m16n8k16 A fragment of the warp's 16 rows.
//
// Operands in shared memory use the layout without swizzling: "core
// matrices" of 8 rows x 16 bytes (8 fp16), each 128 contiguous bytes, row r at
// byte 16 r. A descriptor gives the start and two byte strides: between core
// matrices adjacent along K (the "leading" one) and along M or N (the
// "stride" one), whichever dimension is contiguous inside a core matrix
// (PTX ISA, "Matrix Descriptor Format"; CUTLASS's GmmaDescriptor names the
// INTERLEAVE layouts of both majors the same way).
#pragma once

#include "types.cuh"

// Compiled only for sm_90a (the launcher asks for it); elsewhere a trap, never launched.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KVC_WGMMA_ASM(statement) statement
#else
#define KVC_WGMMA_ASM(statement) __trap()
#endif

namespace kvc_wgmma {

using kvc::u32;
using u64 = unsigned long long;

// Byte offset of element (row, col) of a [rows][cols] fp16 tile in that layout,
// the core matrices of 8 rows side by side along the columns: between column
// neighbours 128 bytes, between row neighbours 16 cols bytes.
__host__ __device__ constexpr int core_offset(int row, int col, int cols) {
  return (row >> 3) * cols * 16 + (col >> 3) * 128 + (row & 7) * 16 + (col & 7) * 2;
}

// Descriptor of an operand at `shared` (16-byte aligned) in the layout above.
// SWIZZLE_BYTES 128 or 64: a swizzled layout instead (below; the strides then
// mean what it says).
template <int SWIZZLE_BYTES = 0>
__device__ __forceinline__ u64 descriptor(const void* shared, u32 leading_bytes, u32 stride_bytes) {
  static_assert(SWIZZLE_BYTES == 0 || SWIZZLE_BYTES == 64 || SWIZZLE_BYTES == 128, "a layout wgmma reads");
  // Layout type, bits 62-63: 0 none, 1 the 128-byte swizzle, 2 the 64-byte one.
  constexpr u64 kLayout = SWIZZLE_BYTES == 128 ? 1 : SWIZZLE_BYTES == 64 ? 2 : 0;
  const u32 address = static_cast<u32>(__cvta_generic_to_shared(shared));
  return static_cast<u64>((address & 0x3FFFFu) >> 4) | static_cast<u64>(leading_bytes >> 4) << 16 |
         static_cast<u64>(stride_bytes >> 4) << 32 |   // base offset 0
         kLayout << 62;
}

// The swizzled layouts of a [rows][cols] 16-bit tile, W = BYTES (128 or 64;
// cols a multiple of W / 2), 1024-byte aligned: cols in columns of W / 2 (W
// bytes), column c of all rows at c x rows x W bytes, row r's W bytes at W r
// within it, holding its 16-byte pieces in the order piece ^ phase(r), phase
// the bits of W r above its 128-byte line: the hardware's swizzle (128: address
// bits 4-6 XOR bits 7-9, phase r % 8; 64: bits 4-5 XOR bits 7-8, phase (r / 2) % 4).
// A row's pieces then lie in distinct bank groups, as do the two rows that
// share a 128-byte line at W = 64, so a warp that writes whole rows writes
// without conflict, and the products read it as the unswizzled layout. The
// phase repeats every 8 rows: an 8-row group of a column is one W x 8 atom.
// As a K-major operand (rows along M or N): stride 8 W bytes between 8-row
// groups, the leading offset unused (16), a k step of 16 cols 32 bytes on
// within a column and rows x W from one column to the next. As an MN-major
// one (rows along K): leading offset rows x W (between columns), stride 8 W
// (8-row groups), a k step of 16 rows 16 W bytes on (PTX ISA "Matrix
// Descriptor Format"; CUTLASS's make_gmma_desc names the strides the same way).
template <int BYTES>
__host__ __device__ constexpr int swizzled_offset(int row, int col, int rows) {
  static_assert(BYTES == 128 || BYTES == 64, "a swizzle wgmma reads");
  constexpr int kPieces = BYTES / 16;
  const int phase = (row * BYTES >> 7) & (kPieces - 1);
  return col / (BYTES / 2) * rows * BYTES + row * BYTES + ((((col >> 3) & (kPieces - 1)) ^ phase) << 4) + (col & 7) * 2;
}

// Before a warpgroup's first product that touches accumulators written by ordinary instructions.
__device__ __forceinline__ void fence() { KVC_WGMMA_ASM(asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory")); }
__device__ __forceinline__ void commit() {
  KVC_WGMMA_ASM(asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"));
}
// Until at most N committed groups of this warpgroup are still running.
template <int N>
__device__ __forceinline__ void wait() {
  KVC_WGMMA_ASM(asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"));
}

// Keeps the compiler from moving reads or writes of accumulators across an
// issue or a wait (the hardware writes them in between).
template <int J>
__device__ __forceinline__ void hold(float (&d)[J][4]) {
#pragma unroll
  for (int j = 0; j < J; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[j][i])::"memory");
}

#define KVC_D(j) "+f"(d[j][0]), "+f"(d[j][1]), "+f"(d[j][2]), "+f"(d[j][3])
#define KVC_D32 KVC_D(0), KVC_D(1), KVC_D(2), KVC_D(3)
#define KVC_D64 KVC_D32, KVC_D(4), KVC_D(5), KVC_D(6), KVC_D(7)
#define KVC_D96 KVC_D64, KVC_D(8), KVC_D(9), KVC_D(10), KVC_D(11)
#define KVC_D128 KVC_D96, KVC_D(12), KVC_D(13), KVC_D(14), KVC_D(15)
#define KVC_R32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
#define KVC_R64 KVC_R32 ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define KVC_R96 KVC_R64 ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47"
#define KVC_R128 KVC_R96 ", %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"

// ss: A and B from shared memory, both K-major. rs_mn: A from registers, B
// MN-major (B[k][n] with n contiguous: rows of a [token][dim] tile as B = V);
// rs_k: A from registers, B K-major (rows of a [token][dim] tile as B = K^T).
// a0..a5: the operand numbers after the N / 2 accumulators.
#define KVC_WGMMA_SHAPE(N, D, R, a0, a1, a2, a3, a4, a5)                                                      \
  template <bool BF16>                                                                                        \
  struct Products<N, BF16> {                                                                                  \
    static __device__ __forceinline__ void ss(float (&d)[N / 8][4], u64 a, u64 b) {                           \
      if constexpr (BF16)                                                                                     \
        KVC_WGMMA_ASM(asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                               \
                                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" R "}, %" #a0  \
                                   ", %" #a1 ", p, 1, 1, 0, 0;\n}\n"                                          \
                                   : D : "l"(a), "l"(b)));                                                    \
      else                                                                                                    \
        KVC_WGMMA_ASM(asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                               \
                                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16 {" R "}, %" #a0    \
                                   ", %" #a1 ", p, 1, 1, 0, 0;\n}\n"                                          \
                                   : D : "l"(a), "l"(b)));                                                    \
    }                                                                                                         \
    static __device__ __forceinline__ void rs_mn(float (&d)[N / 8][4], const u32 (&a)[4], u64 b) {            \
      rs<1>(d, a, b);                                                                                         \
    }                                                                                                         \
    static __device__ __forceinline__ void rs_k(float (&d)[N / 8][4], const u32 (&a)[4], u64 b) {             \
      rs<0>(d, a, b);                                                                                         \
    }                                                                                                         \
    template <int TRANSPOSE_B>                                                                                \
    static __device__ __forceinline__ void rs(float (&d)[N / 8][4], const u32 (&a)[4], u64 b) {               \
      if constexpr (BF16)                                                                                     \
        KVC_WGMMA_ASM(asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                               \
                                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" R "}, {%" #a0 \
                                   ", %" #a1 ", %" #a2 ", %" #a3 "}, %" #a4 ", p, 1, 1, %" #a5 ";\n}\n"       \
                                   : D : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TRANSPOSE_B))); \
      else                                                                                                    \
        KVC_WGMMA_ASM(asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                               \
                                   "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.f16.f16 {" R "}, {%" #a0   \
                                   ", %" #a1 ", %" #a2 ", %" #a3 "}, %" #a4 ", p, 1, 1, %" #a5 ";\n}\n"       \
                                   : D : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(TRANSPOSE_B))); \
    }                                                                                                         \
  };

template <int N, bool BF16 = false>
struct Products;
KVC_WGMMA_SHAPE(32, KVC_D32, KVC_R32, 16, 17, 18, 19, 20, 21)
KVC_WGMMA_SHAPE(64, KVC_D64, KVC_R64, 32, 33, 34, 35, 36, 37)
KVC_WGMMA_SHAPE(96, KVC_D96, KVC_R96, 48, 49, 50, 51, 52, 53)
KVC_WGMMA_SHAPE(128, KVC_D128, KVC_R128, 64, 65, 66, 67, 68, 69)

#undef KVC_WGMMA_SHAPE
#undef KVC_D
#undef KVC_D32
#undef KVC_D64
#undef KVC_D96
#undef KVC_D128
#undef KVC_R32
#undef KVC_R64
#undef KVC_R96
#undef KVC_R128

}  // namespace kvc_wgmma
