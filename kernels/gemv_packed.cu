// gemv_packed.cu: y = W x for decode, W read in GGUF's own block layout straight from the file's bytes.
//
// Grid (ceil(rows / SA_GEMV_WARPS), ceil(batch / NB)), SA_GEMV_THREADS threads. Each warp owns one
// output row and up to NB input vectors (x rows b0 .. b0 + NB of the batch). A row is cut into pieces
// of PIECE values (a few bytes of one block, see SaGemvType); lane l takes pieces l, l + 32, ..., so
// the warp's loads of one step cover a contiguous stretch of the row. A piece is dequantized once into
// float32 registers and multiplied into every x vector of the launch; each lane keeps one float32 sum per
// vector, and a warp sum at the end gives y. The weight bytes are read once per launch whatever NB is
// (up to 16): a decode step of a batch reads each matrix once.
//
// Layouts (llama.cpp ggml-common.h; gguf-py gguf/quants.py dequantizes the same bytes, the tests'
// oracle). TYPE is GGML's type id (gguf-py GGMLQuantizationType):
//   Q4_0  (2): 32 values, 18 bytes: d (f16), 16 bytes; value j < 16 in byte j's low nibble, j + 16 in its
//              high one; w = (q - 8) d
//   Q4_1  (3): 32 values, 20 bytes: d, m (f16), 16 bytes as Q4_0; w = q d + m
//   Q5_0  (6): 32 values, 22 bytes: d (f16), 4 bytes qh (bit j: the fifth bit of value j), 16 bytes as
//              Q4_0; w = (q - 16) d
//   Q8_0  (8): 32 values, 34 bytes: d (f16), 32 int8; w = q d
//   Q4_K (12): 256 values, 144 bytes: d, dmin (f16), 12 bytes of eight 6-bit (scale, min) pairs, 128
//              bytes: chunk c (32 bytes) holds sub-block 2c in its low nibbles, 2c + 1 in its high ones;
//              w = d sc q - dmin m
//   Q5_K (13): 256 values, 176 bytes: d, dmin, 12 scale bytes as Q4_K, 32 bytes qh (bit s of byte j: the
//              fifth bit of value j of sub-block s), 128 bytes as Q4_K; q = nibble + 16 bit
//   Q6_K (14): 256 values, 210 bytes: 128 bytes ql, 64 bytes qh, 16 int8 scales (one per 16 values),
//              d (f16); half h, value r < 128: low nibble of ql[64h + r % 64] (high for r >= 64), bits
//              2 (r / 32) of qh[32h + r % 32] above it; w = d sc (q - 32)
// Blocks of 18, 22, 34 and 210 bytes are only 2-byte aligned in a row: they are read as 16-bit words.
//
// Integers become floats by the exponent trick of sa_unpack (streamattn_common.cuh): a byte u under the
// exponent bits of 2^23 is the float 2^23 + u, and subtracting 2^23 (+ an offset) is exact; the int-to-
// float conversion it avoids issues 4x slower than the memory delivers Q4 values on an H100.
#include "streamattn_common.cuh"

#ifndef SA_GEMV_THREADS
#define SA_GEMV_THREADS 128  // 4 warps: 4 output rows per block
#endif
#define SA_GEMV_WARPS (SA_GEMV_THREADS / 32)

// GGML type ids (ggml.h enum ggml_type)
#define SA_GGML_Q4_0 2
#define SA_GGML_Q4_1 3
#define SA_GGML_Q5_0 6
#define SA_GGML_Q8_0 8
#define SA_GGML_Q4_K 12
#define SA_GGML_Q5_K 13
#define SA_GGML_Q6_K 14

// Per type: values and bytes per block, values per piece (what one lane dequantizes at a time).
template <int TYPE> struct SaGemvType;
template <> struct SaGemvType<SA_GGML_Q4_0> { static constexpr int VALUES = 32, BYTES = 18, PIECE = 8; };
template <> struct SaGemvType<SA_GGML_Q4_1> { static constexpr int VALUES = 32, BYTES = 20, PIECE = 8; };
template <> struct SaGemvType<SA_GGML_Q5_0> { static constexpr int VALUES = 32, BYTES = 22, PIECE = 8; };
template <> struct SaGemvType<SA_GGML_Q8_0> { static constexpr int VALUES = 32, BYTES = 34, PIECE = 8; };
template <> struct SaGemvType<SA_GGML_Q4_K> { static constexpr int VALUES = 256, BYTES = 144, PIECE = 16; };
template <> struct SaGemvType<SA_GGML_Q5_K> { static constexpr int VALUES = 256, BYTES = 176, PIECE = 16; };
template <> struct SaGemvType<SA_GGML_Q6_K> { static constexpr int VALUES = 256, BYTES = 210, PIECE = 16; };

// The float u - bias for an integer 0 <= u < 2^23, exactly, without a conversion (bias = 2^23 + offset).
__device__ __forceinline__ float sa_int_float(unsigned u, float bias) {
    return __uint_as_float(0x4B000000u | u) - bias;
}
#define SA_TWO23 8388608.0f

