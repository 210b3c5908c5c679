// attention.cu: causal attention over the packed variable-length segments of
// a step, flash-style (one pass over the keys with an online softmax; the
// score matrix is never stored). A segment's keys and values are rows
// 0..kv_len (positions) at its own pointers: its rows of this step's k/v, or
// its sample's KV cache when it continues one (chunked prefill). Query row i
// of a segment is at position pos0 + i and sees keys j <= pos0 + i (and
// j > pos0 + i - window with a sliding window, or j in its chunk,
// j / chunk == (pos0 + i) / chunk, with attention chunks: Llama 4). GQA: query head h reads kv
// head h / (heads / kv_heads). With `sinks` (gpt-oss; null otherwise), head h's
// logit sinks[h] joins every softmax's denominator with no value row: the
// running max starts at it and the running sum at 1.
//
// - attention_f32: the exact path (f32 inputs and products): one warp per
//   (token, head); lanes score 32 keys at a time, then own output columns.
// - attention_bf16_vN: tensor cores via `mma.sync` m16n8k16 (bf16 inputs,
//   f32 accumulation) through inline PTX (no mma.h): a block of 4 warps takes
//   64 queries of one head, 16 per warp, and walks the keys 32 at a time.
//   N is the widest value head the block is compiled for (a multiple of 16).
//   Its keys and values are bf16, each head's row padded with zeros to a
//   multiple of 16 columns (see `Seg`), so a tile is copied to shared memory
//   in 16-byte pieces by `cp.async`, two tiles in flight (the next one lands
//   while this one is used). Shared rows are padded by 16 bytes, so the 8
//   rows an `ldmatrix` reads fall in 8 distinct bank groups (no conflicts);
//   V's fragments come transposed through `ldmatrix.trans`. The first 128
//   columns of Q stay in registers (wider heads read the rest from shared
//   memory each tile); the softmax runs in base 2 (log2 e folded into the
//   scale, `exp2f`).
// - attention_split_f32 / _bf16 and attention_split_combine: split-K decode
//   ("flash-decoding") for one-query segments over long caches: the keys
//   cut into splits, a block each, and their partial softmaxes merged.
#include "common.cuh"

#define NEG_INF (-__int_as_float(0x7f800000))

// The first key position a query at position p sees: the last `window`
// positions (0: all), within its chunk of `chunk` positions (0: none).
__device__ __forceinline__ int first_key(int p, int window, int chunk) {
    int lo = window > 0 ? max(0, p - window + 1) : 0;
    return chunk > 0 ? max(lo, p - p % chunk) : lo;
}

// A row's value i as f32: f32 rows as they are, bf16 rows (their bits) widened.
__device__ __forceinline__ float ld(const float* r, int i) { return r[i]; }
__device__ __forceinline__ float ld(const u16* r, int i) { return bf16_to_f32(r[i]); }

// One warp's online softmax of one query head (`qs`, hd values in shared
// memory) over keys [j_lo, j_hi), j_lo < j_hi, all of which it sees: lanes
// score 32 keys at a time, then own output columns lane + 32·i (vd <= 256).
// (m, l, acc): the running max, sum of exponentials and unnormalised
// output, carried in (a sink's start, or empty) and out. attention_f32 runs
// it over all of a query's keys, attention_split_* over one split's.
template <typename T>
__device__ __forceinline__ void attend_keys(const float* qs, const T* kb, const T* vb, int k_stride, int v_stride,
                                            int hd, int vd, float scale, int j_lo, int j_hi, float& m, float& l,
                                            float* acc) {
    int lane = threadIdx.x & 31;
    for (int j0 = j_lo; j0 < j_hi; j0 += 32) {
        int j = j0 + lane;
        float s = NEG_INF;
        if (j < j_hi) {
            const T* kr = kb + (u64)j * k_stride;
            float d = 0.0f;
            for (int c = 0; c < hd; c++) d += qs[c] * ld(kr, c);
            s = d * scale;
        }
        float mn = fmaxf(m, warp_max(s));  // finite: key j0 is seen (j_lo is the first key)
        float alpha = m == NEG_INF ? 0.0f : expf(m - mn);
        float pj = s == NEG_INF ? 0.0f : expf(s - mn);
        l = l * alpha + warp_sum(pj);
        for (int i = 0; i < 8; i++) acc[i] *= alpha;
        int n = min(32, j_hi - j0);
        for (int jj = 0; jj < n; jj++) {
            float pb = __shfl_sync(0xffffffffu, pj, jj);
            const T* vr = vb + (u64)(j0 + jj) * v_stride;
            for (int i = 0; i < 8; i++) {
                int c = lane + 32 * i;
                if (c < vd) acc[i] += pb * ld(vr, c);
            }
        }
        m = mn;
    }
}

