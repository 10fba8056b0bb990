// prefill.cu: a chunk of T query rows per sequence against the ring (the chunk is already written).
//
// Grid (ceil(T * group / ROWS), kv_heads, batch), SA_THREADS threads. A block serves ROWS query rows
// (t, h) of one kv head's GQA group, row index r = t * group + h, so K/V tiles are shared by the
// group's heads and by the chunk's queries. Each tile of KT keys is converted to float32 in shared
// memory; each warp owns RPW rows: lane j scores key j, the warp does the online softmax, and lane
// owns output elements d = lane + 32 e. Masks per (query, key) come from positions (sa_visible).
// Sink keys (the first n_sink of the key list) are scored with q_sink, the rest with q (see decode.cu):
// two passes over the tiles, s_q reloaded between them, one online softmax across both.
// SOFTCAP: each visible score soft-capped before the softmax, as in decode.cu.
// VKIND: V's storage kind where it differs from K's (V's tile is then filled by a loop of its own).
#include "streamattn_common.cuh"

template <int HD> struct SaPrefillShape {
    static constexpr int KT = HD == 256 ? 16 : 32;   // keys per shared-memory tile (<= 32: lane j = key j)
    static constexpr int RPW = HD == 256 ? 2 : 4;    // query rows per warp
    static constexpr int WARPS = SA_THREADS / 32;
    static constexpr int ROWS = RPW * WARPS;         // query rows per block
    static constexpr int DPL = HD / 32;              // output elements per lane
};