// The 32-bit word of bytes [2i, 2i + 4) of a 2-byte aligned block.
__device__ __forceinline__ unsigned sa_word16(const unsigned short* h, int i) {
    return (unsigned)h[i] | ((unsigned)h[i + 1] << 16);
}

// Byte k (0..11) of the K-quants' scale bytes, held as three words.
__device__ __forceinline__ unsigned sa_kbyte(unsigned s0, unsigned s1, unsigned s2, int k) {
    const unsigned w = k < 4 ? s0 : (k < 8 ? s1 : s2);
    return (w >> (8 * (k & 3))) & 0xffu;
}

// Sub-block j's 6-bit scale and min of a Q4_K / Q5_K block (gguf-py Q4_K.get_scale_min): j < 4 keeps
// the low 6 bits of bytes j and j + 4; j >= 4 takes 4 bits from byte j + 4 and the top 2 of bytes j - 4
// (scale) and j (min).
__device__ __forceinline__ void sa_kscale(unsigned s0, unsigned s1, unsigned s2, int j, float& sc, float& mn) {
    unsigned a, m;
    if (j < 4) {
        a = sa_kbyte(s0, s1, s2, j) & 63u;
        m = sa_kbyte(s0, s1, s2, j + 4) & 63u;
    } else {
        a = (sa_kbyte(s0, s1, s2, j + 4) & 15u) | ((sa_kbyte(s0, s1, s2, j - 4) >> 6) << 4);
        m = (sa_kbyte(s0, s1, s2, j + 4) >> 4) | ((sa_kbyte(s0, s1, s2, j) >> 6) << 4);
    }
    sc = sa_int_float(a, SA_TWO23);
    mn = sa_int_float(m, SA_TWO23);
}

// Dequantize piece p of block blk into w[0 .. PIECE), in groups of 4 consecutive columns: group g sits
// at columns off[g] .. off[g] + 4 of the block.
template <int TYPE>
__device__ __forceinline__ void sa_gemv_piece(const unsigned char* blk, int p, float* w, int* off) {
    if constexpr (TYPE == SA_GGML_Q8_0) {  // piece p: values 8p .. 8p + 8
        const unsigned short* h = reinterpret_cast<const unsigned short*>(blk);
        const float d = sa_half_to_float(h[0]);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const unsigned u = sa_word16(h, 1 + 4 * p + 2 * i) ^ 0x80808080u;  // int8 q -> q + 128
#pragma unroll
            for (int e = 0; e < 4; ++e) w[4 * i + e] = sa_int_float((u >> (8 * e)) & 0xffu, SA_TWO23 + 128.0f) * d;
            off[i] = 8 * p + 4 * i;
        }
    } else if constexpr (TYPE == SA_GGML_Q4_0 || TYPE == SA_GGML_Q4_1 || TYPE == SA_GGML_Q5_0) {
        // nibble bytes 4p .. 4p + 4: values 4p .. 4p + 4 (low nibbles) and 16 + 4p .. (high)
        const unsigned short* h = reinterpret_cast<const unsigned short*>(blk);
        const float d = sa_half_to_float(h[0]);
        const float m = TYPE == SA_GGML_Q4_1 ? sa_half_to_float(h[1]) : 0.0f;  // Q4_1's min
        const float bias = TYPE == SA_GGML_Q4_0 ? SA_TWO23 + 8.0f : (TYPE == SA_GGML_Q5_0 ? SA_TWO23 + 16.0f : SA_TWO23);
        const unsigned u = TYPE == SA_GGML_Q4_1 ? reinterpret_cast<const unsigned*>(blk)[1 + p]
                                                 : sa_word16(h, (TYPE == SA_GGML_Q5_0 ? 3 : 1) + 2 * p);
        const unsigned qh = TYPE == SA_GGML_Q5_0 ? sa_word16(h, 1) : 0u;  // Q5_0: the 32 fifth bits
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const unsigned fifth = ((qh >> (16 * half + 4 * p + e)) & 1u) << 4;
                w[4 * half + e] = sa_int_float(((u >> (8 * e + 4 * half)) & 15u) | fifth, bias) * d;
                if constexpr (TYPE == SA_GGML_Q4_1) w[4 * half + e] += m;  // not + 0 elsewhere: -0 stays -0
            }
            off[half] = 16 * half + 4 * p;
        }
    } else if constexpr (TYPE == SA_GGML_Q4_K || TYPE == SA_GGML_Q5_K) {
        // piece p: chunk c = p / 4, bytes o .. o + 8 of it (o = 8 (p % 4)): 8 values of sub-block 2c
        // (low nibbles) and 8 of sub-block 2c + 1 (high nibbles), both at positions o .. o + 8
        constexpr int QS = TYPE == SA_GGML_Q4_K ? 4 : 12;  // first word of the 128 nibble bytes
        const unsigned* u = reinterpret_cast<const unsigned*>(blk);  // 144 / 176-byte blocks: 16-aligned
        const int c = p / 4, o = 8 * (p % 4);
        const float d = sa_half_to_float((unsigned short)(u[0] & 0xffffu));
        const float dmin = sa_half_to_float((unsigned short)(u[0] >> 16));
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            float sc, mn;
            sa_kscale(u[1], u[2], u[3], 2 * c + s, sc, mn);
            const float a = d * sc, b = dmin * mn;  // exact: an 11-bit float16 times a 6-bit integer
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const unsigned q = (u[QS + 8 * c + o / 4 + i] >> (4 * s)) & 0x0f0f0f0fu;
                unsigned hi = 0u;  // Q5_K: the fifth bits of these 4 values, at bit 4 of each byte
                if constexpr (TYPE == SA_GGML_Q5_K) hi = ((u[4 + o / 4 + i] >> (2 * c + s)) & 0x01010101u) << 4;
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    w[8 * s + 4 * i + e] = sa_int_float(((q | hi) >> (8 * e)) & 0xffu, SA_TWO23) * a - b;
                off[2 * s + i] = 32 * (2 * c + s) + o + 4 * i;
            }
        }
    } else {  // Q6_K: piece p: half h = p / 8, l = 4 (p % 8): values 128h + 32t + l .. + 4 for t = 0..3
        static_assert(TYPE == SA_GGML_Q6_K, "no piece for this GGML type");
        const unsigned short* s = reinterpret_cast<const unsigned short*>(blk);
        const int h = p / 8, l = 4 * (p % 8);
        const unsigned ql0 = sa_word16(s, (64 * h + l) / 2);       // values t = 0 (low), t = 2 (high)
        const unsigned ql1 = sa_word16(s, (64 * h + l + 32) / 2);  // values t = 1 (low), t = 3 (high)
        const unsigned qh = sa_word16(s, (128 + 32 * h + l) / 2);  // bits 2t: value t's top two bits
        // the 8 scale bytes of this half (192 + 8h ..), of which t uses byte l / 16 + 2t
        const unsigned sc_lo = sa_word16(s, (192 + 8 * h) / 2), sc_hi = sa_word16(s, (196 + 8 * h) / 2);
        const float d = sa_half_to_float(s[104]);  // byte 208
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const unsigned sc = ((t < 2 ? sc_lo : sc_hi) >> (8 * (l / 16 + 2 * (t & 1)))) & 0xffu;
            const float a = d * sa_int_float(sc ^ 0x80u, SA_TWO23 + 128.0f);  // int8 scale, exact product
            const unsigned lo = ((t & 1 ? ql1 : ql0) >> (t < 2 ? 0 : 4)) & 0x0f0f0f0fu;
            const unsigned q = lo | (((qh >> (2 * t)) & 0x03030303u) << 4);
#pragma unroll
            for (int e = 0; e < 4; ++e) w[4 * t + e] = sa_int_float((q >> (8 * e)) & 0xffu, SA_TWO23 + 32.0f) * a;
            off[t] = 128 * h + 32 * t + l;
        }
    }
}

