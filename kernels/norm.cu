// norm.cu: RMSNorm of rows, and of heads in place (Qwen3's q/k norm; MiniMax-M2's
// over all heads, split across ranks, in two halves around an all-reduce).
// One block per row (or head); the sum of squares is a block reduction of
// fixed shape, so a row's result does not depend on the batch.
#include "common.cuh"

__device__ __forceinline__ float as_f32(float v) { return v; }
__device__ __forceinline__ float as_f32(u16 v) { return bf16_to_f32(v); }

// 1 / rms of `width` values at `row` (the block's reduction, one shape per launch).
template <typename T>
__device__ __forceinline__ float inv_rms(const T* row, int width, float eps, float* shm) {
    float ss = 0.0f;
    for (int c = threadIdx.x; c < width; c += blockDim.x) ss += as_f32(row[c]) * as_f32(row[c]);
    ss = block_sum(ss, shm);
    return 1.0f / sqrtf(ss / (float)width + eps);
}

// out [rows, width] = x[r] / rms(x[r]) · w, x a column block (stride, offset).
extern "C" __global__ void rms_norm(const float* x, int stride, int offset, int width, const float* w, float eps,
                                   float* out) {
    __shared__ float shm[32];
    const float* row = x + (u64)blockIdx.x * stride + offset;
    float inv = inv_rms(row, width, eps, shm);
    float* o = out + (u64)blockIdx.x * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) o[c] = w[c] * (row[c] * inv);
}

// rms_norm's rows rounded to bf16 (the same bits as rms_norm then to_bf16):
// the next bf16 GEMM's input in one pass, with no f32 copy written and read.
extern "C" __global__ void rms_norm_bf16(const float* x, int stride, int offset, int width, const float* w,
                                        float eps, u16* out) {
    __shared__ float shm[32];
    const float* row = x + (u64)blockIdx.x * stride + offset;
    float inv = inv_rms(row, width, eps, shm);
    u16* o = out + (u64)blockIdx.x * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) o[c] = f32_to_bf16(w[c] * (row[c] * inv));
}

// In place: head blockIdx.y of row blockIdx.x, columns offset + h·hstride .. + width.
extern "C" __global__ void rms_norm_heads(float* x, int stride, int offset, int hstride, int width, const float* w,
                                         float eps) {
    __shared__ float shm[32];
    float* head = x + (u64)blockIdx.x * stride + offset + (u64)blockIdx.y * hstride;
    float inv = inv_rms(head, width, eps, shm);
    for (int c = threadIdx.x; c < width; c += blockDim.x) head[c] = w[c] * (head[c] * inv);
}

// out[row, ocol + head] = the sum of squares of head blockIdx.y of row
// blockIdx.x (an RMSNorm over a vector split across ranks, MiniMax-M2's
// q/k norm over all heads: the sums are all-reduced, then scale_heads_rms).
extern "C" __global__ void sum_squares_heads(const float* x, int stride, int offset, int hstride, int width,
                                            float* out, int ostride, int ocol) {
    __shared__ float shm[32];
    const float* head = x + (u64)blockIdx.x * stride + offset + (u64)blockIdx.y * hstride;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < width; c += blockDim.x) ss += head[c] * head[c];
    ss = block_sum(ss, shm);
    if (threadIdx.x == 0) out[(u64)blockIdx.x * ostride + ocol + blockIdx.y] = ss;
}

// In place: head blockIdx.y of row blockIdx.x times w / sqrt(sums[row, scol + head] / n + eps).
extern "C" __global__ void scale_heads_rms(float* x, int stride, int offset, int hstride, int width,
                                          const float* sums, int sstride, int scol, int n, const float* w,
                                          float eps) {
    float* head = x + (u64)blockIdx.x * stride + offset + (u64)blockIdx.y * hstride;
    float inv = 1.0f / sqrtf(sums[(u64)blockIdx.x * sstride + scol + blockIdx.y] / (float)n + eps);
    for (int c = threadIdx.x; c < width; c += blockDim.x) head[c] = w[c] * (head[c] * inv);
}

// rms_norm_heads of bf16 rows (a bf16 qkv projection's), in f32, each value
// rounded once on the way back.
extern "C" __global__ void rms_norm_heads_bf16(u16* x, int stride, int offset, int hstride, int width, const float* w,
                                              float eps) {
    __shared__ float shm[32];
    u16* head = x + (u64)blockIdx.x * stride + offset + (u64)blockIdx.y * hstride;
    float inv = inv_rms(head, width, eps, shm);
    for (int c = threadIdx.x; c < width; c += blockDim.x) head[c] = f32_to_bf16(w[c] * (bf16_to_f32(head[c]) * inv));
}
