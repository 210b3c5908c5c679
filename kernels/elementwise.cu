// elementwise.cu: the row-wise ops that need no reduction (embedding
// gather, SwiGLU, residual adds, head copies, bias, dtype conversion, MoE
// gather and combine). Each thread handles elements i = global id, id +
// stride, ... (32-bit indices: GRID_STRIDE in common.cuh), so any grid
// covers any size.
#include "common.cuh"

// out[t][c] = table[ids[t]][c]: out [T, hidden] f32; table [vocab, hidden] as stored.
extern "C" __global__ void embed_f32(const float* table, const u32* ids, int tokens, int hidden, float* out) {
    GRID_STRIDE(i, (u32)tokens * hidden) {
        u32 t = i / hidden, c = i - t * hidden;
        out[i] = table[(u64)ids[t] * hidden + c];
    }
}
extern "C" __global__ void embed_bf16(const u16* table, const u32* ids, int tokens, int hidden, float* out) {
    GRID_STRIDE(i, (u32)tokens * hidden) {
        u32 t = i / hidden, c = i - t * hidden;
        out[i] = bf16_to_f32(table[(u64)ids[t] * hidden + c]);
    }
}
extern "C" __global__ void embed_f16(const u16* table, const u32* ids, int tokens, int hidden, float* out) {
    GRID_STRIDE(i, (u32)tokens * hidden) {
        u32 t = i / hidden, c = i - t * hidden;
        out[i] = f16_to_f32(table[(u64)ids[t] * hidden + c]);
    }
}

// out [T, inter] = silu(gate) · up of gate_up [T, 2·inter] = [gate | up].
extern "C" __global__ void swiglu(const float* gate_up, int rows, int inter, float* out) {
    GRID_STRIDE(i, (u32)rows * inter) {
        u32 t = i / inter, c = i - t * inter;
        const float* gu = gate_up + (u64)t * 2 * inter;
        out[i] = silu(gu[c]) * gu[inter + c];
    }
}

// out [T, inter] = gelu_tanh(gate) · up of gate_up [T, 2·inter] = [gate | up]:
// g/2 · (1 + tanh(u)) with u = √(2/π)·(g + 0.044715·g³), as g · σ(2u).
extern "C" __global__ void gelu_tanh_glu(const float* gate_up, int rows, int inter, float* out) {
    GRID_STRIDE(i, (u32)rows * inter) {
        u32 t = i / inter, c = i - t * inter;
        const float* gu = gate_up + (u64)t * 2 * inter;
        float g = gu[c];
        float u = 0.7978846f * (g + 0.044715f * g * g * g);
        out[i] = g / (1.0f + expf(-2.0f * u)) * gu[inter + c];
    }
}

// out [T, inter] = (u + 1) · g · σ(alpha · g) with g = min(gate, limit), u = clamp(up, ±limit)
// (gpt-oss's clamped GLU), of gate_up [T, 2·inter] = [gate | up].
extern "C" __global__ void clamped_glu(const float* gate_up, int rows, int inter, float alpha, float limit,
                                       float* out) {
    GRID_STRIDE(i, (u32)rows * inter) {
        u32 t = i / inter, c = i - t * inter;
        const float* gu = gate_up + (u64)t * 2 * inter;
        float g = fminf(gu[c], limit), u = fminf(fmaxf(gu[inter + c], -limit), limit);
        out[i] = (u + 1.0f) * (g / (1.0f + expf(-alpha * g)));
    }
}

// x[i] *= s over n values.
extern "C" __global__ void scale(float* x, float s, int n) {
    GRID_STRIDE(i, n) { x[i] *= s; }
}

// x[i] += y[i] over n values.
extern "C" __global__ void add(float* x, const float* y, int n) {
    GRID_STRIDE(i, n) { x[i] += y[i]; }
}

// x [rows, width] += y [rows, width] + bias [width] (bias may be null): the
// tail of a row-parallel linear layer, after its all-reduce.
extern "C" __global__ void add_bias_residual(float* x, const float* y, const float* bias, int rows, int width) {
    GRID_STRIDE(i, (u32)rows * width) {
        float b = bias ? bias[i % width] : 0.0f;
        x[i] += y[i] + b;
    }
}

// y [rows, width] += bias [width].
extern "C" __global__ void add_bias(float* y, const float* bias, int rows, int width) {
    GRID_STRIDE(i, (u32)rows * width) { y[i] += bias[i % width]; }
}

