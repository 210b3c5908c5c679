// shim.h: runs the CUDA C kernels of kernels/ on the CPU, for tests on
// machines without a GPU (tests/kernels_emulated.rs compiles a kernel file
// after this header with g++ -DSTRATA_EMULATE and launches it from Rust).
//
// How it differs from a GPU:
// - a block's GPU threads are coroutines on one OS thread (a hand-written
//   x86-64 stack switch: ucontext's signal-mask syscalls cost more than the
//   kernels); blocks
//   run one after another, so `__shared__` variables are plain statics (one
//   block at a time owns them) and dynamic shared memory is one static
//   buffer, filled with NaN bytes before each block so a read of an unwritten
//   value shows;
// - __syncthreads and __syncwarp are barriers a thread waits at by yielding
//   to the others; a thread that returns drops out of them (as an exited GPU
//   thread does); threads interleave only at barriers, so a missing barrier
//   shows only if the order it leaves to chance matters here;
// - warp shuffles exchange values through memory between two warp barriers,
//   so all 32 lanes must reach them (as the kernels' convergent code does);
// - ldmatrix exchanges row addresses like a shuffle; cp.async copies wait
//   in a per-thread queue and land at the cp.async.wait_group that covers
//   them, not when issued;
// - mma.sync is computed element by element from the PTX ISA's fragment
//   layout for m16n8k16 bf16 (f32 products summed in k order; a tensor core
//   may round its internal sums differently);
// - expf, sqrtf and division come from the C library, not CUDA's (the last
//   bits may differ); no memory model or timing is emulated: this checks what
//   the kernels compute, not how fast or whether a race hides on a GPU.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

struct emu_dim3 {
    unsigned x, y, z;
};
emu_dim3 threadIdx, blockIdx, blockDim, gridDim;

// A barrier of `expected` threads; waiting yields until the generation moves.
struct emu_barrier {
    int expected, arrived, generation;
};
static emu_barrier emu_block_barrier, emu_warp_barrier[32];
static uint32_t emu_xchg[1024];
alignas(16) static unsigned char emu_smem[256 * 1024];
// Per warp: A [16][16] and B [16][8] of one mma, as f32.
static float emu_mma_a[32][16][16], emu_mma_b[32][16][8];

// The coroutines of the running block: each has its own stack; emu_switch
// saves the callee-saved registers on the current stack, stores the stack
// pointer in *from and resumes the stack `to` (System V x86-64).
#if !defined(__x86_64__)
#error "the CUDA emulation's coroutine switch is written for x86-64"
#endif
extern "C" void emu_switch(void** from, void* to);
asm(R"(
.text
.globl emu_switch
.type emu_switch,@function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size emu_switch, .-emu_switch
)");
static void* emu_sched_sp;
static void* emu_sp[1024];
static unsigned char* emu_stacks;
static const size_t EMU_STACK = 64 * 1024;
static bool emu_done[1024];
static unsigned emu_cur;

static inline void emu_yield() { emu_switch(&emu_sp[emu_cur], emu_sched_sp); }

static inline void emu_wait(emu_barrier& b) {
    int gen = b.generation;
    if (++b.arrived >= b.expected) {
        b.arrived = 0;
        b.generation++;
    } else {
        while (b.generation == gen) emu_yield();
    }
}

static inline void emu_drop(emu_barrier& b) {
    b.expected--;
    if (b.arrived > 0 && b.arrived >= b.expected) {
        b.arrived = 0;
        b.generation++;
    }
}

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(uint32_t i) { float f; memcpy(&f, &i, 4); return f; }
inline uint32_t __float_as_uint(float f) { uint32_t i; memcpy(&i, &f, 4); return i; }

inline void __syncthreads() { emu_wait(emu_block_barrier); }
inline void __syncwarp() { emu_wait(emu_warp_barrier[threadIdx.x >> 5]); }

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

// ldmatrix.x4 for one warp: lane l passes the address of row l % 8 of matrix
// l / 8; r[i] gets matrix i's (row lane/4, columns 2·(lane%4), +1), or with
// `trans` its (rows 2·(lane%4), +1, column lane/4) (PTX ISA, "ldmatrix").
static const void* emu_xptr[1024];
inline void emu_ldmatrix_x4(uint32_t* r, const void* row, bool trans) {
    unsigned t = threadIdx.x, w = t >> 5, lane = t & 31;
    emu_xptr[t] = row;
    __syncwarp();
    for (int i = 0; i < 4; i++) {
        uint16_t e[2];
        for (int h = 0; h < 2; h++) {
            unsigned src_row = trans ? 2 * (lane & 3) + h : lane >> 2;
            unsigned col = trans ? lane >> 2 : 2 * (lane & 3) + h;
            memcpy(&e[h], (const unsigned char*)emu_xptr[(w << 5) | (i * 8 + src_row)] + 2 * col, 2);
        }
        r[i] = (uint32_t)e[0] | ((uint32_t)e[1] << 16);
    }
    __syncwarp();
}

