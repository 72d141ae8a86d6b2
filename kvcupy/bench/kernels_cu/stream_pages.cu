// stream_pages: the streaming ceiling of paged decode (`kvcupy bench --backend
// cuda`, kvcupy/bench). It reads, through the block table, exactly the
// bytes a decode step over a paged cache must read (each sequence's K rows, V
// rows and, when quantized, their scales, up to its length) and does nothing
// else: the same pages, the same block table, the same split-KV grid
// (num_splits, num_seqs) as the attention, no math. Each thread block
// XOR-folds what it read into one word of `out`, so no load can be optimised
// away.
//
// Compile-time shape (-D defines, from kvcupy.bench.kernels):
//   KVC_THREADS          threads a block (the launch's block size)
//   KVC_BLOCK_SIZE       tokens a page
//   KVC_ROW_BYTES        one token's K (or V) row in a page: every KV head side by side
//   KVC_SCALE_ROW_BYTES  one token's K (or V) scales (num_kv_heads * 4); 0 for an "auto" cache
// Caches are page-major and contiguous, as allocate_cache makes them:
// key_cache [num_blocks, KVC_BLOCK_SIZE, num_kv_heads, stored_head_size].

#ifndef KVC_THREADS
#error "stream_pages.cu needs -DKVC_THREADS"
#endif
#ifndef KVC_BLOCK_SIZE
#error "stream_pages.cu needs -DKVC_BLOCK_SIZE"
#endif
#ifndef KVC_ROW_BYTES
#error "stream_pages.cu needs -DKVC_ROW_BYTES"
#endif
#ifndef KVC_SCALE_ROW_BYTES
#error "stream_pages.cu needs -DKVC_SCALE_ROW_BYTES"
#endif

// The widest load (up to 16 bytes) that tiles a row exactly, so a partly
// filled last page is read to its last token and not a byte further.
__host__ __device__ constexpr int word_bytes(int row_bytes) {
    return row_bytes % 16 == 0 ? 16 : row_bytes % 8 == 0 ? 8 : row_bytes % 4 == 0 ? 4
         : row_bytes % 2 == 0 ? 2 : 1;
}

template <int kBytes> struct Word;
template <> struct Word<16> {
    using type = uint4;
    __device__ static unsigned int fold(uint4 w) { return w.x ^ w.y ^ w.z ^ w.w; }
};
template <> struct Word<8> {
    using type = uint2;
    __device__ static unsigned int fold(uint2 w) { return w.x ^ w.y; }
};
template <> struct Word<4> {
    using type = unsigned int;
    __device__ static unsigned int fold(unsigned int w) { return w; }
};
template <> struct Word<2> {
    using type = unsigned short;
    __device__ static unsigned int fold(unsigned short w) { return w; }
};
template <> struct Word<1> {
    using type = unsigned char;
    __device__ static unsigned int fold(unsigned char w) { return w; }
};

struct StreamTraits {
    static constexpr int kThreads = KVC_THREADS;
    static constexpr int kWarps = kThreads / 32;
    static constexpr int kBlockSize = KVC_BLOCK_SIZE;
    static constexpr int kRowBytes = KVC_ROW_BYTES;
    static constexpr int kScaleRowBytes = KVC_SCALE_ROW_BYTES;
    // The scale stream's row, instantiated even for an "auto" cache, where it is never run.
    static constexpr int kScaleRowBytesOrFour = kScaleRowBytes > 0 ? kScaleRowBytes : 4;
    static constexpr int kPagesPerChunk = kThreads;   // block ids staged in shared memory at once
    static constexpr int kUnroll = 4;                  // loads in flight per thread and tensor
    static_assert(kThreads % 32 == 0 && kThreads <= 1024, "KVC_THREADS: whole warps, at most 1024");
    static_assert(kBlockSize > 0 && (kBlockSize & (kBlockSize - 1)) == 0,
                  "KVC_BLOCK_SIZE must be a power of two");
    static_assert(kRowBytes > 0, "KVC_ROW_BYTES must be positive");
    static_assert(kScaleRowBytes >= 0, "KVC_SCALE_ROW_BYTES must be >= 0 (0: no scales)");
};