// seg_of[t] for a token attention_f32 leaves alone: a decode row the split
// kernels below take (the backend's `SplitPlan`).
#define SEG_SPLIT 0xffffffffu

// Grid (tokens, ceil(heads / 4)), 128 threads. seg_of[t]: token t's segment
// (SEG_SPLIT: none here). q: row stride q_stride, head h at columns h·hd;
// out [T, heads·vd].
extern "C" __global__ void attention_f32(const float* q, int q_stride, const Seg* segs, const u32* seg_of, int heads,
                                        int kv_heads, int hd, int vd, int window, int chunk, float scale,
                                        const float* sinks, float* out) {
    __shared__ float qs[4][256];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int t = blockIdx.x, h = blockIdx.y * 4 + warp;
    if (h >= heads || seg_of[t] == SEG_SPLIT) return;  // whole warps leave; no block barrier follows
    Seg sg = segs[seg_of[t]];
    int p = sg.pos0 + (t - sg.q_row0);
    int lo = first_key(p, window, chunk);
    int g = h / (heads / kv_heads);
    const float* qr = q + (u64)t * q_stride + (u64)h * hd;
    for (int c = lane; c < hd; c += 32) qs[warp][c] = qr[c];
    __syncwarp();
    const float* kb = (const float*)sg.k + (u64)g * hd;
    const float* vb = (const float*)sg.v + (u64)g * vd;
    float m = sinks ? sinks[h] : NEG_INF, l = sinks ? 1.0f : 0.0f, acc[8];
    for (int i = 0; i < 8; i++) acc[i] = 0.0f;
    attend_keys(qs[warp], kb, vb, sg.k_stride, sg.v_stride, hd, vd, scale, lo, p + 1, m, l, acc);
    float* o = out + (u64)t * heads * vd + (u64)h * vd;
    for (int i = 0; i < 8; i++) {
        int c = lane + 32 * i;
        if (c < vd) o[c] = acc[i] / l;
    }
}

// Split-K decode ("flash-decoding"). A segment of one query that sees many
// keys (a generated token over its sample's KV cache) would be one block
// walking them all; instead its keys are cut into splits, each a block
// writing a partial softmax (no sink), and attention_split_combine merges
// a row's partials (log-sum-exp) with its sink. The backend's `SplitPlan`
// picks the segments and cuts the keys, from the mask (`Mask::first_key`),
// so these kernels take key ranges, not the window or chunk.
//
// Grid (splits, ceil(heads / 4)), 128 threads, a warp per query head, as
// attention_f32. split[3i..3i+3] = (segment, first key, end key): keys
// [j0, j1) of that segment's one query (row q_row0, position pos0).
// T: float (q as attention_f32's) or u16 (bf16 q, keys and values, heads
// padded to 16 columns as attention_bf16_vN's, see `Seg`).
// part_ml [splits, heads, 2]: the split's (max, sum of exp(score - max));
// part_o [splits, heads, vd]: its output, unnormalised (scaled by exp(-max)).
template <typename T>
__device__ __forceinline__ void attention_split(const T* q, int q_stride, const Seg* segs, const int* split,
                                                int heads, int kv_heads, int hd, int vd, float scale, float* part_ml,
                                                float* part_o) {
    __shared__ float qs[4][256];
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int h = blockIdx.y * 4 + warp;
    if (h >= heads) return;  // whole warps leave; no block barrier follows
    const int* it = split + 3 * blockIdx.x;
    Seg sg = segs[it[0]];
    int g = h / (heads / kv_heads);
    // Head widths in a row: bf16 heads are padded to 16 columns.
    int qw = sizeof(T) == 2 ? (hd + 15) & ~15 : hd, vw = sizeof(T) == 2 ? (vd + 15) & ~15 : vd;
    const T* qr = q + (u64)sg.q_row0 * q_stride + (u64)h * qw;
    for (int c = lane; c < hd; c += 32) qs[warp][c] = ld(qr, c);
    __syncwarp();
    const T* kb = (const T*)sg.k + (u64)g * qw;
    const T* vb = (const T*)sg.v + (u64)g * vw;
    float m = NEG_INF, l = 0.0f, acc[8];
    for (int i = 0; i < 8; i++) acc[i] = 0.0f;
    attend_keys(qs[warp], kb, vb, sg.k_stride, sg.v_stride, hd, vd, scale, it[1], it[2], m, l, acc);
    u64 at = (u64)blockIdx.x * heads + h;
    if (lane == 0) {
        part_ml[2 * at] = m;
        part_ml[2 * at + 1] = l;
    }
    float* o = part_o + at * vd;
    for (int i = 0; i < 8; i++) {
        int c = lane + 32 * i;
        if (c < vd) o[c] = acc[i];
    }
}