template <int TYPE, int NB>
__global__ void __launch_bounds__(SA_GEMV_THREADS) sa_gemv(
    const unsigned char* __restrict__ weight,  // [rows, cols / VALUES * BYTES] the file's blocks, 16-aligned
    const float* __restrict__ x,               // [batch, cols] float32, 16-aligned
    float* __restrict__ y,                     // [batch, rows]
    int rows, int cols, int batch) {
    using T = SaGemvType<TYPE>;
    constexpr int PIECES = T::VALUES / T::PIECE;  // pieces per block
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x * SA_GEMV_WARPS + threadIdx.x / 32;
    const int b0 = blockIdx.y * NB;
    const int nb = min(NB, batch - b0);  // x vectors of this launch row
    if (row >= rows) return;             // the whole warp: no shuffle below is left half-reached
    const int blocks = cols / T::VALUES;
    const unsigned char* wrow = weight + (long long)row * blocks * T::BYTES;

    float acc[NB];
#pragma unroll
    for (int b = 0; b < NB; ++b) acc[b] = 0.0f;
    for (int j = lane; j < blocks * PIECES; j += 32) {
        const int blk = j / PIECES;
        float w[T::PIECE];
        int off[T::PIECE / 4];
        sa_gemv_piece<TYPE>(wrow + (long long)blk * T::BYTES, j % PIECES, w, off);
        const float* xb = x + (long long)b0 * cols + (long long)blk * T::VALUES;
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            if (b < nb) {
#pragma unroll
                for (int g = 0; g < T::PIECE / 4; ++g) {
                    const uint4 v = *reinterpret_cast<const uint4*>(xb + (long long)b * cols + off[g]);
                    acc[b] += w[4 * g] * __uint_as_float(v.x) + w[4 * g + 1] * __uint_as_float(v.y) +
                              w[4 * g + 2] * __uint_as_float(v.z) + w[4 * g + 3] * __uint_as_float(v.w);
                }
            }
        }
    }
#pragma unroll
    for (int b = 0; b < NB; ++b) {
        const float sum = sa_warp_sum(acc[b]);
        if (lane == 0 && b < nb) y[(long long)(b0 + b) * rows + row] = sum;
    }
}
