// decode.cu: split-K "flash-decoding" for one query row per sequence (T == 1).
//
// Grid (splits, kv_heads * head_chunks, batch), SA_THREADS threads. A block takes one split of the
// visible keys of one (sequence, kv head) and serves up to SA_MAX_GROUP query heads of its GQA group,
// so each K/V row is loaded once for all of them. TPR threads cover a row with 16-byte loads; the block
// works on GROUPS rows at once, each row-group keeping its own online softmax, merged in shared memory
// at the end. The block writes a normalised partial (out, lse); merge.cu combines the splits exactly.
// With one split the partial is the answer and the host points part_out/part_lse at out/lse.
// Sink keys (the first n_sink of the key list) are scored with q_sink, the rest with q: a model that
// assigns positions within the cache rotates q_sink at the query's cache position (q_sink == q otherwise).
// Two passes over the key range, sinks first, one online softmax across both: exact, as any split is.
// SOFTCAP (Gemma-2's attention logit soft-capping): each score s, in log2 units, becomes
// c * tanh(s / c) with c = softcap_log2 (the cap times log2 e: the same map as on natural-log scores),
// before the online softmax; the false instantiation has no trace of it.
// VKIND: V's storage kind where it differs from K's (each thread reads V's elements at K's positions:
// sa_load_part); VKIND == KIND is the one-kind kernel.
#include "streamattn_common.cuh"

template <int KIND, int HD, bool SOFTCAP = false, int VKIND = KIND>
__global__ void __launch_bounds__(SA_THREADS) sa_decode_split(
    const float* __restrict__ q,       // [batch, q_heads, HD] (the one query row)
    const float* __restrict__ q_sink,  // [batch, q_heads, HD] the query as scored against sink keys
    const void* __restrict__ k,        // [batch, kv_heads, slots, HD] storage KIND (quantized: row bytes)
    const void* __restrict__ v,        // [batch, kv_heads, slots, HD] storage VKIND (quantized: row bytes)
    const int* __restrict__ lengths,   // [batch] tokens seen, newest already written
    const int* __restrict__ counts,    // [batch] 1 = real query row, 0 = padding
    float* __restrict__ part_out,      // [batch, q_heads, splits, HD]
    float* __restrict__ part_lse,      // [batch, q_heads, splits]
    int q_heads, int kv_heads, int slots, int window, int sinks, int splits, float scale_log2,
    float softcap_log2) {  // the soft cap in log2 units (read only when SOFTCAP)
    using R = SaRow<KIND, HD>;
    using PV = SaPart<VKIND, R::E>;  // V's loads per K vector
    constexpr int G = SA_MAX_GROUP;
    const int tid = threadIdx.x;
    const int rg = tid / R::TPR;    // row-group: which key of the current step this thread works on
    const int lane = tid % R::TPR;  // position inside the row
    const int split = blockIdx.x;
    const int group = q_heads / kv_heads;
    const int chunks = (group + G - 1) / G;
    const int kvh = blockIdx.y / chunks;
    const int h0 = kvh * group + (blockIdx.y % chunks) * G;  // first query head of this block
    const int nh = min(G, kvh * group + group - h0);
    const int b = blockIdx.z;
    const float inv_cap = SOFTCAP ? 1.0f / softcap_log2 : 0.0f;

    const int length = lengths[b];
    SaKeys keys = sa_keys(length, length - 1, window, sinks);
    if (counts[b] < 1) keys.n = 0;  // padding row: no keys, zeros and lse = -inf
    const int per = (keys.n + splits - 1) / splits;
    const int begin = min(split * per, keys.n);
    const int end = min(begin + per, keys.n);

    float m[G], l[G], acc[G][R::EPT];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        m[h] = sa_neg_inf();
        l[h] = 0.0f;
#pragma unroll
        for (int e = 0; e < R::EPT; ++e) acc[h][e] = 0.0f;
    }

    const long long head_base = ((long long)b * kv_heads + kvh) * slots;
    float qr[G][R::EPT];  // this thread's slice of each query head, pre-scaled to log2 units
