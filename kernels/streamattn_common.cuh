// streamattn_common.cuh: pieces shared by decode.cu, merge.cu and prefill.cu.
//
// Header-free on purpose: NVRTC needs no -I (no cuda_fp16.h); float16 is converted with one PTX
// instruction and bfloat16 by a shift. The CPU emulation harness (tests/cuda_emu/) defines
// STREAMATTN_EMULATION and supplies the few CUDA builtins used here; everything else is the same text.
//
// Storage kinds (template parameter KIND): 0 = float32, 1 = float16, 2 = bfloat16 (uint16 bits),
// 3 = q8_0, 4 = q4_0 (each row HD / 32 GGUF blocks: a float16 scale d, then 32 int8 q (34 bytes) or 16
// bytes of nibbles, value j in byte j's low nibble and j + 16 in its high one (18 bytes); value q * d or
// (q - 8) * d, read in place, one scale per half block of 16 values: streamattn/kv/storage.py).
// Cache layout: k, v: [batch, kv_heads, slots, head_dim] (quantized: [.., slots, HD / 32 * block bytes]),
// C-contiguous. Arithmetic in float32. K and V may be of different kinds (template parameter VKIND of the
// decode and prefill kernels; sa_load_part).
#ifndef STREAMATTN_COMMON_CUH
#define STREAMATTN_COMMON_CUH

#ifndef SA_THREADS
#define SA_THREADS 128  // threads per block of the decode and prefill kernels (4 warps)
#endif
#ifndef SA_MAX_GROUP
#define SA_MAX_GROUP 4  // query heads one decode block serves per K/V load; larger groups use more blocks
#endif
#ifndef SA_UNROLL
#define SA_UNROLL 2  // keys each thread row-group loads before it computes (bytes in flight)
#endif

#define SA_LN2 0.6931471805599453f

#ifndef STREAMATTN_EMULATION
__device__ __forceinline__ float sa_half_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
#endif

__device__ __forceinline__ float sa_neg_inf() { return __uint_as_float(0xff800000u); }

// Per storage kind: bytes of one stored element (float kinds), values per vector load, block bytes.
template <int KIND> struct SaKind {
    static constexpr bool QUANT = KIND >= 3;
    static constexpr int BYTES = (KIND == 0) ? 4 : 2;
    static constexpr int E = QUANT ? 16 : 16 / BYTES;      // a 16-byte vector, or half a quantized block
    static constexpr int BLOCK = KIND == 3 ? 34 : 18;      // bytes per 32 values (quantized kinds)
};

// One vector as loaded: 16 bytes (float kinds: the elements; q8_0: 16 int8; q4_0: 16 nibbles, one a
// byte) and, for quantized kinds, the scale of its block.
struct SaRaw { uint4 u; float d; };

// How a block's threads cover one key row with 16-byte vectors.
template <int KIND, int HD> struct SaRow {
    static constexpr int E = SaKind<KIND>::E;              // elements per vector (4, 8, or 16 quantized)
    static constexpr int VECS = HD / E;                    // vectors per row
    static constexpr int TPR = VECS < 32 ? VECS : 32;      // threads per row (a row never spans warps)
    static constexpr int VPT = VECS / TPR;                 // vectors per thread (1, or 2 for f32 hd256)
    static constexpr int EPT = VPT * E;                    // elements per thread
    static constexpr int GROUPS = SA_THREADS / TPR;        // rows a block works on at once
    static_assert(HD % E == 0 && VECS % TPR == 0, "head_dim must be a multiple of the vector width");
    static_assert(!SaKind<KIND>::QUANT || HD % 32 == 0, "quantized rows hold whole blocks of 32");
};

