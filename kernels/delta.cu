// delta.cu: Gated DeltaNet (Qwen3-Next, Qwen3.5): the depthwise causal conv1d
// with SiLU, the update of each sample's conv state, and the gated delta rule
// in chunks of 64 positions on a grid fixed to the sample's positions (chunk c
// is positions 64c .. 64c + 63), as the CPU backend computes it
// (src/backend/cpu/delta.rs, docs/ARCHITECTURE.md): every value of row i of a
// chunk comes from rows 0..i alone, one fmaf chain per element in a fixed
// order, so a chunk a step has only partly reached gives its rows the bits
// the full chunk gives them. The recurrence is f32.
#include "common.cuh"

#define DELTA_CHUNK 64

// One segment of the conv: 16 bytes, little-endian: the sample's conv state
// ([K - 1, C] f32, the inputs of the K - 1 positions before the segment; 0:
// none, read as zeros), the segment's first row and its row count.
struct ConvSeg {
    u64 state;
    int row0, n;
};

// out [T, C] = silu(Σ_j w[c·K + j] · x_{p - K + 1 + j}[c]), token t at position
// p of its segment (seg_of[t]), x a column block (stride, offset); the inputs
// before the segment's first row come from its conv state.
extern "C" __global__ void causal_conv1d(const float* x, int xs, int xo, int tokens, int channels, int k,
                                        const float* w, const u8* segs, const u32* seg_of, float* out) {
    GRID_STRIDE(i, (u32)tokens * channels) {
        u32 t = i / channels, c = i - t * channels;
        const ConvSeg s = ((const ConvSeg*)segs)[seg_of[t]];
        int at = (int)t - s.row0;  // the token's row within its segment
        const float* state = (const float*)s.state;
        float acc = 0.0f;
        for (int j = 0; j < k; ++j) {
            int src = at + j - (k - 1);
            float v;
            if (src >= 0) v = x[(u64)(s.row0 + src) * xs + xo + c];
            else v = state ? state[(u64)(k - 1 + src) * channels + c] : 0.0f;
            acc = fmaf(w[(u64)c * k + j], v, acc);
        }
        out[i] = acc / (1.0f + expf(-acc));
    }
}

// After causal_conv1d: each segment whose state is kept (state != 0) moves its
// conv state on to the K - 1 inputs before its sample's next position. One
// thread per (segment, channel) holds the channel's window, so the update in
// place reads nothing another thread writes.
extern "C" __global__ void conv_state_update(const float* x, int xs, int xo, int nsegs, int channels, int k,
                                            const u8* segs) {
    GRID_STRIDE(i, (u32)nsegs * channels) {
        u32 si = i / channels, c = i - si * channels;
        const ConvSeg s = ((const ConvSeg*)segs)[si];
        float* state = (float*)s.state;
        if (!state) continue;
        float old[8];
        for (int j = 0; j < k - 1; ++j) old[j] = state[(u64)j * channels + c];
        for (int j = 0; j < k - 1; ++j) {
            int src = j + s.n;  // index in (old window ++ the segment's rows)
            float v = src < k - 1 ? old[src] : x[(u64)(s.row0 + src - (k - 1)) * xs + xo + c];
            state[(u64)j * channels + c] = v;
        }
    }
}

// One segment of the delta rule: 40 bytes, little-endian. `state`: the
// sample's recurrent state [v_heads, dk, dv] (0: none, zeros, nothing kept);
// `pend_in`/`pend_out`: the prepared rows of its unfinished chunk, read (the
// first `done`) and written (the last (done + n) mod 64), [64, pw] each.
struct DeltaSeg {
    u64 state, pend_in, pend_out;
    int row0, n, done, keep;
};

