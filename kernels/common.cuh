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
