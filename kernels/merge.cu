// merge.cu: exact merge of split-K partial results (out_s, lse_s) into (out, lse).
//
//   M = max_s lse_s,  w_s = exp(lse_s - M),  out = sum_s w_s out_s / sum_s w_s,  lse = M + log(sum_s w_s)
//
// Each partial out_s is already normalised by its own denominator exp(lse_s), so the weights above
// rebuild the softmax over the union of the splits' keys. Grid (rows), SA_MERGE_THREADS threads.
#include "streamattn_common.cuh"

#ifndef SA_MERGE_THREADS
#define SA_MERGE_THREADS 64
#endif

template <int HD>
__global__ void __launch_bounds__(SA_MERGE_THREADS) sa_merge(
    const float* __restrict__ part_out,  // [rows, splits, HD]
    const float* __restrict__ part_lse,  // [rows, splits]
    float* __restrict__ out,             // [rows, HD]
    float* __restrict__ lse,             // [rows]
    int splits) {
    const long long row = blockIdx.x;
    const float* pl = part_lse + row * splits;
    float mx = sa_neg_inf();
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, pl[s]);
    for (int d = threadIdx.x; d < HD; d += SA_MERGE_THREADS) {
        float den = 0.0f, num = 0.0f;
        if (mx != sa_neg_inf()) {  // else every split was empty: zeros and lse = -inf
            for (int s = 0; s < splits; ++s) {
                const float w = exp2f((pl[s] - mx) * (1.0f / SA_LN2));
                den += w;
                num += w * part_out[(row * splits + s) * HD + d];
            }
        }
        out[row * HD + d] = den > 0.0f ? num / den : 0.0f;
        if (d == 0) lse[row] = den > 0.0f ? mx + log2f(den) * SA_LN2 : sa_neg_inf();
    }
}
