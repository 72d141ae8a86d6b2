// copy_blocks: block pairs[p, 0] onto block pairs[p, 1], in every tensor of
// every layer's cache, in one launch (copy-on-write for all layers at once).
// Block (p, t) of the grid copies pair p in tensor t.
#include "common.cuh"

namespace {

using namespace kvc;

// One tensor, as the launcher's TENSOR_COPY_FIELDS lay it out (eight 8-byte fields):
// a block is `rows` rows (slot, head) of `row_bytes` contiguous bytes.
struct TensorCopy {
    u64 base;
    i64 block_stride;   // bytes
    i64 slot_stride;    // bytes
    i64 head_stride;    // bytes
    i64 heads;
    i64 rows;           // slots * heads
    i64 row_bytes;
    i64 width;          // bytes per access: 16, 8, 4, 2 or 1, dividing every address and row_bytes
};

template <int W>
__device__ __forceinline__ void copy_rows(const TensorCopy& t, i64 source, i64 destination) {
    using T = typename Access<W == 16 ? 16 : W == 8 ? 8 : 4>::T;
    const i64 per_row = t.row_bytes / W;
    const i64 units = t.rows * per_row;
    const char* from = reinterpret_cast<const char*>(t.base) + source * t.block_stride;
    char* to = reinterpret_cast<char*>(t.base) + destination * t.block_stride;
    for (i64 i = threadIdx.x; i < units; i += blockDim.x) {
        const i64 row = i / per_row;
        const i64 slot = row / t.heads;
        const i64 offset = slot * t.slot_stride + (row - slot * t.heads) * t.head_stride + (i - row * per_row) * W;
        if constexpr (W >= 4) {
            *reinterpret_cast<T*>(to + offset) = *reinterpret_cast<const T*>(from + offset);
        } else if constexpr (W == 2) {
            *reinterpret_cast<u16*>(to + offset) = *reinterpret_cast<const u16*>(from + offset);
        } else {
            to[offset] = from[offset];
        }
    }
}

}  // namespace

// tensors [num_tensors] (TensorCopy), pairs [num_pairs, 2] int64, num_blocks: of every cache.
extern "C" __global__ void __launch_bounds__(256) copy_blocks(const TensorCopy* __restrict__ tensors,
                                                              const i64* __restrict__ pairs, i64 num_blocks) {
    const TensorCopy t = tensors[blockIdx.y];
    const i64 source = pairs[2 * i64(blockIdx.x)], destination = pairs[2 * i64(blockIdx.x) + 1];
    if (source < 0 || source >= num_blocks || destination < 0 || destination >= num_blocks) return;
    switch (t.width) {
        case 16: copy_rows<16>(t, source, destination); break;
        case 8: copy_rows<8>(t, source, destination); break;
        case 4: copy_rows<4>(t, source, destination); break;
        case 2: copy_rows<2>(t, source, destination); break;
        default: copy_rows<1>(t, source, destination); break;
    }
}