template <int KIND, int HD, bool SOFTCAP = false, int VKIND = KIND>
__global__ void __launch_bounds__(SA_THREADS) sa_prefill(
    const float* __restrict__ q,       // [batch, q_heads, T, HD]
    const float* __restrict__ q_sink,  // [batch, q_heads, T, HD] the queries as scored against sink keys
    const void* __restrict__ k,        // [batch, kv_heads, slots, HD] storage KIND
    const void* __restrict__ v,        // [batch, kv_heads, slots, HD] storage VKIND
    const int* __restrict__ lengths,   // [batch] tokens seen, the chunk already written
    const int* __restrict__ counts,    // [batch] real rows of the chunk (<= T)
    float* __restrict__ out,           // [batch, q_heads, T, HD]
    float* __restrict__ lse,           // [batch, q_heads, T]
    int q_heads, int kv_heads, int slots, int T, int window, int sinks, float scale_log2,
    float softcap_log2) {  // the soft cap in log2 units (read only when SOFTCAP)
    using S = SaPrefillShape<HD>;
    using R = SaRow<KIND, HD>;
    using RV = SaRow<VKIND, HD>;
    constexpr bool SAME = VKIND == KIND;  // K and V tiles filled by one loop
    __shared__ float s_k[S::KT][HD + 1];  // +1: lane j reads row j, so pad to spread the banks
    __shared__ float s_v[S::KT][HD];
    __shared__ float s_q[S::ROWS][HD];
    __shared__ float s_p[S::WARPS][32];
    __shared__ int s_pos[S::KT];

    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int kvh = blockIdx.y, b = blockIdx.z;
    const int group = q_heads / kv_heads;
    const int row0 = blockIdx.x * S::ROWS;
    const int length = lengths[b], count = counts[b];
    const int first_q = length - count;  // position of query row t is first_q + t
    SaKeys keys = sa_keys(length, first_q, window, sinks);
    if (count < 1) keys.n = 0;
    const float inv_cap = SOFTCAP ? 1.0f / softcap_log2 : 0.0f;

    float m[S::RPW], l[S::RPW], acc[S::RPW][S::DPL];
#pragma unroll
    for (int rr = 0; rr < S::RPW; ++rr) {
        m[rr] = sa_neg_inf();
        l[rr] = 0.0f;
#pragma unroll
        for (int e = 0; e < S::DPL; ++e) acc[rr][e] = 0.0f;
    }

    const long long head_base = ((long long)b * kv_heads + kvh) * slots;
    auto load_queries = [&](const float* qp) {  // s_q <- this block's rows of qp, in log2 units
        for (int idx = tid; idx < S::ROWS * HD; idx += SA_THREADS) {
            const int r = idx / HD, d = idx % HD, t = (row0 + r) / group, h = (row0 + r) % group;
            s_q[r][d] = t < count ? qp[(((long long)b * q_heads + kvh * group + h) * T + t) * HD + d] * scale_log2
                                  : 0.0f;
        }
    };
    auto run_tiles = [&](const int lo, const int hi) {  // keys [lo, hi) of the list against s_q
        for (int base = lo; base < hi; base += S::KT) {
            __syncthreads();  // the previous tile is no longer read
            for (int vi = tid; vi < S::KT * R::VECS; vi += SA_THREADS) {
                const int key = vi / R::VECS, vec = vi % R::VECS, i = base + key;
                float kf[R::E], vf[R::E];
                if (i < hi) {
                    const int pos = sa_key_pos(keys, i);
                    const long long elem = (head_base + sa_slot(pos, window, sinks, slots)) * HD + vec * R::E;
                    sa_unpack<KIND>(sa_load16<KIND, HD>(k, elem), kf);
                    if constexpr (SAME) sa_unpack<KIND>(sa_load16<KIND, HD>(v, elem), vf);
                    if (vec == 0) s_pos[key] = pos;
                } else {
#pragma unroll
                    for (int e = 0; e < R::E; ++e) kf[e] = vf[e] = 0.0f;
                    if (vec == 0) s_pos[key] = 0x7fffffff;  // never visible
                }
#pragma unroll
                for (int e = 0; e < R::E; ++e) {
                    s_k[key][vec * R::E + e] = kf[e];
                    if constexpr (SAME) s_v[key][vec * R::E + e] = vf[e];
                }
            }
            if constexpr (!SAME) {
                for (int vi = tid; vi < S::KT * RV::VECS; vi += SA_THREADS) {
                    const int key = vi / RV::VECS, vec = vi % RV::VECS, i = base + key;
                    float vf[RV::E];
                    if (i < hi) {
                        const long long elem =
                            (head_base + sa_slot(sa_key_pos(keys, i), window, sinks, slots)) * HD + vec * RV::E;
                        sa_unpack<VKIND>(sa_load16<VKIND, HD>(v, elem), vf);
                    } else {
#pragma unroll
                        for (int e = 0; e < RV::E; ++e) vf[e] = 0.0f;
                    }
#pragma unroll
                    for (int e = 0; e < RV::E; ++e) s_v[key][vec * RV::E + e] = vf[e];
                }
            }
            __syncthreads();
#pragma unroll
            for (int rr = 0; rr < S::RPW; ++rr) {
                const int r = warp * S::RPW + rr, t = (row0 + r) / group;
                if (t >= count) continue;  // warp-uniform: r depends on warp and rr only
                const int qpos = first_q + t;
                float s = sa_neg_inf();
                if (lane < S::KT && sa_visible(s_pos[lane], qpos, window, sinks)) {
                    s = 0.0f;
#pragma unroll 8
                    for (int d = 0; d < HD; ++d) s += s_q[r][d] * s_k[lane][d];
                    if constexpr (SOFTCAP) s = sa_soft_cap(s, softcap_log2, inv_cap);
                }
                const float m_new = fmaxf(m[rr], sa_warp_max(s));
                if (m_new == sa_neg_inf()) continue;  // nothing visible yet (uniform after the reduction)
                const float c = exp2f(m[rr] - m_new);
                const float p = s == sa_neg_inf() ? 0.0f : exp2f(s - m_new);
                l[rr] = l[rr] * c + sa_warp_sum(p);
                m[rr] = m_new;
                s_p[warp][lane] = p;
                __syncwarp();
#pragma unroll
                for (int e = 0; e < S::DPL; ++e) {
                    float a = acc[rr][e] * c;
                    for (int j = 0; j < S::KT; ++j) a += s_p[warp][j] * s_v[j][lane + 32 * e];
                    acc[rr][e] = a;
                }
                __syncwarp();  // s_p is rewritten by the next row
            }
        }
    };
    // Two passes (two inlined copies of the tile loop, so nothing extra stays live in the long one):
    // sink keys [0, n_sink) scored with q_sink, then the rest with q.
    load_queries(q_sink);
    run_tiles(0, keys.n_sink);
    __syncthreads();  // no warp still reads s_q (run_tiles syncs before its first read)
    load_queries(q);
    run_tiles(keys.n_sink, keys.n);

#pragma unroll
    for (int rr = 0; rr < S::RPW; ++rr) {
        const int r = warp * S::RPW + rr, t = (row0 + r) / group, h = (row0 + r) % group;
        if (t >= T) continue;
        const long long row = ((long long)b * q_heads + kvh * group + h) * T + t;
        const bool live = t < count && l[rr] > 0.0f;
#pragma unroll
        for (int e = 0; e < S::DPL; ++e) out[row * HD + lane + 32 * e] = live ? acc[rr][e] / l[rr] : 0.0f;
        if (lane == 0) lse[row] = live ? (m[rr] + log2f(l[rr])) * SA_LN2 : sa_neg_inf();
    }
}
