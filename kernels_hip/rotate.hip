// The HIP build of kernels_cu/rotate.cu (rotate_rows: the rotation of rows, forward or inverse):
// the same source, its kernel, parameters and -D defines, over hip_compat.h's primitives.
#include "hip_compat.h"
#include "rotate.cu"