extern "C" __global__ void attention_split_f32(const float* q, int q_stride, const Seg* segs, const int* split,
                                               int heads, int kv_heads, int hd, int vd, float scale, float* part_ml,
                                               float* part_o) {
    attention_split<float>(q, q_stride, segs, split, heads, kv_heads, hd, vd, scale, part_ml, part_o);
}

extern "C" __global__ void attention_split_bf16(const u16* q, int q_stride, const Seg* segs, const int* split,
                                                int heads, int kv_heads, int hd, int vd, float scale, float* part_ml,
                                                float* part_o) {
    attention_split<u16>(q, q_stride, segs, split, heads, kv_heads, hd, vd, scale, part_ml, part_o);
}

// The merge of a split row's partials: with M the largest of their maxima
// (and the sink), out = Σ o_i·e^(m_i - M) / (Σ l_i·e^(m_i - M) + e^(sink - M)),
// over the splits in key order (a fixed order: the same bits run to run).
// Grid (rows, ceil(heads / 4)), 128 threads, a warp per head; rows[3r..3r+3]
// = (the query's row in out, its first split, its splits).
extern "C" __global__ void attention_split_combine(const int* rows, int heads, int vd, const float* sinks,
                                                   const float* part_ml, const float* part_o, float* out) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int h = blockIdx.y * 4 + warp;
    if (h >= heads) return;
    const int* r = rows + 3 * blockIdx.x;
    int t = r[0], i0 = r[1], n = r[2];
    float mx = sinks ? sinks[h] : NEG_INF;
    for (int i = 0; i < n; i++) mx = fmaxf(mx, part_ml[2 * ((u64)(i0 + i) * heads + h)]);
    float l = sinks ? expf(sinks[h] - mx) : 0.0f, acc[8];
    for (int k = 0; k < 8; k++) acc[k] = 0.0f;
    for (int i = 0; i < n; i++) {
        u64 at = (u64)(i0 + i) * heads + h;
        float w = expf(part_ml[2 * at] - mx);  // mx is finite: every split holds a key
        l += part_ml[2 * at + 1] * w;
        const float* o = part_o + at * vd;
        for (int k = 0; k < 8; k++) {
            int c = lane + 32 * k;
            if (c < vd) acc[k] += w * o[c];
        }
    }
    float* dst = out + (u64)t * heads * vd + (u64)h * vd;
    for (int k = 0; k < 8; k++) {
        int c = lane + 32 * k;
        if (c < vd) dst[c] = acc[k] / l;
    }
}

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

// The four 8x8 bf16 matrices whose rows lanes 0-7, 8-15, 16-23 and 24-31
// point at (`row`: this lane's row, 16-byte aligned, in shared memory): r[i]
// holds matrix i's (row lane/4, columns 2·(lane%4), +1), or with TRANS its
// (rows 2·(lane%4), +1, column lane/4).
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(u32* r, const u16* row) {
#ifdef STRATA_EMULATE
    emu_ldmatrix_x4(r, row, TRANS);
#else
    if constexpr (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(smem_addr(row)));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(smem_addr(row)));