// cp.async: each thread's copies wait in its queue, by group, and land only
// when a wait_group lets them (so reading a tile before its wait shows).
struct emu_copy {
    void* dst;
    const void* src;
    int bytes;
    int group;
};
static const int EMU_COPIES = 128;
static emu_copy emu_copies[1024][EMU_COPIES];
static int emu_ncopies[1024], emu_group[1024];
inline void emu_cp_async16(void* dst, const void* src, int bytes) {
    unsigned t = threadIdx.x;
    if (emu_ncopies[t] >= EMU_COPIES) abort();  // more in flight than the emulation holds
    emu_copies[t][emu_ncopies[t]++] = {dst, src, bytes, emu_group[t]};
}
inline void emu_cp_async_commit() { emu_group[threadIdx.x]++; }
inline void emu_cp_async_wait(int newest_pending) {
    unsigned t = threadIdx.x;
    int keep = 0;
    for (int i = 0; i < emu_ncopies[t]; i++) {
        emu_copy c = emu_copies[t][i];
        if (c.group < emu_group[t] - newest_pending) {
            memset(c.dst, 0, 16);
            if (c.bytes) memcpy(c.dst, c.src, c.bytes);
        } else {
            emu_copies[t][keep++] = c;
        }
    }
    emu_ncopies[t] = keep;
}

// The launcher's side (called from Rust): runs `grid` blocks of `threads`
// coroutines, each calling `call(params)`.
static void (*emu_call)(void**);
static void** emu_params;

static void emu_entry() {
    emu_call(emu_params);
    emu_done[emu_cur] = true;
    emu_drop(emu_warp_barrier[emu_cur >> 5]);
    emu_drop(emu_block_barrier);
    emu_switch(&emu_sp[emu_cur], emu_sched_sp);  // never resumed
    __builtin_unreachable();
}

extern "C" void emu_run(unsigned gx, unsigned gy, unsigned threads, void (*call)(void**), void** params,
                        unsigned smem) {
    gridDim = {gx, gy, 1};
    blockDim = {threads, 1, 1};
    emu_call = call;
    emu_params = params;
    if (!emu_stacks) emu_stacks = (unsigned char*)aligned_alloc(64, EMU_STACK * 1024);
    for (unsigned by = 0; by < gy; by++)
        for (unsigned bx = 0; bx < gx; bx++) {
            blockIdx = {bx, by, 0};
            emu_block_barrier = {(int)threads, 0, 0};
            for (unsigned w = 0; w < 32; w++) {
                unsigned lanes = threads > 32 * w ? (threads - 32 * w < 32 ? threads - 32 * w : 32) : 0;
                emu_warp_barrier[w] = {(int)lanes, 0, 0};
            }
            memset(emu_smem, 0xff, smem < sizeof emu_smem ? smem : sizeof emu_smem);
            for (unsigned t = 0; t < threads; t++) {
                // A fresh stack whose first switch "returns" into emu_entry:
                // six zero registers, the address, and below them a dummy
                // return slot, so emu_entry starts with rsp = 8 mod 16 as
                // after a call (the System V ABI's alignment).
                void** sp = (void**)(emu_stacks + (t + 1) * EMU_STACK - 16);
                *--sp = nullptr;
                *--sp = (void*)emu_entry;
                for (int r = 0; r < 6; r++) *--sp = nullptr;
                emu_sp[t] = sp;
                emu_done[t] = false;
                emu_ncopies[t] = 0;  // copies a thread never waited for do not outlive its block
                emu_group[t] = 0;
            }
            // Round-robin until every thread has returned; each runs until it
            // waits at a barrier (yields) or returns.
            for (unsigned left = threads; left > 0;) {
                left = 0;
                for (unsigned t = 0; t < threads; t++) {
                    if (emu_done[t]) continue;
                    emu_cur = t;
                    threadIdx = {t, 0, 0};
                    emu_switch(&emu_sched_sp, emu_sp[t]);
                    if (!emu_done[t]) left++;
                }
            }
        }
}