#pragma unroll 1
    for (int pass = 0; pass < 2; ++pass) {  // 0: sink keys [0, n_sink) with q_sink; 1: the rest with q
        const float* qp = pass == 0 ? q_sink : q;
        const int lo = pass == 0 ? begin : max(begin, keys.n_sink);
        const int hi = pass == 0 ? min(end, keys.n_sink) : end;
#pragma unroll
        for (int h = 0; h < G; ++h)
#pragma unroll
            for (int i = 0; i < R::VPT; ++i)
#pragma unroll
                for (int e = 0; e < R::E; ++e) {
                    const int d = (i * R::TPR + lane) * R::E + e;
                    qr[h][i * R::E + e] =
                        h < nh ? qp[((long long)b * q_heads + h0 + h) * HD + d] * scale_log2 : 0.0f;
                }
        // The trip count is the same for every thread of the block, so the shuffles below never diverge;
        // a row-group past `hi` computes on zeros and skips the update.
        for (int step = lo; step < hi; step += SA_UNROLL * R::GROUPS) {
            SaRaw kraw[SA_UNROLL][R::VPT], vraw[SA_UNROLL][R::VPT][PV::COUNT];
            bool ok[SA_UNROLL];
#pragma unroll
            for (int u = 0; u < SA_UNROLL; ++u) {  // issue every load of this step first
                const int i = step + u * R::GROUPS + rg;
                ok[u] = i < hi;
                const int slot = ok[u] ? sa_slot(sa_key_pos(keys, i), window, sinks, slots) : 0;
                const long long row = (head_base + slot) * HD;
#pragma unroll
                for (int j = 0; j < R::VPT; ++j) {
                    const long long elem = row + (j * R::TPR + lane) * R::E;
                    kraw[u][j] = ok[u] ? sa_load16<KIND, HD>(k, elem) : SaRaw{make_uint4(0u, 0u, 0u, 0u), 0.0f};
                    if constexpr (VKIND == KIND) {  // the one-kind kernel's code, as it was
                        vraw[u][j][0] = ok[u] ? sa_load16<KIND, HD>(v, elem) : SaRaw{make_uint4(0u, 0u, 0u, 0u), 0.0f};
                    } else if (ok[u]) {
                        sa_load_part<VKIND, HD, R::E>(v, elem, vraw[u][j]);
                    } else {
#pragma unroll
                        for (int c = 0; c < PV::COUNT; ++c) vraw[u][j][c] = SaRaw{make_uint4(0u, 0u, 0u, 0u), 0.0f};
                    }
                }
            }
#pragma unroll
            for (int u = 0; u < SA_UNROLL; ++u) {
                float kf[R::EPT], vf[R::EPT];
#pragma unroll
                for (int j = 0; j < R::VPT; ++j) {
                    sa_unpack<KIND>(kraw[u][j], kf + j * R::E);
                    if constexpr (VKIND == KIND)
                        sa_unpack<KIND>(vraw[u][j][0], vf + j * R::E);
                    else
                        sa_unpack_part<VKIND, R::E>(vraw[u][j], ((j * R::TPR + lane) * R::E) % PV::EV, vf + j * R::E);
                }
#pragma unroll
                for (int h = 0; h < G; ++h) {
                    float s = 0.0f;
#pragma unroll
                    for (int e = 0; e < R::EPT; ++e) s += qr[h][e] * kf[e];
#pragma unroll
                    for (int off = R::TPR / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
                    if constexpr (SOFTCAP) s = sa_soft_cap(s, softcap_log2, inv_cap);
                    if (ok[u]) {
                        const float m_new = fmaxf(m[h], s);
                        const float c = exp2f(m[h] - m_new);  // 0 on the first key (m = -inf)
                        const float p = exp2f(s - m_new);
                        l[h] = l[h] * c + p;
#pragma unroll
                        for (int e = 0; e < R::EPT; ++e) acc[h][e] = acc[h][e] * c + p * vf[e];
                        m[h] = m_new;
                    }
                }
            }
        }
    }  // pass

    // Merge the row-groups' softmax states, then write this split's normalised partial.
    __shared__ float s_m[R::GROUPS][G];
    __shared__ float s_l[R::GROUPS][G];
    __shared__ float s_acc[R::GROUPS][G][HD];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        if (lane == 0) {
            s_m[rg][h] = m[h];
            s_l[rg][h] = l[h];
        }
#pragma unroll
        for (int i = 0; i < R::VPT; ++i)
#pragma unroll
            for (int e = 0; e < R::E; ++e) s_acc[rg][h][(i * R::TPR + lane) * R::E + e] = acc[h][i * R::E + e];
    }
    __syncthreads();
    for (int idx = tid; idx < nh * HD; idx += SA_THREADS) {
        const int h = idx / HD, d = idx % HD;
        float mx = sa_neg_inf();
        for (int g = 0; g < R::GROUPS; ++g) mx = fmaxf(mx, s_m[g][h]);
        float den = 0.0f, num = 0.0f;
        if (mx != sa_neg_inf()) {  // else no key at all: avoid exp2(-inf - -inf) = NaN
            for (int g = 0; g < R::GROUPS; ++g) {
                const float w = exp2f(s_m[g][h] - mx);
                den += s_l[g][h] * w;
                num += s_acc[g][h][d] * w;
            }
        }
        const long long row = ((long long)b * q_heads + h0 + h) * splits + split;
        part_out[row * HD + d] = den > 0.0f ? num / den : 0.0f;
        if (d == 0) part_lse[row] = den > 0.0f ? (mx + log2f(den)) * SA_LN2 : sa_neg_inf();
    }
}