// XOR of every word of rows [0, rows of each page) of the staged pages, K and V
// side by side (they share a geometry), for this thread's share of the words.
template <int kRowBytes>
__device__ unsigned int stream_rows(const unsigned char* __restrict__ first,
                                    const unsigned char* __restrict__ second,
                                    const int* pages, int num_pages, int first_page, int seq_len) {
    using Traits = StreamTraits;
    constexpr int kWordBytes = word_bytes(kRowBytes);
    using W = Word<kWordBytes>;
    using T = typename W::type;
    constexpr int kRowWords = kRowBytes / kWordBytes;
    constexpr int kPageWords = Traits::kBlockSize * kRowWords;
    constexpr long long kPageBytes = (long long)Traits::kBlockSize * kRowBytes;

    const int items = num_pages * kPageWords;
    unsigned int acc = 0;
    for (int start = threadIdx.x; start < items; start += Traits::kThreads * Traits::kUnroll) {
        T a[Traits::kUnroll], b[Traits::kUnroll];
        bool loaded[Traits::kUnroll];
#pragma unroll
        for (int u = 0; u < Traits::kUnroll; ++u) {
            const int item = start + u * Traits::kThreads;
            const int page = item / kPageWords;
            const int word = item - page * kPageWords;
            loaded[u] = false;
            if (item < items) {
                const int block = pages[page];
                const int rows = min(Traits::kBlockSize, seq_len - (first_page + page) * Traits::kBlockSize);
                if (block >= 0 && word < rows * kRowWords) {
                    const long long offset = block * kPageBytes + (long long)word * kWordBytes;
                    a[u] = *reinterpret_cast<const T*>(first + offset);
                    b[u] = *reinterpret_cast<const T*>(second + offset);
                    loaded[u] = true;
                }
            }
        }
#pragma unroll
        for (int u = 0; u < Traits::kUnroll; ++u) {
            if (loaded[u]) acc ^= W::fold(a[u]) ^ W::fold(b[u]);
        }
    }
    return acc;
}

extern "C" __global__ void __launch_bounds__(StreamTraits::kThreads)
stream_pages(const unsigned char* __restrict__ key_cache,
             const unsigned char* __restrict__ value_cache,
             const unsigned char* __restrict__ k_scale_cache,   // unread when KVC_SCALE_ROW_BYTES == 0
             const unsigned char* __restrict__ v_scale_cache,
             const int* __restrict__ block_table,               // [num_seqs, table_width]
             const int* __restrict__ seq_lens,                  // [num_seqs]
             unsigned int* __restrict__ out,                    // [num_seqs, num_splits]
             int table_width, int num_blocks) {
    using Traits = StreamTraits;
    __shared__ int pages[Traits::kPagesPerChunk];
    __shared__ unsigned int warp_words[Traits::kWarps];
    const int split = blockIdx.x;
    const int num_splits = gridDim.x;
    const int seq = blockIdx.y;

    // Lengths are clipped to the block table, as the attention kernels clip them.
    const int seq_len = max(0, min(seq_lens[seq], table_width * Traits::kBlockSize));
    const int seq_pages = (seq_len + Traits::kBlockSize - 1) / Traits::kBlockSize;
    const int pages_per_split = (seq_pages + num_splits - 1) / num_splits;
    const int begin = min(seq_pages, split * pages_per_split);
    const int end = min(seq_pages, begin + pages_per_split);

    unsigned int acc = 0;
    for (int chunk = begin; chunk < end; chunk += Traits::kPagesPerChunk) {
        const int count = min(Traits::kPagesPerChunk, end - chunk);
        __syncthreads();   // the previous chunk's ids are no longer read
        if (threadIdx.x < count) {
            const int block = block_table[(long long)seq * table_width + chunk + threadIdx.x];
            pages[threadIdx.x] = (block >= 0 && block < num_blocks) ? block : -1;   // ids are guarded
        }
        __syncthreads();
        acc ^= stream_rows<Traits::kRowBytes>(key_cache, value_cache, pages, count, chunk, seq_len);
        if (Traits::kScaleRowBytes > 0) {   // a constant: the branch compiles away
            acc ^= stream_rows<Traits::kScaleRowBytesOrFour>(k_scale_cache, v_scale_cache, pages, count,
                                                        chunk, seq_len);
        }
    }

#pragma unroll
    for (int lane_mask = 16; lane_mask > 0; lane_mask /= 2) {
        acc ^= __shfl_xor_sync(0xffffffffu, acc, lane_mask);
    }
    if (threadIdx.x % 32 == 0) warp_words[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned int word = 0;
#pragma unroll
        for (int w = 0; w < Traits::kWarps; ++w) word ^= warp_words[w];
        out[(long long)seq * num_splits + split] = word;
    }
}
