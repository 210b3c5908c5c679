// attention.cu: causal attention over the packed variable-length segments of
// a step, flash-style (one pass over the keys with an online softmax; the
// score matrix is never stored). A segment's keys and values are rows
// 0..kv_len (positions) at its own pointers: its rows of this step's k/v, or
// its sample's KV cache when it continues one (chunked prefill). Query row i
// of a segment is at position pos0 + i and sees keys j <= pos0 + i (and
// j > pos0 + i - window with a sliding window). GQA: query head h reads kv
// head h / (heads / kv_heads).
//
// - attention_f32: the exact path (f32 inputs and products): one warp per
//   (token, head); lanes score 32 keys at a time, then own output columns.
// - attention_bf16_vN: tensor cores via `mma.sync` m16n8k16 (bf16 inputs,
//   f32 accumulation) through inline PTX (no mma.h): a block of 4 warps takes
//   64 queries of one head, 16 per warp, and walks the keys 32 at a time.
//   N is the value width the block is compiled for (>= v_dim, a multiple of 16).
#include "common.cuh"

// One segment of the step. Pointers are device addresses of key/value row 0
// (column offset applied); strides are in floats.
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

#define NEG_INF (-__int_as_float(0x7f800000))

// Grid (tokens, ceil(heads / 4)), 128 threads. seg_of[t]: token t's segment.
// q: row stride q_stride, head h at columns h·hd; out [T, heads·vd].
extern "C" __global__ void attention_f32(const float* q, int q_stride, const Seg* segs, const u32* seg_of, int heads,
                                        int kv_heads, int hd, int vd, int window, float scale, float* out) {
    __shared__ float qs[4][256];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int t = blockIdx.x, h = blockIdx.y * 4 + warp;
    if (h >= heads) return;  // whole warps leave; no block barrier follows
    Seg sg = segs[seg_of[t]];
    int p = sg.pos0 + (t - sg.q_row0);
    int lo = window > 0 ? max(0, p - window + 1) : 0;
    int g = h / (heads / kv_heads);
    const float* qr = q + (u64)t * q_stride + (u64)h * hd;
    for (int c = lane; c < hd; c += 32) qs[warp][c] = qr[c];
    __syncwarp();
    const float* kb = (const float*)sg.k + (u64)g * hd;
    const float* vb = (const float*)sg.v + (u64)g * vd;
    float m = NEG_INF, l = 0.0f, acc[8];
    for (int i = 0; i < 8; i++) acc[i] = 0.0f;
    for (int j0 = lo; j0 <= p; j0 += 32) {
        int j = j0 + lane;
        float s = NEG_INF;
        if (j <= p) {
            const float* kr = kb + (u64)j * sg.k_stride;
            float d = 0.0f;
            for (int c = 0; c < hd; c++) d += qs[warp][c] * kr[c];
            s = d * scale;
        }
        float mn = fmaxf(m, warp_max(s));  // finite: key j0 <= p is in every chunk
        float alpha = m == NEG_INF ? 0.0f : expf(m - mn);
        float pj = s == NEG_INF ? 0.0f : expf(s - mn);
        l = l * alpha + warp_sum(pj);
        for (int i = 0; i < 8; i++) acc[i] *= alpha;
        int n = min(32, p - j0 + 1);
        for (int jj = 0; jj < n; jj++) {
            float pb = __shfl_sync(0xffffffffu, pj, jj);
            const float* vr = vb + (u64)(j0 + jj) * sg.v_stride;
            for (int i = 0; i < 8; i++) {
                int c = lane + 32 * i;
                if (c < vd) acc[i] += pb * vr[c];
            }
        }
        m = mn;
    }
    float* o = out + (u64)t * heads * vd + (u64)h * vd;
    for (int i = 0; i < 8; i++) {
        int c = lane + 32 * i;
        if (c < vd) o[c] = acc[i] / l;
    }
}

__device__ __forceinline__ u32 ld_pair(const u16* p) { return *(const u32*)p; }
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
}