// Unpack one vector of storage KIND into float lanes out[0 .. E).
// Quantized values become floats without an int-to-float conversion: the byte u (q8_0's int8 q offset
// by 128, or q4_0's nibble) is written under the exponent bits of 2^23, giving the float 2^23 + u exactly,
// and 2^23 + 128 (q8_0) or 2^23 + 8 (q4_0) is subtracted, exactly: the same float q as (float)q, so the
// same bits. Conversions (I2F) issue at 16 per clock per SM on sm_80/sm_90, against 64 for the bit
// operations and 128 for float adds and multiplies (CUDA C++ Programming Guide, "Arithmetic
// Instructions" throughput table): at two per K/V value pair they, not the memory, would bound the
// quantized decode loop on an H100 (the estimate: docs/perf/2026-12-05.md).
template <int KIND> __device__ __forceinline__ void sa_unpack(const SaRaw r, float* out) {
    const unsigned w[4] = {r.u.x, r.u.y, r.u.z, r.u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        if (KIND >= 3) {  // four values a word: int8 (q8_0) or a nibble in 0..15 (q4_0), times the scale
            const unsigned u = KIND == 3 ? w[i] ^ 0x80808080u : w[i];          // q8_0: q + 128 per byte
            const float bias = KIND == 3 ? 8388736.0f : 8388616.0f;          // 2^23 + 128, 2^23 + 8
#pragma unroll
            for (int j = 0; j < 4; ++j)
                out[4 * i + j] = (__uint_as_float(0x4B000000u | ((u >> (8 * j)) & 0xffu)) - bias) * r.d;
        } else if (KIND == 0) {
            out[i] = __uint_as_float(w[i]);
        } else if (KIND == 1) {
            out[2 * i] = sa_half_to_float((unsigned short)(w[i] & 0xffffu));
            out[2 * i + 1] = sa_half_to_float((unsigned short)(w[i] >> 16));
        } else {
            out[2 * i] = __uint_as_float(w[i] << 16);  // bf16 is the top half of a float32
            out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
}

// The vector of values elem .. elem + E of a [.., HD] cache (elem a multiple of E). Quantized rows are
// HD / 32 blocks; a block is only 2-byte aligned (34 and 18 bytes), so its half is read as 16-bit words.
template <int KIND, int HD> __device__ __forceinline__ SaRaw sa_load16(const void* base, long long elem) {
    SaRaw r;
    if (SaKind<KIND>::QUANT) {
        const int c = (int)(elem % HD);
        const unsigned short* s = reinterpret_cast<const unsigned short*>(
            reinterpret_cast<const char*>(base) + (elem / HD) * (HD / 32 * SaKind<KIND>::BLOCK) +
            (c / 32) * SaKind<KIND>::BLOCK);
        r.d = sa_half_to_float(s[0]);
        const unsigned short* qs = s + 1 + (KIND == 3 ? (c % 32) / 2 : 0);  // q8_0: this half's 16 bytes
        const int shift = KIND == 4 && c % 32 >= 16 ? 4 : 0;                 // q4_0: high nibbles for 16..31
        unsigned w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            w[i] = (unsigned)qs[2 * i] | ((unsigned)qs[2 * i + 1] << 16);
            if (KIND == 4) w[i] = (w[i] >> shift) & 0x0f0f0f0fu;
        }
        r.u = make_uint4(w[0], w[1], w[2], w[3]);
        return r;
    }
    r.u = *reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(base) + elem * SaKind<KIND>::BYTES);
    r.d = 0.0f;
    return r;
}

// V of another storage kind than K (VKIND != KIND): a thread reads V's elements at K's positions, N = K's
// vector width at a time (N a multiple of 4, elem a multiple of N). Where V's vectors are wider than N
// (K float16, V q8_0) a thread loads the whole vector that holds its N elements and keeps that part;
// where they are narrower (K q8_0, V float16) it loads N / E of them. With VKIND == KIND (N == E) this is
// one sa_load16 + sa_unpack, the code of the one-kind kernels.
template <int VKIND, int N> struct SaPart {
    static constexpr int EV = SaKind<VKIND>::E;
    static constexpr int COUNT = N >= EV ? N / EV : 1;     // vectors loaded per N elements
};

template <int VKIND, int HD, int N> __device__ __forceinline__ void sa_load_part(const void* base, long long elem,
                                                                                 SaRaw* raw) {
    constexpr int EV = SaPart<VKIND, N>::EV;
    if constexpr (N >= EV) {
#pragma unroll
        for (int i = 0; i < N / EV; ++i) raw[i] = sa_load16<VKIND, HD>(base, elem + i * EV);
    } else {
        raw[0] = sa_load16<VKIND, HD>(base, elem - elem % EV);
    }
}