// ln(1 + e^x), PyTorch's softplus (x itself above 20).
__device__ __forceinline__ float softplus20(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

// Floats of one block's work area (see gated_delta_rule).
__device__ __forceinline__ u64 delta_work_floats(int dk, int dv) {
    return (u64)dk * dv + (u64)DELTA_CHUNK * (5 * dk + 3 * dv) + 2 * DELTA_CHUNK * DELTA_CHUNK + 3 * DELTA_CHUNK;
}

// The gated delta rule and gated norm of value head blockIdx.y over segments
// blockIdx.x, + gridDim.x, ...: for each, its chunks in order from the state
// its sample's earlier steps left (or zeros), each row's output
// rms_norm(o)·norm_w·silu(z) written to out [T, nv·dv]. qkv [T, C] is the
// conv's output ([q | k | v]), z and ba column blocks ([b | a]). `work`
// holds delta_work_floats(dk, dv) floats per block (global: a chunk's rows at
// d = 128 exceed shared memory). Prepared rows: [q̂ (nk·dk) | k̂ | v (nv·dv) | g (nv) | β (nv)].
extern "C" __global__ void gated_delta_rule(const float* qkv, const float* z, int zs, int zo, const float* ba, int bas,
                                           int bao, const float* a_log, const float* dt_bias, const float* norm_w,
                                           float eps, int nk, int nv, int dk, int dv, const u8* segs, int nsegs,
                                           float* work, float* out) {
    const int CH = DELTA_CHUNK;
    const int h = blockIdx.y, hk = h / (nv / nk), tid = threadIdx.x, nt = blockDim.x;
    const int lane = tid & 31, warp = tid >> 5, warps = nt >> 5;
    const int c_all = 2 * nk * dk + nv * dv, pw = c_all + 2 * nv;
    const float scale = 1.0f / sqrtf((float)dk);
    float* S = work + (u64)(blockIdx.y * gridDim.x + blockIdx.x) * delta_work_floats(dk, dv);
    float* q = S + (u64)dk * dv;      // [CH, dk] q̂
    float* kk = q + CH * dk;          // [CH, dk] k̂
    float* kb = kk + CH * dk;         // [CH, dk] β k̂, then the decayed k̂ of the state update
    float* wk = kb + CH * dk;         // [CH, dk] W
    float* qe = wk + CH * dk;         // [CH, dk] q̂ e^G
    float* v = qe + CH * dk;          // [CH, dv] v
    float* u = v + CH * dv;           // [CH, dv] U, then v_new
    float* o = u + CH * dv;           // [CH, dv] the rows' outputs before the norm
    float* L = o + CH * dv;           // [CH, CH]
    float* P = L + CH * CH;           // [CH, CH]
    float* g = P + CH * CH;           // [CH]
    float* cum = g + CH;              // [CH]
    float* beta = cum + CH;           // [CH]
    for (int si = blockIdx.x; si < nsegs; si += gridDim.x) {
        const DeltaSeg sg = ((const DeltaSeg*)segs)[si];
        float* state = sg.state ? (float*)sg.state + (u64)h * dk * dv : 0;
        const float* pin = (const float*)sg.pend_in;
        for (int e = tid; e < dk * dv; e += nt) S[e] = state ? state[e] : 0.0f;
        const int total = sg.done + sg.n;
        int rows = 0;
        for (int c0 = 0; c0 < total; c0 += CH) {
            rows = min(CH, total - c0);
            const int first = c0 == 0 ? sg.done : 0;
            __syncthreads();
            // The chunk's rows: cached prepared ones, then the step's, prepared here (a warp per row).
            for (int i = warp; i < rows; i += warps) {
                int idx = c0 + i;
                float gi, bi;
                if (idx < sg.done) {
                    const float* src = pin + (u64)idx * pw;
                    for (int a = lane; a < dk; a += 32) {
                        q[i * dk + a] = src[hk * dk + a];
                        kk[i * dk + a] = src[(nk + hk) * dk + a];
                    }
                    for (int c = lane; c < dv; c += 32) v[i * dv + c] = src[2 * nk * dk + h * dv + c];
                    gi = src[c_all + h];
                    bi = src[c_all + nv + h];
                } else {
                    u64 r = (u64)(sg.row0 + idx - sg.done);
                    const float* src = qkv + r * c_all;
                    float sq = 0.0f, sk = 0.0f;
                    for (int a = lane; a < dk; a += 32) {
                        float x1 = src[hk * dk + a], x2 = src[(nk + hk) * dk + a];
                        sq += x1 * x1;
                        sk += x2 * x2;
                    }
                    sq = warp_sum(sq);
                    sk = warp_sum(sk);
                    float iq = 1.0f / sqrtf(sq + 1e-6f), ik = 1.0f / sqrtf(sk + 1e-6f);
                    for (int a = lane; a < dk; a += 32) {
                        q[i * dk + a] = src[hk * dk + a] * iq * scale;
                        kk[i * dk + a] = src[(nk + hk) * dk + a] * ik;
                    }
                    for (int c = lane; c < dv; c += 32) v[i * dv + c] = src[2 * nk * dk + h * dv + c];
                    const float* bar = ba + r * bas + bao;
                    gi = -expf(a_log[h]) * softplus20(bar[nv + h] + dt_bias[h]);
                    bi = 1.0f / (1.0f + expf(-bar[h]));
                }
                for (int a = lane; a < dk; a += 32) kb[i * dk + a] = kk[i * dk + a] * bi;
                for (int c = lane; c < dv; c += 32) u[i * dv + c] = v[i * dv + c] * bi;
                if (lane == 0) {
                    g[i] = gi;
                    beta[i] = bi;
                }
            }
            __syncthreads();
            if (tid == 0) {
                float acc = 0.0f;
                for (int i = 0; i < rows; ++i) cum[i] = acc += g[i];
            }
            __syncthreads();
            // L[i, j] = (β k̂_i · k̂_j) e^(G_i - G_j), j < i; P[i, j] = (q̂_i · k̂_j) e^(G_i - G_j), j ≤ i.
            for (int e = tid; e < rows * rows; e += nt) {
                int i = e / rows, j = e - i * rows;
                if (j > i) continue;
                float l = 0.0f, p = 0.0f;
                for (int a = 0; a < dk; ++a) {
                    l = fmaf(kb[i * dk + a], kk[j * dk + a], l);
                    p = fmaf(q[i * dk + a], kk[j * dk + a], p);
                }
                float decay = expf(cum[i] - cum[j]);
                if (j < i) L[i * CH + j] = l * decay;
                P[i * CH + j] = p * decay;
            }
            __syncthreads();
            // Forward substitution, a row at a time: U_i = β v_i - Σ_{j<i} L[i, j] U_j,
            // W_i = β k̂_i e^(G_i) - Σ_{j<i} L[i, j] W_j.
            for (int i = 0; i < rows; ++i) {
                float e = expf(cum[i]);
                for (int c = tid; c < dv + dk; c += nt) {
                    if (c < dv) {
                        float acc = u[i * dv + c];
                        for (int j = 0; j < i; ++j) acc = fmaf(-L[i * CH + j], u[j * dv + c], acc);
                        u[i * dv + c] = acc;
                    } else {
                        int a = c - dv;
                        float acc = kb[i * dk + a] * e;
                        for (int j = 0; j < i; ++j) acc = fmaf(-L[i * CH + j], wk[j * dk + a], acc);
                        wk[i * dk + a] = acc;
                    }
                }
                __syncthreads();
            }
            // v_new = U - W·S; q̂ e^G of the rows to emit.
            for (int e = tid; e < rows * dv; e += nt) {
                int i = e / dv, c = e - i * dv;
                float acc = u[e];
                for (int a = 0; a < dk; ++a) acc = fmaf(-wk[i * dk + a], S[a * dv + c], acc);
                u[e] = acc;
            }
            for (int e = tid; e < rows * dk; e += nt) {
                int i = e / dk;
                qe[e] = q[e] * expf(cum[i]);
            }
            __syncthreads();
            // o_i = (q̂_i e^(G_i))·S + Σ_{j≤i} P[i, j] v_new_j.
            for (int e = first * dv + tid; e < rows * dv; e += nt) {
                int i = e / dv, c = e - i * dv;
                float acc = 0.0f;
                for (int a = 0; a < dk; ++a) acc = fmaf(qe[i * dk + a], S[a * dv + c], acc);
                for (int j = 0; j <= i; ++j) acc = fmaf(P[i * CH + j], u[j * dv + c], acc);
                o[e] = acc;
            }
            __syncthreads();
            // The gated norm of each emitted row (a warp per row).
            for (int i = first + warp; i < rows; i += warps) {
                float ss = 0.0f;
                for (int c = lane; c < dv; c += 32) ss += o[i * dv + c] * o[i * dv + c];
                ss = warp_sum(ss);
                float inv = 1.0f / sqrtf(ss / (float)dv + eps);
                u64 r = (u64)(sg.row0 + c0 + i - sg.done);
                const float* zr = z + r * zs + zo + (u64)h * dv;
                float* orow = out + r * ((u64)nv * dv) + (u64)h * dv;
                for (int c = lane; c < dv; c += 32) orow[c] = o[i * dv + c] * inv * norm_w[c] * silu(zr[c]);
            }
            if (rows == CH) {
                // S ← e^(G_last) S + Σ_j (k̂_j e^(G_last - G_j)) ⊗ v_new_j.
                float last = cum[CH - 1];
                for (int e = tid; e < CH * dk; e += nt) {
                    int j = e / dk;
                    kb[e] = kk[e] * expf(last - cum[j]);
                }
                __syncthreads();
                float decay = expf(last);
                for (int e = tid; e < dk * dv; e += nt) {
                    int a = e / dv, c = e - a * dv;
                    float acc = S[e] * decay;
                    for (int j = 0; j < CH; ++j) acc = fmaf(kb[j * dk + a], u[j * dv + c], acc);
                    S[e] = acc;
                }
            }
        }
        __syncthreads();
        if (sg.keep) {
            // The state at the unfinished chunk's start, and that chunk's prepared rows (this
            // head's v, g, β; its key head's q̂, k̂ from the first value head that shares it).
            for (int e = tid; e < dk * dv; e += nt) state[e] = S[e];
            int kept = total % CH;
            float* pout = (float*)sg.pend_out;
            for (int i = warp; i < kept; i += warps) {
                float* dst = pout + (u64)i * pw;
                if (h % (nv / nk) == 0) {
                    for (int a = lane; a < dk; a += 32) {
                        dst[hk * dk + a] = q[i * dk + a];
                        dst[(nk + hk) * dk + a] = kk[i * dk + a];
                    }
                }
                for (int c = lane; c < dv; c += 32) dst[2 * nk * dk + h * dv + c] = v[i * dv + c];
                if (lane == 0) {
                    dst[c_all + h] = g[i];
                    dst[c_all + nv + h] = beta[i];
                }
            }
        }
    }
}

// x [rows, width] *= σ(gate): gate a column block as wide as x, or of one
// column (gw = 1) scaling each row.
extern "C" __global__ void sigmoid_mul(float* x, int rows, int width, const float* gate, int gs, int go, int gw) {
    GRID_STRIDE(i, (u32)rows * width) {
        u32 t = i / width, c = i - t * width;
        float gv = gate[(u64)t * gs + go + (gw == 1 ? 0 : c)];
        x[i] *= 1.0f / (1.0f + expf(-gv));
    }
}
