// PTX wrappers the decode and prefill kernels share: bit operations, mma.sync,
// cp.async, mbarriers and bulk copies (sm_90), programmatic dependent launch,
// exp2 and warp reductions. Each is one instruction or a short fixed sequence.
#pragma once

#include "types.cuh"

namespace kvc {

__device__ __forceinline__ u32 lop_and_or(u32 x, u32 mask, u32 bits) {
  u32 r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "r"(mask), "r"(bits));  // (x & m) | b
  return r;
}

// a - b on fp16 pairs (exact where both are integers under 2048).
__device__ __forceinline__ u32 sub_half2(u32 a, u32 b) {
  u32 r;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 selector) {
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
  return r;
}


template <bool BF16>
__device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
  if constexpr (BF16) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

__device__ __forceinline__ void cp_async(void* shared, const void* global, int bytes_valid, int size) {
  u32 address = static_cast<u32>(__cvta_generic_to_shared(shared));
  if (size == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global), "r"(bytes_valid));
  } else if (size == 8) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(address), "l"(global), "r"(bytes_valid));
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(address), "l"(global), "r"(bytes_valid));
  }
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// mbarrier and bulk copies (sm_90): a stage's barrier completes when every
// thread has arrived and the bytes each announced have landed. Older archs
// compile them to traps: the launcher never picks bulk staging there.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define KVC_SM90(statement) __trap()
#else
#define KVC_SM90(statement) statement
#endif

__device__ __forceinline__ u32 shared_address(const void* pointer) {
  return static_cast<u32>(__cvta_generic_to_shared(pointer));
}

__device__ __forceinline__ void mbarrier_init(void* barrier, int count) {
  KVC_SM90(asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(count)
                        : "memory"));
}

__device__ __forceinline__ void mbarrier_arrive_expect(void* barrier, u32 bytes) {
  KVC_SM90(asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
                        ::"r"(shared_address(barrier)), "r"(bytes) : "memory"));
}

__device__ __forceinline__ void mbarrier_arrive(void* barrier) {
  KVC_SM90(asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(barrier)) : "memory"));
}

__device__ __forceinline__ void mbarrier_wait(void* barrier, u32 parity) {
  u32 done = 0;
  while (!done) {
    KVC_SM90(asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                          " selp.u32 %0, 1, 0, p;\n}\n"
                          : "=r"(done) : "r"(shared_address(barrier)), "r"(parity) : "memory"));
  }
}

// Orders shared-memory accesses this thread has seen (generic proxy) before its
// later bulk copies (async proxy).
__device__ __forceinline__ void fence_proxy_async() {
  KVC_SM90(asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"));
}

__device__ __forceinline__ void bulk_copy(void* shared, const void* global, u32 bytes, void* barrier) {
  KVC_SM90(asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                        ::"r"(shared_address(shared)), "l"(global), "r"(bytes), "r"(shared_address(barrier))
                        : "memory"));
}

// shared -> global, `bytes` (a multiple of 16, both ends 16-byte aligned) by the
// copy engine; bulk_stores_read waits until every such copy this thread issued
// has read its source (the shared memory may then change or go away).
__device__ __forceinline__ void bulk_store(void* global, const void* shared, u32 bytes) {
  KVC_SM90(asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;\n"
                        ::"l"(global), "r"(shared_address(shared)), "r"(bytes) : "memory"));
}

__device__ __forceinline__ void bulk_stores_read() {
  KVC_SM90(asm volatile("cp.async.bulk.commit_group;\n cp.async.bulk.wait_group.read 0;\n" ::: "memory"));
}

// The barrier's arrival of this thread, fired once every cp.async it issued
// before has landed; .noinc: that arrival is one of the count the barrier was
// initialised with (row staging: one a thread and phase).
__device__ __forceinline__ void cp_async_arrive_noinc(void* barrier) {
  KVC_SM90(asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(shared_address(barrier))
                        : "memory"));
}

// 2^x to ~2 ulp (MUFU.EX2); exact 0 for -inf, NaN for NaN.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float max_over_quad(float x) {   // the 4 lanes of one groupID
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float sum_over_quad(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Over the 8 lanes g of one t: the tokens of a score fragment's columns.
__device__ __forceinline__ float max_over_columns(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}

__device__ __forceinline__ float sum_over_columns(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}

// Programmatic dependent launch (sm_90; Tuning.dependent_launch): the attention grid
// is launched so that its blocks may start while the kernel ahead of it still
// runs, and the merge so that its blocks may start while the attention grid
// runs. Each waits for the grid ahead (its results visible) before reading
// anything, and only then lets its own dependent in. Launched plainly, both
// instructions are no-ops.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(KVC_NO_PTX)
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(KVC_NO_PTX)
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

}  // namespace kvc
