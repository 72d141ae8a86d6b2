// The HIP build of kernels_cu/write.cu (reshape_and_cache: rotate, quantize and scatter K and V into the cache):
// the same source, its kernel, parameters and -D defines, over hip_compat.h's primitives.
#include "hip_compat.h"
#include "write.cu"
