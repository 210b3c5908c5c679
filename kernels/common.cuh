// common.cuh: what every kernel shares. Pasted in place of each kernel
// source's include line (NVRTC is given no include path), so it must compile
// with NVRTC alone: no CUDA headers, no C++ standard headers. bf16, f16 and
// FP8 are handled through their bits.
//
// Conventions: activations are f32, row-major; a block of columns of a
// buffer is (pointer, row stride, column offset). Every reduction has a fixed
// shape for a given launch, so results are the same run to run and do not
// depend on how many rows a batch has (batch invariance).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// bf16 bits to f32: the upper half of an f32.
__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }

// f32 to bf16 bits, rounding to nearest even (NaN stays a quiet NaN), as the
// CPU backend and PyTorch round.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

// IEEE f16 bits to f32, exactly (PTX cvt; cuda_fp16.h is not available).
__device__ __forceinline__ float f16_to_f32(u16 h) {
#ifndef STRATA_EMULATE
    float f;
    asm("{ .reg .f16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
    return f;
#else
    return emu_f16_to_f32(h);  // tests/cuda_emu/shim.h: the CPU emulation's stand-in for the PTX
#endif
}

// FP8 E4M3 (e4m3fn) code to f32: 1 sign, 4 exponent (bias 7), 3 mantissa
// bits; no infinities; 0x7f and 0xff are NaN. Same as the host's decode.
__device__ __forceinline__ float fp8_e4m3_to_f32(u8 b) {
    u32 e = (b >> 3) & 15u, m = b & 7u;
    float v;
    if (e == 15u && m == 7u) v = __uint_as_float(0x7fc00000u);
    else if (e == 0u) v = (float)m * (1.0f / 512.0f);
    else v = __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) ? -v : v;
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + expf(-g)); }

// Element i of n in a grid-stride loop, in 32 bits: n < 2^31 (the backend
// refuses more, see `elementwise` in backend.rs), so a row and column are a
// 32-bit division, not a 64-bit one (tens of instructions per element).
// Addresses are formed in 64 bits where a product can pass 2^32.
#define GRID_STRIDE(i, n) for (u32 i = blockIdx.x * blockDim.x + threadIdx.x; i < (u32)(n); i += gridDim.x * blockDim.x)

// Sum over a warp; every lane gets the total (same order on every lane).
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Max over a warp; every lane gets it.
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of at most 1024 threads (a multiple of 32); every thread
// gets the total. `shm` holds 32 floats. Fixed order for a fixed blockDim.
__device__ __forceinline__ float block_sum(float v, float* shm) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // shm may still be read by a previous call
    if (lane == 0) shm[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? shm[lane] : 0.0f;
    return warp_sum(t);
}

// Shared-memory copies and loads through PTX (sm_80+). Under the CPU
// emulation they are tests/cuda_emu/shim.h's: its cp.async lands only at the
// wait, so a tile read before its wait reads what was there before.
#ifndef STRATA_EMULATE
// The shared-window address of a generic pointer into shared memory.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
#endif

// 16 bytes from global `src` to shared `dst` (both 16-byte aligned),
// asynchronously; zeros instead when `!in` (src is then not read).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool in) {
#ifdef STRATA_EMULATE
    emu_cp_async16(dst, src, in ? 16 : 0);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(in ? 16 : 0));
#endif
}

// Closes this thread's group of cp.async copies.
__device__ __forceinline__ void cp_async_commit() {
#ifdef STRATA_EMULATE
    emu_cp_async_commit();
#else
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Waits until every group of this thread's copies but the newest one has landed.
__device__ __forceinline__ void cp_async_wait_1() {
#ifdef STRATA_EMULATE
    emu_cp_async_wait(1);
#else
    asm volatile("cp.async.wait_group 1;" ::: "memory");
#endif
}

// attention.cu: one segment of a step. Pointers are device addresses of
// key/value row 0 (of the segment's first position); strides are in values.
// attention_f32 reads f32 rows (head g at column g·hd); attention_bf16_vN
// reads bf16 rows of kv_heads heads, each padded with zeros to dp = hd and
// vp = vd rounded up to 16 (head g at column g·dp), 16-byte aligned. Here,
// not in attention.cu, because the kernels' prototypes (generated by
// build.rs and pasted after this header) name it.
struct Seg {
    u64 k;
    u64 v;
    int k_stride;
    int v_stride;
    int q_row0;  // the segment's first row in q and out
    int q_len;   // its queries
    int pos0;    // position of its first query
    int kv_len;  // keys it may see: pos0 + q_len
};