// dst[r][to + h·to_stride + c] = src[r][from + h·from_stride + c] for heads h < count, c < width.
extern "C" __global__ void copy_heads(const float* src, int src_width, int from, int from_stride, float* dst,
                                      int dst_width, int to, int to_stride, int rows, int count, int width) {
    GRID_STRIDE(i, (u32)rows * count * width) {
        u32 q = i / width, c = i - q * width, r = q / count, h = q - r * count;
        dst[(u64)r * dst_width + to + h * to_stride + c] = src[(u64)r * src_width + from + h * from_stride + c];
    }
}

// out [rows, width] bf16 bits = columns offset..offset+width of x (row stride
// `stride`), rounded to nearest even: the A operand of a bf16 GEMM.
extern "C" __global__ void to_bf16(const float* x, int rows, int stride, int offset, int width, u16* out) {
    GRID_STRIDE(i, (u32)rows * width) {
        u32 r = i / width, c = i - r * width;
        out[i] = f32_to_bf16(x[(u64)r * stride + offset + c]);
    }
}

// out [rows, width] = columns offset..offset+width of x (row stride `stride`): a block made contiguous.
extern "C" __global__ void pack_cols(const float* x, int rows, int stride, int offset, int width, float* out) {
    GRID_STRIDE(i, (u32)rows * width) {
        u32 r = i / width, c = i - r * width;
        out[i] = x[(u64)r * stride + offset + c];
    }
}

// Widens bf16 bits to f32 (weights of an f32-compute layer held in bf16).
extern "C" __global__ void bf16_to_f32_n(const u16* x, int n, float* out) {
    GRID_STRIDE(i, n) { out[i] = bf16_to_f32(x[i]); }
}

// xe[r] = x[src[r]], [n, hidden]: the rows an expert (or all experts, grouped) receives in
// MoE, and the rows a step samples for the LM head.
extern "C" __global__ void gather_rows(const float* x, const u32* src, int n, int hidden, float* xe) {
    GRID_STRIDE(i, (u32)n * hidden) {
        u32 r = i / hidden, c = i - r * hidden;
        xe[i] = x[(u64)src[r] * hidden + c];
    }
}

// MoE with input gating (Llama 4): grouped row slot[e] = weight[e] · x[e / top_k]
// for each entry e (token e / top_k's (e % top_k)-th expert), instead of gather_rows.
extern "C" __global__ void scatter_rows_scaled(const float* x, const u32* slot, const float* weight, int n, int top_k,
                                               int hidden, float* xe) {
    GRID_STRIDE(i, (u32)n * hidden) {
        u32 e = i / hidden, c = i - e * hidden;
        xe[(u64)slot[e] * hidden + c] = weight[e] * x[(u64)(e / top_k) * hidden + c];
    }
}

// MoE: out[t] = Σ_k weight[t][k] · ye[slot[t][k]] (+ shared[t]), k in order:
// the experts' rows of each token summed in a fixed order, no atomics.
// A null weight is 1 for every row (input gating weighed the inputs).
extern "C" __global__ void moe_combine(const float* ye, const u32* slot, const float* weight, int tokens, int top_k,
                                       int hidden, const float* shared, float* out) {
    GRID_STRIDE(i, (u32)tokens * hidden) {
        u32 t = i / hidden, c = i - t * hidden;
        float acc = 0.0f;
        for (int k = 0; k < top_k; k++) {
            float w = weight ? weight[t * top_k + k] : 1.0f;
            acc += w * ye[(u64)slot[t * top_k + k] * hidden + c];
        }
        if (shared) acc += shared[i];
        out[i] = acc;
    }
}

// The bf16 twins of the MoE row ops, for experts whose GEMMs read and write
// bf16 (cublasGemmGroupedBatchedEx takes bf16 inputs only with bf16 output):
// the gathered rows go to the gate/up GEMM as bf16, SwiGLU reads its bf16
// output and writes the down GEMM's bf16 input, and the combine reads the
// down GEMM's bf16 rows. No separate f32→bf16 pass.

// xe[r] = bf16(x[src[r]]): [n, hidden].
extern "C" __global__ void gather_rows_bf16(const float* x, const u32* src, int n, int hidden, u16* xe) {
    GRID_STRIDE(i, (u32)n * hidden) {
        u32 r = i / hidden, c = i - r * hidden;
        xe[i] = f32_to_bf16(x[(u64)src[r] * hidden + c]);
    }
}

// scatter_rows_scaled into bf16 rows: the product in f32, rounded once.
extern "C" __global__ void scatter_rows_scaled_bf16(const float* x, const u32* slot, const float* weight, int n,
                                                    int top_k, int hidden, u16* xe) {
    GRID_STRIDE(i, (u32)n * hidden) {
        u32 e = i / hidden, c = i - e * hidden;
        xe[(u64)slot[e] * hidden + c] = f32_to_bf16(weight[e] * x[(u64)(e / top_k) * hidden + c]);
    }
}