// c += a·b: a 16x16 bf16 (row), b 16x8 bf16 (col), c 16x8 f32.
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, const u32* b) {
#ifdef STRATA_EMULATE
    emu_mma_bf16(c, a, b);  // tests/cuda_emu/shim.h: the PTX fragment layout, lane by lane
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// Block tiles: 64 queries (4 warps of 16) by 32 keys.
#define BQ 64
#define BK 32

// VT: output n-tiles of 8 columns. Grid (query tiles, heads), 128 threads.
// tiles[i] = (segment, first query of the tile within it). Dynamic shared
// memory: (BQ·dp + BK·dp + BK·8·VT) bf16 values, dp = hd rounded up to 16.
template <int VT>
__device__ void attention_bf16(const float* q, int q_stride, const Seg* segs, const int* tiles, int heads,
                               int kv_heads, int hd, int vd, int window, float scale, float* out) {
    extern __shared__ u16 smem[];
    const int dp = (hd + 15) & ~15, vdp = 8 * VT;
    u16* sq = smem;            // [BQ][dp]
    u16* sk = sq + BQ * dp;    // [BK][dp]
    u16* sv = sk + BK * dp;    // [BK][vdp]
    Seg sg = segs[tiles[2 * blockIdx.x]];
    int qi0 = tiles[2 * blockIdx.x + 1];
    int nq = min(BQ, sg.q_len - qi0);
    int h = blockIdx.y, g = h / (heads / kv_heads);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    for (int i = threadIdx.x; i < BQ * dp; i += blockDim.x) {
        int r = i / dp, c = i % dp;
        float v = (r < nq && c < hd) ? q[(u64)(sg.q_row0 + qi0 + r) * q_stride + (u64)h * hd + c] : 0.0f;
        sq[i] = f32_to_bf16(v);
    }
    int p_first = sg.pos0 + qi0, p_last = p_first + nq - 1;
    int lo = window > 0 ? max(0, p_first - window + 1) : 0;
    int ra = warp * 16 + gid;               // this thread's rows ra and ra + 8
    int pos[2] = {p_first + ra, p_first + ra + 8};
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    float o[VT][4];
    for (int n = 0; n < VT; n++)
        for (int e = 0; e < 4; e++) o[n][e] = 0.0f;
    const float* kb = (const float*)sg.k + (u64)g * hd;
    const float* vb = (const float*)sg.v + (u64)g * vd;
    for (int k0 = (lo / BK) * BK; k0 <= p_last; k0 += BK) {
        __syncthreads();  // the previous tile is consumed (and sq written, the first time)
        for (int i = threadIdx.x; i < BK * dp; i += blockDim.x) {
            int r = i / dp, c = i % dp, j = k0 + r;
            sk[i] = f32_to_bf16(j <= p_last && c < hd ? kb[(u64)j * sg.k_stride + c] : 0.0f);
        }
        for (int i = threadIdx.x; i < BK * vdp; i += blockDim.x) {
            int r = i / vdp, c = i % vdp, j = k0 + r;
            sv[i] = f32_to_bf16(j <= p_last && c < vd ? vb[(u64)j * sg.v_stride + c] : 0.0f);
        }
        __syncthreads();
        // s = q·kᵀ for 16 rows x 32 keys: four 16x8 tiles.
        float s[4][4];
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) s[n][e] = 0.0f;
        for (int kk = 0; kk < dp; kk += 16) {
            const u16* qa = sq + ra * dp + kk + 2 * tig;
            u32 a[4] = {ld_pair(qa), ld_pair(qa + 8 * dp), ld_pair(qa + 8), ld_pair(qa + 8 * dp + 8)};
            for (int n = 0; n < 4; n++) {
                const u16* kr = sk + (n * 8 + gid) * dp + kk + 2 * tig;
                u32 b[2] = {ld_pair(kr), ld_pair(kr + 8)};
                mma_bf16(s[n], a, b);
            }
        }
        // Scale and mask, then the online softmax of each of the two rows.
        float mx[2] = {NEG_INF, NEG_INF};
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) {
                int r = e >> 1, j = k0 + n * 8 + 2 * tig + (e & 1);
                bool ok = j <= pos[r] && (window <= 0 || j > pos[r] - window);
                s[n][e] = ok ? s[n][e] * scale : NEG_INF;
                mx[r] = fmaxf(mx[r], s[n][e]);
            }
        float alpha[2], base[2], sum[2] = {0.0f, 0.0f};
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            float mn = fmaxf(m[r], mx[r]);
            base[r] = mn == NEG_INF ? 0.0f : mn;
            alpha[r] = m[r] == NEG_INF ? 0.0f : expf(m[r] - mn);
            m[r] = mn;
        }
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) {
                int r = e >> 1;
                s[n][e] = s[n][e] == NEG_INF ? 0.0f : expf(s[n][e] - base[r]);
                sum[r] += s[n][e];
            }
        for (int r = 0; r < 2; r++) {
            sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
            sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
            l[r] = l[r] * alpha[r] + sum[r];
        }
        for (int n = 0; n < VT; n++) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
        }
        // o += p·v, 16 keys at a time: p's C fragments are the A fragment.
        for (int kc = 0; kc < 2; kc++) {
            u32 a[4] = {pack_bf16(s[2 * kc][0], s[2 * kc][1]), pack_bf16(s[2 * kc][2], s[2 * kc][3]),
                        pack_bf16(s[2 * kc + 1][0], s[2 * kc + 1][1]), pack_bf16(s[2 * kc + 1][2], s[2 * kc + 1][3])};
            const u16* vr = sv + (kc * 16 + 2 * tig) * vdp + gid;
            for (int n = 0; n < VT; n++) {
                const u16* v0 = vr + n * 8;
                u32 b[2] = {(u32)v0[0] | ((u32)v0[vdp] << 16), (u32)v0[8 * vdp] | ((u32)v0[9 * vdp] << 16)};
                mma_bf16(o[n], a, b);
            }
        }
    }
    for (int r = 0; r < 2; r++) {
        int row = ra + 8 * r;
        if (row >= nq) continue;
        float* dst = out + (u64)(sg.q_row0 + qi0 + row) * heads * vd + (u64)h * vd;
        for (int n = 0; n < VT; n++)
            for (int e = 0; e < 2; e++) {
                int c = n * 8 + 2 * tig + e;
                if (c < vd) dst[c] = o[n][2 * r + e] / l[r];
            }
    }
}

