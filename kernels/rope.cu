// rope.cu: what depends on a token's position: rotary embeddings in place,
// both layouts, and Llama 4's attention temperature. RoPE's pairs are
// (i, i + half) (HF's rotate_half) or, with `interleave`, (2i, 2i + 1) written back as
// [rotated evens | rotated odds] (DeepSeek). The interleaved write overlaps
// other pairs' reads, so a block first copies its heads to shared memory.
#include "common.cuh"

__device__ __forceinline__ float as_f32(float v) { return v; }
__device__ __forceinline__ float as_f32(u16 v) { return bf16_to_f32(v); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(u16* p, float v) { *p = f32_to_bf16(v); }

// Block (row blockIdx.x, heads blockIdx.y·chunk ..): rotates `count` heads of
// 2·half columns at offset + h·hstride of row r, at position pos[r], in f32
// (T = u16: bf16 rows, each value rounded once on the way back).
// cos/sin: [positions, half], already times the RoPE scale.
// Dynamic shared memory: chunk · 2·half floats.
template <typename T>
__device__ __forceinline__ void rope_rows(T* x, int stride, int offset, int count, int hstride, int half,
                                          int interleave, const float* cos_t, const float* sin_t, const u32* pos,
                                          int chunk) {
    extern __shared__ float tile[];
    int h0 = blockIdx.y * chunk;
    int heads = min(chunk, count - h0);
    if (heads <= 0) return;
    T* row = x + (u64)blockIdx.x * stride + offset;
    int d = 2 * half;
    for (int i = threadIdx.x; i < heads * d; i += blockDim.x)
        tile[i] = as_f32(row[(u64)(h0 + i / d) * hstride + i % d]);
    __syncthreads();
    const float* cs = cos_t + (u64)pos[blockIdx.x] * half;
    const float* sn = sin_t + (u64)pos[blockIdx.x] * half;
    for (int i = threadIdx.x; i < heads * half; i += blockDim.x) {
        int h = i / half, j = i % half;
        const float* src = tile + h * d;
        float a = interleave ? src[2 * j] : src[j];
        float b = interleave ? src[2 * j + 1] : src[j + half];
        T* dst = row + (u64)(h0 + h) * hstride;
        store(dst + j, a * cs[j] - b * sn[j]);
        store(dst + half + j, b * cs[j] + a * sn[j]);
    }
}

// RoPE of f32 rows.
extern "C" __global__ void rope(float* x, int stride, int offset, int count, int hstride, int half, int interleave,
                               const float* cos_t, const float* sin_t, const u32* pos, int chunk) {
    rope_rows(x, stride, offset, count, hstride, half, interleave, cos_t, sin_t, pos, chunk);
}

// RoPE of bf16 rows (a bf16 qkv projection's).
extern "C" __global__ void rope_bf16(u16* x, int stride, int offset, int count, int hstride, int half, int interleave,
                                    const float* cos_t, const float* sin_t, const u32* pos, int chunk) {
    rope_rows(x, stride, offset, count, hstride, half, interleave, cos_t, sin_t, pos, chunk);
}

// Llama 4's attention temperature on its NoPE layers, in place: `count`
// heads of `width` columns at offset + h·hstride of row t (f32 rows of
// `stride` values) times log1p(floor((pos[t] + 1) / floor_scale)) ·
// attn_scale + 1, in f32 as transformers computes it.
extern "C" __global__ void attn_temperature(float* x, int rows, int stride, int offset, int count, int hstride,
                                            int width, const u32* pos, float floor_scale, float attn_scale) {
    GRID_STRIDE(i, (u32)rows * count * width) {
        u32 per = (u32)count * width;
        u32 t = i / per, r = i - t * per, h = r / width, c = r - h * width;
        float f = log1pf(floorf(((float)pos[t] + 1.0f) / floor_scale)) * attn_scale + 1.0f;
        x[(u64)t * stride + offset + (u64)h * hstride + c] *= f;
    }
}
