// quant.cu: expands quantised weights to the GEMM's input dtype just before
// the GEMM, one layer's (or one expert's) tile at a time, so the weights stay
// quantised in device memory. A weight is `code · scale`, one scale per row
// and input segment (FP8 blocks, INT4 groups); colseg[c] names the segment of
// column c. The products are exact in f32, as on the host.
#include "common.cuh"

// FP8 E4M3 codes [rows, cols], one byte each.
extern "C" __global__ void dequant_fp8_bf16(const u8* codes, const float* scales, const u32* colseg, int rows,
                                           int cols, int nseg, u16* out) {
    GRID_STRIDE(i, (u32)rows * cols) {
        u32 r = i / cols, c = i - r * cols;
        out[i] = f32_to_bf16(fp8_e4m3_to_f32(codes[i]) * scales[r * nseg + colseg[c]]);
    }
}
extern "C" __global__ void dequant_fp8_f32(const u8* codes, const float* scales, const u32* colseg, int rows,
                                          int cols, int nseg, float* out) {
    GRID_STRIDE(i, (u32)rows * cols) {
        u32 r = i / cols, c = i - r * cols;
        out[i] = fp8_e4m3_to_f32(codes[i]) * scales[r * nseg + colseg[c]];
    }
}

// INT4 codes q + 8 (0..=15), two per byte: [rows, (cols + 1) / 2], the even
// column in the low nibble.
__device__ __forceinline__ float int4_at(const u8* codes, int cols, u64 r, u64 c) {
    u8 b = codes[r * ((cols + 1) / 2) + c / 2];
    return (float)((int)((c & 1) ? (b >> 4) : (b & 15)) - 8);
}
extern "C" __global__ void dequant_int4_bf16(const u8* codes, const float* scales, const u32* colseg, int rows,
                                            int cols, int nseg, u16* out) {
    GRID_STRIDE(i, (u32)rows * cols) {
        u32 r = i / cols, c = i - r * cols;
        out[i] = f32_to_bf16(int4_at(codes, cols, r, c) * scales[r * nseg + colseg[c]]);
    }
}
extern "C" __global__ void dequant_int4_f32(const u8* codes, const float* scales, const u32* colseg, int rows,
                                           int cols, int nseg, float* out) {
    GRID_STRIDE(i, (u32)rows * cols) {
        u32 r = i / cols, c = i - r * cols;
        out[i] = int4_at(codes, cols, r, c) * scales[r * nseg + colseg[c]];
    }
}

// MXFP4 (gpt-oss's experts): E2M1 codes two per byte as INT4's ([rows,
// (cols + 1) / 2], the even column in the low nibble), each an index into
// the FP4 values; the scales are the E8M0 block exponents already as f32.
__device__ __forceinline__ float mxfp4_at(const u8* codes, int cols, u64 r, u64 c) {
    const float fp4[16] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
                           -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
    u8 b = codes[r * ((cols + 1) / 2) + c / 2];
    return fp4[(c & 1) ? (b >> 4) : (b & 15)];
}
extern "C" __global__ void dequant_mxfp4_bf16(const u8* codes, const float* scales, const u32* colseg, int rows,
                                             int cols, int nseg, u16* out) {
    GRID_STRIDE(i, (u32)rows * cols) {
        u32 r = i / cols, c = i - r * cols;
        out[i] = f32_to_bf16(mxfp4_at(codes, cols, r, c) * scales[r * nseg + colseg[c]]);
    }
}
extern "C" __global__ void dequant_mxfp4_f32(const u8* codes, const float* scales, const u32* colseg, int rows,
                                            int cols, int nseg, float* out) {
    GRID_STRIDE(i, (u32)rows * cols) {
        u32 r = i / cols, c = i - r * cols;
        out[i] = mxfp4_at(codes, cols, r, c) * scales[r * nseg + colseg[c]];
    }
}