// One entry point per value width (written out: the CPU emulation reads these signatures).
extern "C" __global__ void attention_bf16_v16(const float* q, int q_stride, const Seg* segs, const int* tiles,
                                              int heads, int kv_heads, int hd, int vd, int window, float scale,
                                              float* out) {
    attention_bf16<2>(q, q_stride, segs, tiles, heads, kv_heads, hd, vd, window, scale, out);
}
extern "C" __global__ void attention_bf16_v32(const float* q, int q_stride, const Seg* segs, const int* tiles,
                                              int heads, int kv_heads, int hd, int vd, int window, float scale,
                                              float* out) {
    attention_bf16<4>(q, q_stride, segs, tiles, heads, kv_heads, hd, vd, window, scale, out);
}
extern "C" __global__ void attention_bf16_v64(const float* q, int q_stride, const Seg* segs, const int* tiles,
                                              int heads, int kv_heads, int hd, int vd, int window, float scale,
                                              float* out) {
    attention_bf16<8>(q, q_stride, segs, tiles, heads, kv_heads, hd, vd, window, scale, out);
}
extern "C" __global__ void attention_bf16_v128(const float* q, int q_stride, const Seg* segs, const int* tiles,
                                               int heads, int kv_heads, int hd, int vd, int window, float scale,
                                               float* out) {
    attention_bf16<16>(q, q_stride, segs, tiles, heads, kv_heads, hd, vd, window, scale, out);
}
extern "C" __global__ void attention_bf16_v256(const float* q, int q_stride, const Seg* segs, const int* tiles,
                                               int heads, int kv_heads, int hd, int vd, int window, float scale,
                                               float* out) {
    attention_bf16<32>(q, q_stride, segs, tiles, heads, kv_heads, hd, vd, window, scale, out);
}