#endif
}

// Block tiles: 64 queries (4 warps of 16) by 32 keys.
#define BQ 64
#define BK 32
// Q's 16-column chunks held in registers (the first 128 columns).
#define QREG 8

// Copies a tile of `ROWS` bf16 rows of `w` columns (a multiple of 8; row j
// at src + j·stride) into shared rows of `ld` values, in 16-byte pieces;
// rows past `valid` are zero-filled.
template <int ROWS = BK>
__device__ __forceinline__ void load_tile(u16* dst, int ld, const u16* src, u64 stride, int w, int valid) {
    int pieces = w >> 3;  // 8 values of 2 bytes
    for (int i = threadIdx.x; i < ROWS * pieces; i += blockDim.x) {
        int r = i / pieces, c = (i - r * pieces) << 3;
        bool in = r < valid;
        cp_async16(dst + r * ld + c, src + (in ? (u64)r * stride + c : 0), in);
    }
}

// VT: output n-tiles of 8 columns (N = 8·VT). Grid (query tiles, heads),
// 128 threads. tiles[i] = (segment, first query of the tile within it).
// q: bf16 rows of `heads` heads, each padded with zeros to dp (as keys are;
// `q_stride` in values), packed by pack_heads_bf16.
// Dynamic shared memory (`attention_bf16_smem` in backend.rs): Q [BQ][dp+8],
// K 2×[BK][dp+8], V 2×[BK][vp+8] bf16, dp and vp the head dims rounded up to 16.
template <int VT>
__device__ __forceinline__ void attention_bf16(const u16* q, int q_stride, const Seg* segs, const int* tiles, int heads,
                               int kv_heads, int hd, int vd, int window, int chunk, float scale,
                               const float* sinks, float* out) {
    extern __shared__ __align__(16) u16 smem[];  // ldmatrix and cp.async take 16-byte rows
    const int dp = (hd + 15) & ~15, vp = (vd + 15) & ~15, ldk = dp + 8, ldv = vp + 8;
    const int kc = dp >> 4, vt = vp >> 3;  // Q/K 16-column chunks, V 8-column tiles
    u16* sq = smem;                // [BQ][ldk]
    u16* sk = sq + BQ * ldk;       // [2][BK][ldk]
    u16* sv = sk + 2 * BK * ldk;   // [2][BK][ldv]
    Seg sg = segs[tiles[2 * blockIdx.x]];
    int qi0 = tiles[2 * blockIdx.x + 1];
    int nq = min(BQ, sg.q_len - qi0);
    int h = blockIdx.y, g = h / (heads / kv_heads);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, gid = lane >> 2, tig = lane & 3;
    int p_first = sg.pos0 + qi0, p_last = p_first + nq - 1;
    int lo = first_key(p_first, window, chunk);  // the tile's lowest: first_key grows with p
    int k_begin = (lo / BK) * BK;
    const u16* kb = (const u16*)sg.k + (u64)g * dp;
    const u16* vb = (const u16*)sg.v + (u64)g * vp;
    // The query tile, then the first key tile, each a group of copies: Q is
    // waited for while the keys are still on their way.
    load_tile<BQ>(sq, ldk, q + (u64)(sg.q_row0 + qi0) * q_stride + (u64)h * dp, q_stride, dp, nq);
    cp_async_commit();
    load_tile(sk, ldk, kb + (u64)k_begin * sg.k_stride, sg.k_stride, dp, p_last + 1 - k_begin);
    load_tile(sv, ldv, vb + (u64)k_begin * sg.v_stride, sg.v_stride, vp, p_last + 1 - k_begin);
    cp_async_commit();
    cp_async_wait_1();
    __syncthreads();
    // This lane's row address for ldmatrix: A (Q) fragments take rows
    // (lane & 15) at column 8·(lane >> 4); B (K, V) fragments rows
    // (lane & 7) + 8·(lane >> 4) at column 8·((lane >> 3) & 1) for K, and
    // rows (lane & 15) at column 8·(lane >> 4) for V (transposed).
    const int a_row = lane & 15, a_col = (lane >> 4) << 3;
    const int kb_row = (lane & 7) + ((lane >> 4) << 3), kb_col = ((lane >> 3) & 1) << 3;
    const u16* qa = sq + (warp * 16 + a_row) * ldk + a_col;
    u32 qf[QREG][4];
#pragma unroll
    for (int c = 0; c < QREG; c++)
        if (c < kc) ldmatrix_x4<false>(qf[c], qa + 16 * c);
    const float scale2 = scale * 1.4426950408889634f;  // scores in base 2
    int ra = warp * 16 + gid;                          // this thread's rows ra and ra + 8
    int pos[2] = {p_first + ra, p_first + ra + 8};
    // A sink starts each row's softmax (in base 2, as the scores are).
    float sink2 = sinks ? sinks[h] * 1.4426950408889634f : NEG_INF;
    float m[2] = {sink2, sink2}, l[2] = {sinks ? 1.0f : 0.0f, sinks ? 1.0f : 0.0f};
    float o[VT][4];
#pragma unroll
    for (int n = 0; n < VT; n++)
        for (int e = 0; e < 4; e++) o[n][e] = 0.0f;
    int stage = 0;
    for (int k0 = k_begin; k0 <= p_last; k0 += BK, stage ^= 1) {
        // The next tile into the other stage (freed by the barrier at the
        // end of the last iteration), then wait for this one.
        int k1 = k0 + BK;
        if (k1 <= p_last) {
            load_tile(sk + (stage ^ 1) * BK * ldk, ldk, kb + (u64)k1 * sg.k_stride, sg.k_stride, dp, p_last + 1 - k1);
            load_tile(sv + (stage ^ 1) * BK * ldv, ldv, vb + (u64)k1 * sg.v_stride, sg.v_stride, vp, p_last + 1 - k1);
        }
        cp_async_commit();  // (an empty group when there is none: wait_group counts groups)
        cp_async_wait_1();
        __syncthreads();
        const u16* tk = sk + stage * BK * ldk;
        const u16* tv = sv + stage * BK * ldv;
        // s = q·kᵀ for 16 rows x 32 keys: four 16x8 tiles; one ldmatrix.x4
        // gives two key tiles' fragments for 16 columns.
        float s[4][4];
#pragma unroll
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) s[n][e] = 0.0f;
#pragma unroll
        for (int c = 0; c < QREG; c++) {
            if (c < kc) {
#pragma unroll
                for (int np = 0; np < 2; np++) {
                    u32 b[4];
                    ldmatrix_x4<false>(b, tk + (np * 16 + kb_row) * ldk + 16 * c + kb_col);
                    mma_bf16(s[2 * np], qf[c], b);
                    mma_bf16(s[2 * np + 1], qf[c], b + 2);
                }
            }
        }
        for (int c = QREG; c < kc; c++) {  // wider heads: the rest of Q from shared memory
            u32 a[4];
            ldmatrix_x4<false>(a, qa + 16 * c);
#pragma unroll
            for (int np = 0; np < 2; np++) {
                u32 b[4];
                ldmatrix_x4<false>(b, tk + (np * 16 + kb_row) * ldk + 16 * c + kb_col);
                mma_bf16(s[2 * np], a, b);
                mma_bf16(s[2 * np + 1], a, b + 2);
            }
        }
        // Scale and mask, then the online softmax of each of the two rows.
        float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) {
                int r = e >> 1, j = k0 + n * 8 + 2 * tig + (e & 1);
                bool ok = j <= pos[r] && j >= first_key(pos[r], window, chunk);
                s[n][e] = ok ? s[n][e] * scale2 : NEG_INF;
                mx[r] = fmaxf(mx[r], s[n][e]);
            }
        float alpha[2], base[2], sum[2] = {0.0f, 0.0f};
        for (int r = 0; r < 2; r++) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
            float mn = fmaxf(m[r], mx[r]);
            base[r] = mn == NEG_INF ? 0.0f : mn;
            alpha[r] = m[r] == NEG_INF ? 0.0f : exp2f(m[r] - mn);
            m[r] = mn;
        }