// Unpack what sa_load_part loaded into out[0 .. N); off = elem % (V's vector width), 0 when N >= it.
template <int VKIND, int N> __device__ __forceinline__ void sa_unpack_part(const SaRaw* raw, int off, float* out) {
    constexpr int EV = SaPart<VKIND, N>::EV;
    if constexpr (N >= EV) {
#pragma unroll
        for (int i = 0; i < N / EV; ++i) sa_unpack<VKIND>(raw[i], out + i * EV);
    } else {
        float t[EV];
        sa_unpack<VKIND>(raw[0], t);
#pragma unroll
        for (int o = 0; o < EV; o += N)   // constant indices only: t stays in registers
            if (off == o) {
#pragma unroll
                for (int e = 0; e < N; ++e) out[e] = t[o + e];
            }
    }
}

// The key positions a launch row may see, as one list of n indices i: positions [0, n_sink) (sinks),
// then [lo, lo + n - n_sink) (the window, or everything for causal). For a chunk whose first query
// sits at first_q, this is the union over the chunk; per-query masks trim it (sa_visible).
// In window mode all these positions sit in distinct ring slots, because the ring holds
// slots - sinks >= window + chunk - 1 positions (the C - 1 slack of docs/DESIGN.md §3).
struct SaKeys { int n_sink; int lo; int n; };

__device__ __forceinline__ SaKeys sa_keys(int length, int first_q, int window, int sinks) {
    SaKeys r;
    if (window == 0) {  // causal: every written position [0, length)
        r.n_sink = 0; r.lo = 0; r.n = length;
        return r;
    }
    r.n_sink = min(sinks, length);
    r.lo = max(first_q - window + 1, sinks);
    r.n = r.n_sink + max(length - r.lo, 0);
    return r;
}

__device__ __forceinline__ int sa_key_pos(const SaKeys& r, int i) {
    return i < r.n_sink ? i : r.lo + (i - r.n_sink);
}

// Slot of absolute position pos: causal slot = pos; sinks keep slots [0, sinks); the rest is a ring.
__device__ __forceinline__ int sa_slot(int pos, int window, int sinks, int slots) {
    if (window == 0 || pos < sinks) return pos;
    return sinks + (pos - sinks) % (slots - sinks);
}

// May the query at position qpos see the key at position pos? (docs/DESIGN.md §1 table.)
__device__ __forceinline__ bool sa_visible(int pos, int qpos, int window, int sinks) {
    return pos <= qpos && (window == 0 || pos < sinks || pos > qpos - window);
}

// Attention logit soft-capping: c * tanh(s / c), given c and inv_c = 1 / c. With s and c both in log2
// units (times log2 e) this is the natural-log map times log2 e, since c * tanh(s / c) is homogeneous of
// degree one in (s, c). tanh(t) for t = |s| / c: below 1/8 its Taylor series to t^7 (next term < 2e-10),
// else (1 - e) / (1 + e) with e = exp(-2t) by exp2f (few ulp relative: 1 - e >= 0.22 there), signed.
// Few registers and no call: tanhf, expm1f or an IEEE division in the decode loop made the decode
// kernels spill 4-16 bytes on sm_80 (their slow paths are calls); inv_c is computed once, before it.
__device__ __forceinline__ float sa_soft_cap(float s, float c, float inv_c) {
    const float t = fabsf(s * inv_c), t2 = t * t;
    const float series = t * (1.0f + t2 * (-1.0f / 3.0f + t2 * (2.0f / 15.0f + t2 * (-17.0f / 315.0f))));
    const float e = exp2f(-2.0f * 1.4426950408889634f * t);
    const float tanh_t = t < 0.125f ? series : __fdividef(1.0f - e, 1.0f + e);  // 1 + e in (1, 2]
    return copysignf(c * tanh_t, s);
}

template <typename T> __device__ __forceinline__ T sa_warp_sum(T x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    return x;
}

template <typename T> __device__ __forceinline__ T sa_warp_max(T x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
    return x;
}

#endif  // STREAMATTN_COMMON_CUH
