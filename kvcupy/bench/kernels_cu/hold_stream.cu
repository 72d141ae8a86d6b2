// hold_stream: sleeps on the GPU for a given time (`kvcupy bench --backend cuda`).
//
// Launched ahead of a timed series, it keeps the stream busy while the host
// queues the series' calls, so the CUDA-event times that follow measure the
// GPU's work back to back, not the rate at which Python issues launches.

// %globaltimer counts nanoseconds (PTX ISA, "Special Registers: %globaltimer").
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
    return ns;
}

extern "C" __global__ void hold_stream(unsigned long long duration_ns) {
    const unsigned long long start = global_ns();
    while (global_ns() - start < duration_ns) __nanosleep(1000);   // sm_70 and newer
}