#pragma unroll
        for (int n = 0; n < 4; n++)
            for (int e = 0; e < 4; e++) {
                int r = e >> 1;
                s[n][e] = s[n][e] == NEG_INF ? 0.0f : exp2f(s[n][e] - base[r]);
                sum[r] += s[n][e];
            }
        for (int r = 0; r < 2; r++) {
            sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 1);
            sum[r] += __shfl_xor_sync(0xffffffffu, sum[r], 2);
            l[r] = l[r] * alpha[r] + sum[r];
        }
#pragma unroll
        for (int n = 0; n < VT; n++) {
            o[n][0] *= alpha[0];
            o[n][1] *= alpha[0];
            o[n][2] *= alpha[1];
            o[n][3] *= alpha[1];
        }
        // o += p·v, 16 keys at a time: p's C fragments are the A fragment;
        // one ldmatrix.x4.trans gives two value tiles' fragments.
#pragma unroll
        for (int kk = 0; kk < 2; kk++) {
            u32 a[4] = {pack_bf16(s[2 * kk][0], s[2 * kk][1]), pack_bf16(s[2 * kk][2], s[2 * kk][3]),
                        pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            const u16* vr = tv + (kk * 16 + a_row) * ldv + a_col;
#pragma unroll
            for (int n = 0; n < VT; n += 2) {
                if (n < vt) {
                    u32 b[4];
                    ldmatrix_x4<true>(b, vr + 8 * n);
                    mma_bf16(o[n], a, b);
                    mma_bf16(o[n + 1], a, b + 2);
                }
            }
        }
        __syncthreads();  // this stage is consumed: the next iteration may refill it
    }
    // Unrolled, with constant indices, so `o` stays in registers.
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int row = ra + 8 * r;
        float* dst = out + (u64)(sg.q_row0 + qi0 + row) * heads * vd + (u64)h * vd;
