// layer_ops.cu: the decoder layer's elementwise and row work on the GPU, one launch each, float32.
//
// What models/array_ops.py computes as array code, in the same float32 steps, except that sums of
// squares are reduced in another order (a warp tree instead of numpy's pairwise sum) and NVRTC contracts
// a multiply and an add into one FMA (its default, --fmad=true): last-place differences, within the
// model tests' tolerance of the CPU path.
//   sa_rows<MODE>       RMSNorm of rows, and the residual add with or without a post-norm:
//                         MODE 0: dst = src * (1 / sqrt(mean(src^2) + eps)) * w
//                         MODE 1: dst += src
//                         MODE 2: dst += src * (1 / sqrt(mean(src^2) + eps)) * w   (Gemma's post norms)
//                       grid (rows), SA_ROW_THREADS threads; one block a row of n values.
//   sa_heads_rope<NEOX, QKNORM>
//                       the fused q/k/v rows h [B, T, (H + 2 Hk) hd] [plus the bias [(H + 2 Hk) hd] where
//                       `biased` (Qwen2's q/k/v bias), one float32 add] split into heads: q [B, H, T, hd],
//                       k, v [B, Hk, T, hd]; q and k [RMSNormed per head by qk_norm [H + Hk, hd] (Gemma-3,
//                       Qwen3),] rotated at the token's position pos [B, T] (int32, on the device).
//                       grid (B T, ceil((H + 2 Hk) / SA_HEAD_WARPS)), one warp a head; lane l takes the
//                       rotation pairs l, l + 32, ...: (2i, 2i + 1) interleaved, (i, i + hd / 2) NEOX.
//                       The angle pos * inv_freq[i] is formed in double and its cosine and sine taken in
//                       double, times the attention factor `scale`, then rounded to float32: the
//                       tables of models/rope.py (rope_tables), without tables (angles reach 1e5
//                       radians over long texts, where float32 would lose the phase).
//   sa_glu<GELU>        out [rows, d_ff] = act(g) * u for gu = [g | u] [rows, 2 d_ff]; act silu
//                       (g / (1 + exp(-g))) or gelu-tanh. grid (rows, ceil(d_ff / SA_ROW_THREADS)).
// Every kernel reads and writes C-contiguous float32 arrays; none keeps state between launches.
#include "streamattn_common.cuh"

#ifndef SA_ROW_THREADS
#define SA_ROW_THREADS 128  // threads of a row block (sa_rows) and of an elementwise block (sa_glu)
#endif
#ifndef SA_HEAD_WARPS
#define SA_HEAD_WARPS 4  // heads one sa_heads_rope block handles, a warp each
#endif

// sum over the block of each thread's s, the same float32 value in every thread (warp trees, then the
// SA_ROW_THREADS / 32 warp sums in warp order).
__device__ __forceinline__ float sa_block_sum(float s) {
    __shared__ float part[SA_ROW_THREADS / 32];
    s = sa_warp_sum(s);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < SA_ROW_THREADS / 32; ++w) total += part[w];
    __syncthreads();  // part may be written again by the block's next call
    return total;
}

template <int MODE>
__global__ void __launch_bounds__(SA_ROW_THREADS) sa_rows(float* __restrict__ dst, const float* __restrict__ src,
                                                          const float* __restrict__ w, int n, float eps) {
    const long long row = (long long)blockIdx.x * n;
    const float* s = src + row;
    float* d = dst + row;
    if constexpr (MODE == 1) {
        for (int i = threadIdx.x; i < n; i += SA_ROW_THREADS) d[i] += s[i];
    } else {
        float sq = 0.0f;
        for (int i = threadIdx.x; i < n; i += SA_ROW_THREADS) sq += s[i] * s[i];
        const float inv = 1.0f / sqrtf(sa_block_sum(sq) * (1.0f / (float)n) + eps);
        for (int i = threadIdx.x; i < n; i += SA_ROW_THREADS) {
            const float y = s[i] * inv * w[i];
            if constexpr (MODE == 0) d[i] = y;
            else d[i] += y;
        }
    }
}

template <bool NEOX, bool QKNORM>
__global__ void __launch_bounds__(SA_HEAD_WARPS * 32)
sa_heads_rope(const float* __restrict__ h, const float* __restrict__ qk_norm, const int* __restrict__ pos,
              const double* __restrict__ inv_freq, float* __restrict__ q, float* __restrict__ k,
              float* __restrict__ v, int T, int H, int Hk, int hd, float eps, double scale,
              const float* __restrict__ bias, int biased) {
    const int head = blockIdx.y * SA_HEAD_WARPS + (threadIdx.x >> 5);  // 0 .. H + 2 Hk
    const int lane = threadIdx.x & 31;
    const int bt = blockIdx.x;                                          // b * T + t
    if (head >= H + 2 * Hk) return;                                     // whole warps leave together
    const int b = bt / T, t = bt - b * T;
    const float* x = h + (long long)bt * (H + 2 * Hk) * hd + (long long)head * hd;
    const float* bh = bias + (long long)head * hd;                      // read only where biased
    // h[i] + bias[i] as array code adds them (no add where not biased: a -0 stays -0)
    auto at = [&](int i) { return biased ? x[i] + bh[i] : x[i]; };
    if (head >= H + Hk) {                                               // a v head: copied
        float* out = v + (((long long)b * Hk + (head - H - Hk)) * T + t) * hd;
        for (int i = lane; i < hd; i += 32) out[i] = at(i);
        return;
    }
    float* out = head < H ? q + (((long long)b * H + head) * T + t) * hd
                          : k + (((long long)b * Hk + (head - H)) * T + t) * hd;
    const int half = hd / 2;
    float inv = 1.0f;
    if constexpr (QKNORM) {
        float sq = 0.0f;
        for (int i = lane; i < hd; i += 32) {
            const float xi = at(i);
            sq += xi * xi;
        }
        inv = 1.0f / sqrtf(sa_warp_sum(sq) * (1.0f / (float)hd) + eps);
    }
    const float* nw = QKNORM ? qk_norm + (long long)head * hd : nullptr;
    const double p = (double)pos[bt];
    for (int i = lane; i < half; i += 32) {
        const int ia = NEOX ? i : 2 * i, ib = NEOX ? i + half : 2 * i + 1;
        float a = at(ia), c = at(ib);
        if constexpr (QKNORM) {
            a = a * inv * nw[ia];
            c = c * inv * nw[ib];
        }
        const double ang = p * inv_freq[i];
        const float cs = (float)(cos(ang) * scale), sn = (float)(sin(ang) * scale);
        out[ia] = a * cs + c * -sn;
        out[ib] = c * cs + a * sn;
    }
}

template <bool GELU>
__global__ void __launch_bounds__(SA_ROW_THREADS) sa_glu(const float* __restrict__ gu, float* __restrict__ out,
                                                         int d_ff) {
    const int j = blockIdx.y * SA_ROW_THREADS + threadIdx.x;
    if (j >= d_ff) return;
    const long long row = blockIdx.x;
    const float g = gu[row * 2 * d_ff + j], u = gu[row * 2 * d_ff + d_ff + j];
    float a;
    if constexpr (GELU) {  // 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), in array_ops.gelu_tanh's order
        a = 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g)));
    } else {
        a = g / (1.0f + expf(-g));
    }
    out[row * d_ff + j] = a * u;
}
