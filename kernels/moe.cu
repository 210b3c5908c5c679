// moe.cu: the router. One thread per token picks its top-k experts from the
// router's logits, in every mode of the DeepSeek family, with the reference
// backend's order: scores (softmax or sigmoid), plus noaux_tc's correction
// bias; groups ranked by their best expert (or the sum of their two best,
// noaux_tc) with ties to the lower group; the rest masked (-inf for noaux_tc,
// 0 otherwise); experts ranked with ties to the lower index, a plain sigmoid
// router's by its logits.
#include "common.cuh"

#define MAX_EXPERTS 1024
#define MAX_GROUPS 64

// logits [T, E] f32; correction [E] or null; scores, choice: scratch [T, E].
// Out: ids [T, top_k], weights [T, top_k].
// scoring: 0 softmax, 1 sigmoid. method: 0 greedy, 1 group-limited greedy, 2 noaux_tc.
extern "C" __global__ void moe_route(const float* logits, const float* correction, int tokens, int experts,
                                    int scoring, int method, int top_k, int n_group, int topk_group, int norm_topk,
                                    float scaling, float* scores, float* choice, u32* ids, float* weights) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tokens) return;
    const float* l = logits + (u64)t * experts;
    float* s = scores + (u64)t * experts;
    float* ch = choice + (u64)t * experts;
    if (scoring == 0) {
        float m = -__int_as_float(0x7f800000);
        for (int e = 0; e < experts; e++) m = fmaxf(m, l[e]);
        float z = 0.0f;
        for (int e = 0; e < experts; e++) z += expf(l[e] - m);
        for (int e = 0; e < experts; e++) s[e] = expf(l[e] - m) / z;
    } else {
        for (int e = 0; e < experts; e++) s[e] = 1.0f / (1.0f + expf(-l[e]));
    }
    // A plain sigmoid router (no groups, no correction: Llama 4's) ranks by the
    // logits, which its f32 sigmoids, equal from about 17 on, cannot always do.
    bool by_logit = scoring == 1 && method == 0 && !correction;
    for (int e = 0; e < experts; e++) ch[e] = by_logit ? l[e] : s[e] + (correction ? correction[e] : 0.0f);
    const float neg_inf = -__int_as_float(0x7f800000);
    if (method != 0 && n_group > 1) {
        int per = experts / n_group;
        float gscore[MAX_GROUPS];
        for (int g = 0; g < n_group; g++) {
            float b0 = neg_inf, b1 = neg_inf;
            for (int e = g * per; e < (g + 1) * per; e++) {
                float v = ch[e];
                if (v > b0) { b1 = b0; b0 = v; } else if (v > b1) { b1 = v; }
            }
            gscore[g] = method == 2 ? b0 + b1 : b0;
        }
        // Keep the topk_group best groups (ties to the lower index); mask the rest.
        u64 kept = 0;
        for (int n = 0; n < topk_group; n++) {
            int best = -1;
            for (int g = 0; g < n_group; g++)
                if (!((kept >> g) & 1) && (best < 0 || gscore[g] > gscore[best])) best = g;
            kept |= 1ull << best;
        }
        float fill = method == 2 ? neg_inf : 0.0f;
        for (int g = 0; g < n_group; g++)
            if (!((kept >> g) & 1))
                for (int e = g * per; e < (g + 1) * per; e++) ch[e] = fill;
    }
    u32 taken[MAX_EXPERTS / 32];
    for (int w = 0; w < (experts + 31) / 32; w++) taken[w] = 0;
    float denom = 0.0f;
    for (int k = 0; k < top_k; k++) {
        int best = -1;
        for (int e = 0; e < experts; e++)
            if (!((taken[e >> 5] >> (e & 31)) & 1) && (best < 0 || ch[e] > ch[best])) best = e;
        taken[best >> 5] |= 1u << (best & 31);
        float w = (method == 2 || by_logit) ? s[best] : ch[best];
        ids[(u64)t * top_k + k] = (u32)best;
        weights[(u64)t * top_k + k] = w;
        denom += w;
    }
    float scale = norm_topk ? scaling / (denom + 1e-20f) : scaling;
    for (int k = 0; k < top_k; k++) weights[(u64)t * top_k + k] *= scale;
}

// The rows of a MoE layer grouped by expert, on the device. ids [n] holds
// each token's experts (entry t·top_k + j: token t's j-th); grouped row
// starts[e] + r is expert e's r-th entry in entry order, as the host's
// counting sort grouped them: src[row] = its token, slot[entry] = its row.
// One block per expert (any size CUDA allows): each thread counts the
// entries of its contiguous share that go below and to the block's expert,
// thread 0 scans the counts in thread order, then each thread writes its
// share's rows in order. starts [experts + 1]; starts[experts] counts the
// entries of every expert, n unless an id is out of range.
extern "C" __global__ void moe_group(const u32* ids, int n, int top_k, int experts, u32* starts, u32* src,
                                     u32* slot) {
    __shared__ u32 below[1024];  // per thread: blockDim.x <= 1024
    __shared__ u32 mine[1024];
    u32 e = blockIdx.x;
    int per = (n + (int)blockDim.x - 1) / (int)blockDim.x;
    int i0 = min(n, (int)threadIdx.x * per), i1 = min(n, i0 + per);
    u32 b = 0, m = 0;
    for (int i = i0; i < i1; i++) {
        u32 id = ids[i];
        b += id < e;
        m += id == e;
    }
    below[threadIdx.x] = b;
    mine[threadIdx.x] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 first = 0, acc = 0;
        for (u32 t = 0; t < blockDim.x; t++) {
            first += below[t];
            u32 c = mine[t];
            mine[t] = acc;
            acc += c;
        }
        starts[e] = first;
        if (e + 1 == (u32)experts) starts[experts] = first + acc;
        below[0] = first;
    }
    __syncthreads();
    u32 row = below[0] + mine[threadIdx.x];
    for (int i = i0; i < i1; i++)
        if (ids[i] == e) {
            src[row] = (u32)(i / top_k);
            slot[i] = row;
            row++;
        }
}