#pragma unroll
        for (int n = 0; n < VT; n++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int c = n * 8 + 2 * tig + e;
                if (row < nq && c < vd) dst[c] = o[n][2 * r + e] / l[r];
            }
    }
}

// One entry point per value width (written out: build.rs reads these signatures).
extern "C" __global__ void attention_bf16_v16(const u16* q, int q_stride, const Seg* segs, const int* tiles,
                                              int heads, int kv_heads, int hd, int vd, int window, int chunk,
                                              float scale, const float* sinks, float* out) {
    attention_bf16<2>(q, q_stride, segs, tiles, heads, kv_heads, hd, vd, window, chunk, scale, sinks, out);
}
extern "C" __global__ void attention_bf16_v32(const u16* q, int q_stride, const Seg* segs, const int* tiles,
                                              int heads, int kv_heads, int hd, int vd, int window, int chunk,
                                              float scale, const float* sinks, float* out) {
    attention_bf16<4>(q, q_stride, segs, tiles, heads, kv_heads, hd, vd, window, chunk, scale, sinks, out);
}
extern "C" __global__ void attention_bf16_v64(const u16* q, int q_stride, const Seg* segs, const int* tiles,
                                              int heads, int kv_heads, int hd, int vd, int window, int chunk,
                                              float scale, const float* sinks, float* out) {
    attention_bf16<8>(q, q_stride, segs, tiles, heads, kv_heads, hd, vd, window, chunk, scale, sinks, out);
}
extern "C" __global__ void attention_bf16_v128(const u16* q, int q_stride, const Seg* segs, const int* tiles,
                                               int heads, int kv_heads, int hd, int vd, int window, int chunk,
                                               float scale, const float* sinks, float* out) {
    attention_bf16<16>(q, q_stride, segs, tiles, heads, kv_heads, hd, vd, window, chunk, scale, sinks, out);
}
extern "C" __global__ void attention_bf16_v256(const u16* q, int q_stride, const Seg* segs, const int* tiles,
                                               int heads, int kv_heads, int hd, int vd, int window, int chunk,
                                               float scale, const float* sinks, float* out) {
    attention_bf16<32>(q, q_stride, segs, tiles, heads, kv_heads, hd, vd, window, chunk, scale, sinks, out);
}