// out [T, inter] = bf16(silu(gate) · up), gate_up [T, 2·inter] bf16, the product in f32.
extern "C" __global__ void swiglu_bf16(const u16* gate_up, int rows, int inter, u16* out) {
    GRID_STRIDE(i, (u32)rows * inter) {
        u32 t = i / inter, c = i - t * inter;
        const u16* gu = gate_up + (u64)t * 2 * inter;
        out[i] = f32_to_bf16(silu(bf16_to_f32(gu[c])) * bf16_to_f32(gu[inter + c]));
    }
}

// out [T, inter] = bf16 of gpt-oss's clamped GLU (see clamped_glu), gate_up [T, 2·inter] bf16, in f32.
extern "C" __global__ void clamped_glu_bf16(const u16* gate_up, int rows, int inter, float alpha, float limit,
                                            u16* out) {
    GRID_STRIDE(i, (u32)rows * inter) {
        u32 t = i / inter, c = i - t * inter;
        const u16* gu = gate_up + (u64)t * 2 * inter;
        float g = fminf(bf16_to_f32(gu[c]), limit), u = fminf(fmaxf(bf16_to_f32(gu[inter + c]), -limit), limit);
        out[i] = f32_to_bf16((u + 1.0f) * (g / (1.0f + expf(-alpha * g))));
    }
}

// y [rows, width] bf16 = bf16(y + bias [width]).
extern "C" __global__ void add_bias_bf16(u16* y, const float* bias, int rows, int width) {
    GRID_STRIDE(i, (u32)rows * width) { y[i] = f32_to_bf16(bf16_to_f32(y[i]) + bias[i % width]); }
}

// moe_combine over bf16 rows: out[t] = Σ_k weight[t][k] · ye[slot[t][k]] (+ shared[t]), in f32, k in order
// (a null weight: 1).
extern "C" __global__ void moe_combine_bf16(const u16* ye, const u32* slot, const float* weight, int tokens,
                                            int top_k, int hidden, const u16* shared, float* out) {
    GRID_STRIDE(i, (u32)tokens * hidden) {
        u32 t = i / hidden, c = i - t * hidden;
        float acc = 0.0f;
        for (int k = 0; k < top_k; k++) {
            float w = weight ? weight[t * top_k + k] : 1.0f;
            acc += w * bf16_to_f32(ye[(u64)slot[t * top_k + k] * hidden + c]);
        }
        if (shared) acc += bf16_to_f32(shared[i]);
        out[i] = acc;
    }
}

// A value as bf16 bits: f32 rounded, bf16 as it is.
__device__ __forceinline__ u16 as_bf16(float v) { return f32_to_bf16(v); }
__device__ __forceinline__ u16 as_bf16(u16 v) { return v; }

// attention's bf16 queries, keys or values: out [rows, heads, wpad] bf16 =
// the heads of width `width` at columns offset + h·width of x (row stride
// `stride`), each padded with zeros to `wpad` (a multiple of 16; see `Seg`
// in common.cuh). One block per row, indexed in 32 bits.
template <typename T>
__device__ __forceinline__ void pack_heads(const T* x, int stride, int offset, int heads, int width, int wpad,
                                           u16* out) {
    const T* row = x + (u64)blockIdx.x * stride + offset;
    u16* dst = out + (u64)blockIdx.x * heads * wpad;
    for (int i = threadIdx.x; i < heads * wpad; i += blockDim.x) {
        int h = i / wpad, c = i - h * wpad;
        dst[i] = c < width ? as_bf16(row[h * width + c]) : (u16)0;
    }
}

// pack_heads of f32 rows (rounded to bf16).
extern "C" __global__ void pack_heads_bf16(const float* x, int stride, int offset, int heads, int width, int wpad,
                                           u16* out) {
    pack_heads(x, stride, offset, heads, width, wpad, out);
}

// pack_heads of bf16 rows (a bf16 qkv projection's; the bits as they are).
extern "C" __global__ void pack_heads_bf16_from_bf16(const u16* x, int stride, int offset, int heads, int width,
                                                     int wpad, u16* out) {
    pack_heads(x, stride, offset, heads, width, wpad, out);
}

// out [T, inter] bf16 = bf16(silu(gate) · up) of f32 gate_up [T, 2·inter]:
// SwiGLU and the down GEMM's input rounding in one pass (no f32 copy).
extern "C" __global__ void swiglu_to_bf16(const float* gate_up, int rows, int inter, u16* out) {
    GRID_STRIDE(i, (u32)rows * inter) {
        u32 t = i / inter, c = i - t * inter;
        const float* gu = gate_up + (u64)t * 2 * inter;
        out[i] = f32_to_bf16(silu(gu[c]) * gu[inter + c]);
    }
}
