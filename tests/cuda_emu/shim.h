// shim.h: runs the CUDA C kernels of kernels/ on the CPU, for tests on
// machines without a GPU (tests/kernels_emulated.rs compiles a kernel file
// after this header with g++ -DSTRATA_EMULATE and launches it from Rust).
//
// How it differs from a GPU:
// - every GPU thread of a block is an OS thread; blocks run one after
//   another, so `__shared__` variables are plain statics (one block at a time
//   owns them) and dynamic shared memory is one static buffer, filled with
//   NaN bytes before each block so a read of an unwritten value shows;
// - __syncthreads and __syncwarp are barriers; a thread that returns drops
//   out of them (as an exited GPU thread does);
// - warp shuffles exchange values through memory between two warp barriers,
//   so all 32 lanes must reach them (as the kernels' convergent code does);
// - mma.sync is computed element by element from the PTX ISA's fragment
//   layout for m16n8k16 bf16 (f32 products summed in k order; a tensor core
//   may round its internal sums differently);
// - expf, sqrtf and division come from the C library, not CUDA's (the last
//   bits may differ); no memory model or timing is emulated: this checks what
//   the kernels compute, not how fast or whether a race hides on a GPU.
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>

struct emu_dim3 {
    unsigned x, y, z;
};
thread_local emu_dim3 threadIdx, blockIdx;
emu_dim3 blockDim, gridDim;

static std::unique_ptr<std::barrier<>> emu_block_barrier;
static std::unique_ptr<std::barrier<>> emu_warp_barrier[32];
static uint32_t emu_xchg[1024];
alignas(16) static unsigned char emu_smem[256 * 1024];
// Per warp: A [16][16] and B [16][8] of one mma, as f32.
static float emu_mma_a[32][16][16], emu_mma_b[32][16][8];

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(uint32_t i) { float f; memcpy(&f, &i, 4); return f; }
inline uint32_t __float_as_uint(float f) { uint32_t i; memcpy(&i, &f, 4); return i; }

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }
inline void __syncwarp() { emu_warp_barrier[threadIdx.x >> 5]->arrive_and_wait(); }

inline float emu_shfl(float v, int src_lane) {
    unsigned t = threadIdx.x, w = t >> 5;
    emu_xchg[t] = __float_as_uint(v);
    __syncwarp();
    float r = __uint_as_float(emu_xchg[(w << 5) | (src_lane & 31)]);
    __syncwarp();
    return r;
}
inline float __shfl_xor_sync(unsigned, float v, int o) { return emu_shfl(v, (threadIdx.x & 31) ^ o); }
inline float __shfl_sync(unsigned, float v, int src) { return emu_shfl(v, src); }

inline float emu_f16_to_f32(uint16_t h) {
    uint32_t s = (h >> 15) & 1, e = (h >> 10) & 31, m = h & 1023;
    float v;
    if (e == 0) v = std::ldexp((float)m, -24);
    else if (e == 31) v = m ? NAN : INFINITY;
    else v = std::ldexp((float)(m | 1024), (int)e - 25);
    return s ? -v : v;
}

inline float emu_bf16(uint32_t bits16) { return __uint_as_float(bits16 << 16); }

// c += a·b for one warp, each lane passing its fragments (PTX ISA,
// "Matrix Fragments for mma.m16n8k16" with .bf16): groupID = lane / 4,
// tig = lane % 4. A (16x16): element i of 8 (register i/2, half i%2) is at
// row groupID + 8·((i/2)%2), column 2·tig + i%2 + 8·(i/4). B (16x8): element
// i of 4 at row (k) 2·tig + i%2 + 8·(i/2), column groupID. C (16x8): element i
// of 4 at row groupID + 8·(i/2), column 2·tig + i%2.
inline void emu_mma_bf16(float* c, const uint32_t* a, const uint32_t* b) {
    unsigned lane = threadIdx.x & 31, w = threadIdx.x >> 5, g = lane >> 2, tig = lane & 3;
    for (int i = 0; i < 8; i++) {
        uint32_t bits = (a[i / 2] >> (16 * (i % 2))) & 0xffffu;
        emu_mma_a[w][g + 8 * ((i / 2) % 2)][2 * tig + i % 2 + 8 * (i / 4)] = emu_bf16(bits);
    }
    for (int i = 0; i < 4; i++) {
        uint32_t bits = (b[i / 2] >> (16 * (i % 2))) & 0xffffu;
        emu_mma_b[w][2 * tig + i % 2 + 8 * (i / 2)][g] = emu_bf16(bits);
    }
    __syncwarp();
    for (int i = 0; i < 4; i++) {
        unsigned row = g + 8 * (i / 2), col = 2 * tig + i % 2;
        float acc = c[i];
        for (int k = 0; k < 16; k++) acc += emu_mma_a[w][row][k] * emu_mma_b[w][k][col];
        c[i] = acc;
    }
    __syncwarp();
}

// The launcher's side (called from Rust).
extern "C" void emu_launch(unsigned gx, unsigned gy, unsigned bx) {
    gridDim = {gx, gy, 1};
    blockDim = {bx, 1, 1};
}
extern "C" void emu_block_begin(unsigned threads) {
    emu_block_barrier = std::make_unique<std::barrier<>>(threads);
    for (unsigned w = 0; w < 32; w++) {
        unsigned lanes = threads > 32 * w ? (threads - 32 * w < 32 ? threads - 32 * w : 32) : 0;
        emu_warp_barrier[w] = lanes ? std::make_unique<std::barrier<>>(lanes) : nullptr;
    }
    memset(emu_smem, 0xff, sizeof emu_smem);
}
extern "C" void emu_thread_begin(unsigned tx, unsigned bx, unsigned by) {
    threadIdx = {tx, 0, 0};
    blockIdx = {bx, by, 0};
}
extern "C" void emu_thread_end() {
    emu_warp_barrier[threadIdx.x >> 5]->arrive_and_drop();
    emu_block_barrier->arrive_and_drop();
}
