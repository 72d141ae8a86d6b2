// The HIP build of kernels_cu/copy_blocks.cu (copy_blocks: copy-on-write of cache blocks in every tensor):
// the same source, its kernel, parameters and -D defines, over hip_compat.h's primitives.
#include "hip_compat.h"
#include "copy_blocks.cu"
