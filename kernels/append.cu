// append.cu: write one step's K and V rows into the ring slots, cast or quantized as the cache stores them.
//
// Grid (T, kv_heads, batch) x HD threads: block (t, h, b) writes row t of sequence b's kv head h when
// t < counts[b] (padding rows write nothing), at the slot of position lengths[b] + t. Thread i holds
// element i of the row; warp w holds the row's quantization block w (HD is a multiple of 32).
//
// The bytes equal those of the CPU cast (streamattn/kv/storage.py: numpy's float16, to_storage's
// bfloat16 rounding, quantize_rows' q8_0 / q4_0 blocks) and, with rotate_k, of rotation.rotate_rows
// (float64 butterflies in the CPU's order, one scale by 1/sqrt(32), one rounding to float32). Products
// are written __fmul_rn / __fadd_rn so the compiler never fuses them into an FMA the CPU does not do.
// One exception, on a device only: the device flushes float32 subnormals to zero (CuPy compiles with
// -ftz=true), so a block whose values lie below 2^-126 may round otherwise.
//
// Before writing, the block copies the slot's old bytes to undo_k / undo_v [batch, kv_heads, T, width],
// so a step that turns out non-finite can be rolled back exactly (a window ring overwrites a position
// that is still held). A row that is NaN or inf as stored (float kinds: an element; quantized kinds: a
// block's float16 scale) lowers *flag to code_base + b (K) or code_base + batch + b (V) by atomicMin:
// the first K row, else the first V row, as the CPU check reports it; the caller reads the flag once a
// step.
//
// Sinks apart (sink_kind 0 float32 / 1 float16; -1: none): a row at position < sinks goes to row pos of
// sink_k / sink_v [batch, kv_heads, sinks, HD] in that kind (keys rotated as the ring's), and the ring's
// slot of position pos >= sinks is (pos - sinks) mod ring. As on the CPU, every row is checked as
// quantized too (a sink row's quantized bytes go to its undo row, which it does not otherwise use), and
// a sink row NaN or inf in the sink kind lowers the flag to code_base + 2 batch + b (K) or + 3 batch + b
// (V).
//
// A fed q4_0 V (fed_v = 1, v_fed = U [kv_heads, HD, HD]): the row's codes are then chosen again in order
// with each one's error pushed forward through U (storage.quantize_rows_fed, sa_fed_q4), the same bytes.
#include "streamattn_common.cuh"

#ifdef STREAMATTN_EMULATION
#define SA_FMUL(a, b) ((a) * (b))
#define SA_FADD(a, b) ((a) + (b))
#else
#define SA_FMUL(a, b) __fmul_rn(a, b)
#define SA_FADD(a, b) __fadd_rn(a, b)
#endif

// float32 -> float16 bits, rounded to nearest even, overflow to inf, NaN kept NaN (numpy's astype rule).
__device__ __forceinline__ unsigned short sa_float_to_half(float f) {
    const unsigned x = __float_as_uint(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) {                                      // NaN: the top mantissa bits, never inf
        const unsigned m = ax >> 13 & 0x3ffu;
        return (unsigned short)(sign | 0x7c00u | (m ? m : 1u));
    }
    if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  // >= 65520 rounds to inf (or is inf)
    if (ax >= 0x38800000u)                                           // a normal float16 (>= 2^-14)
        return (unsigned short)(sign | ((ax + 0xfffu + (ax >> 13 & 1u) - 0x38000000u) >> 13));
    return (unsigned short)(sign | (unsigned)rintf(__uint_as_float(ax) * 16777216.0f));  // units of 2^-24
}

// Over the warp's 32 values (one per lane): a = the largest |x| among the finite ones, xm = the first
// value (lowest lane) of that magnitude, as gguf's quantizer scans a block; returns 1 when all are finite.
__device__ __forceinline__ int sa_first_max(float x, int lane, float& a, float& xm) {
    int finite = isfinite(x) ? 1 : 0;
    a = finite ? fabsf(x) : 0.0f;
    int at = lane;
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        finite &= __shfl_xor_sync(0xffffffffu, finite, off);
        const float oa = __shfl_xor_sync(0xffffffffu, a, off);
        const int oat = __shfl_xor_sync(0xffffffffu, at, off);
        if (oa > a || (oa == a && oat < at)) { a = oa; at = oat; }
    }
    xm = __shfl_xor_sync(0xffffffffu, x, lane ^ at);   // the value at lane `at`
    return finite;
}

template <int KIND> struct SaStore {
    static constexpr int WIDTH(int hd) {
        return KIND == 0 ? 4 * hd : KIND <= 2 ? 2 * hd : hd / 32 * SaKind<KIND>::BLOCK;
    }
};

// Row x (lane i of warp w holds element 32 w + i) into row bytes out of storage KIND; returns true when
// the stored row is NaN or inf somewhere (for the quantized kinds: a block's scale).
template <int KIND> __device__ __forceinline__ bool sa_store_row(float x, unsigned char* out, int tid) {
    if (KIND == 0) {
        const unsigned u = __float_as_uint(x);
        reinterpret_cast<unsigned*>(out)[tid] = u;
        return (u & 0x7f800000u) == 0x7f800000u;
    }
    if (KIND == 1) {
        const unsigned short h = sa_float_to_half(x);
        reinterpret_cast<unsigned short*>(out)[tid] = h;
        return (h & 0x7c00u) == 0x7c00u;
    }
    if (KIND == 2) {
        const unsigned u = __float_as_uint(x);
        // to_storage's rule: nearest even, and a NaN kept NaN (quiet, signed); the rounding carry would turn
        // 0x7fffffff, the NaN every float op here produces, into 0x8000 (-0.0) and pass the finite check
        const unsigned short h = (u & 0x7fffffffu) > 0x7f800000u
            ? (unsigned short)((u >> 16) | 0x40u)
            : (unsigned short)((u + ((u >> 16) & 1u) + 0x7fffu) >> 16);
        reinterpret_cast<unsigned short*>(out)[tid] = h;
        return (h & 0x7f80u) == 0x7f80u;
    }
    // q8_0 / q4_0: warp = block; the scale from the first value of largest magnitude (quantize_rows)
    const int lane = tid & 31;
    unsigned char* blk = out + (tid >> 5) * SaKind<KIND>::BLOCK;
    float a, xm_any;
    const int finite = sa_first_max(x, lane, a, xm_any);
    if (!finite) {                                  // the NaN marker: scale 0x7E00, quants 0 (q8_0) / 8 (q4_0)
        if (lane == 0) { blk[0] = 0x00; blk[1] = 0x7e; }
        if (KIND == 3) blk[2 + lane] = 0;
        else if (lane < 16) blk[2 + lane] = 0x88;
        return true;
    }
    const float xm = a > 0.0f ? xm_any : 0.0f;      // gguf's running max starts at +0
    const float d = KIND == 3 ? a / 127.0f : xm / -8.0f;
    const float inv = d == 0.0f ? 0.0f : 1.0f / d;
    const unsigned short h = sa_float_to_half(d);
    if (lane == 0) { blk[0] = (unsigned char)(h & 0xffu); blk[1] = (unsigned char)(h >> 8); }
    if (KIND == 3) {
        blk[2 + lane] = (unsigned char)((int)roundf(SA_FMUL(x, inv)) & 0xff);
    } else {
        const float c = fminf(15.0f, fmaxf(0.0f, floorf(SA_FADD(SA_FMUL(x, inv), 8.5f))));
        const float hi = __shfl_xor_sync(0xffffffffu, c, 16);       // lane j < 16 packs j and j + 16
        if (lane < 16) blk[2 + lane] = (unsigned char)((unsigned)c | ((unsigned)hi << 4));
    }
    return (h & 0x7c00u) == 0x7c00u;
}

#ifdef STREAMATTN_EMULATION
#define SA_DMUL(a, b) ((a) * (b))
#define SA_DSUB(a, b) ((a) - (b))
#define SA_DDIV(a, b) ((a) / (b))
#else
#define SA_DMUL(a, b) __dmul_rn(a, b)
#define SA_DSUB(a, b) __dsub_rn(a, b)
#define SA_DDIV(a, b) __ddiv_rn(a, b)
#endif

// A q4_0 row's codes chosen again in order, element 0 first, each one's rounding error pushed onto the
// elements not yet rounded through U [HD, HD] (float64): storage.quantize_rows_fed, after sa_store_row<4>
// wrote gguf's blocks to out. Thread tid owns element tid's running value w; one element a round, its
// error broadcast through shared memory. Rows with a scale not finite keep gguf's bytes.
template <int HD> __device__ __forceinline__ void sa_fed_q4(float x, unsigned char* out, const double* U, int tid) {
    __shared__ double s_e;
    const int lane = tid & 31;
    float a, xm_any;                               // gguf's scale of this block before float16, as written
    sa_first_max(x, lane, a, xm_any);
    const float d = (a > 0.0f ? xm_any : 0.0f) / -8.0f;
    const float inv = d == 0.0f ? 0.0f : 1.0f / d;
    __syncthreads();                                // every block's scale written (sa_store_row)
    bool ok = true;
    for (int b = 0; b < HD / 32; ++b) ok = ok && (out[18 * b + 1] & 0x7c) != 0x7c;
    if (!ok) return;                                // the same for every thread: no barrier skipped
    const unsigned char* blk = out + 18 * (tid >> 5);
    const double dq = (double)sa_half_to_float((unsigned short)(blk[0] | (blk[1] << 8)));
    double w = (double)x;
    for (int i = 0; i < HD; ++i) {
        if (tid == i) {
            const int c = (int)fminf(15.0f, fmaxf(0.0f, floorf(SA_FADD(SA_FMUL((float)w, inv), 8.5f))));
            unsigned char* byte = out + 18 * (i >> 5) + 2 + (i & 15);
            *byte = (i & 31) < 16 ? (unsigned char)((*byte & 0xf0) | c)
                                  : (unsigned char)((*byte & 0x0f) | (c << 4));
            s_e = SA_DSUB(w, SA_DMUL(dq, (double)(c - 8)));      // the error, before / U[i, i]
        }
        __syncthreads();
        const double e = SA_DDIV(s_e, U[(long long)i * HD + i]);  // every thread the same quotient
        if (tid > i) w = SA_DSUB(w, SA_DMUL(e, U[(long long)i * HD + tid]));
        __syncthreads();                            // s_e read by all before the next element sets it
    }
}

// x @ H over this warp's 32 values (streamattn/kv/rotation.py): butterflies (a + b, a - b) in float64,
// halves first, then the scale by 1/sqrt(32), one rounding.
__device__ __forceinline__ float sa_rotate32(float x, int lane) {
    double y = (double)x;
#pragma unroll
    for (int h = 16; h >= 1; h >>= 1) {
        const double other = __shfl_xor_sync(0xffffffffu, y, h);
        y = (lane & h) ? other - y : y + other;     // lane j (bit h clear) holds a, lane j + h holds b
    }
    return (float)(y * (1.0 / sqrt(32.0)));
}

template <int KIND, int VKIND, int HD>
__global__ void __launch_bounds__(HD) sa_append(
    const float* __restrict__ k_in,        // [batch, kv_heads, T, HD]
    const float* __restrict__ v_in,        // [batch, kv_heads, T, HD]
    unsigned char* __restrict__ k_store,   // [batch, kv_heads, slots, k width bytes]
    unsigned char* __restrict__ v_store,   // [batch, kv_heads, slots, v width bytes]
    unsigned char* __restrict__ undo_k,    // [batch, kv_heads, T, k width bytes]: the slots' old bytes
    unsigned char* __restrict__ undo_v,    // [batch, kv_heads, T, v width bytes]
    const int* __restrict__ lengths,       // [batch] tokens before this step
    const int* __restrict__ counts,        // [batch] real rows of this step
    int* __restrict__ flag,                // [1] lowest code of a non-finite row (INT_MAX: none)
    unsigned char* __restrict__ sink_k,    // [batch, kv_heads, sinks, HD] of sink_kind, or unused
    unsigned char* __restrict__ sink_v,
    const double* __restrict__ v_fed,      // [kv_heads, HD, HD] U of a fed q4_0 V (fed_v = 1), or unused
    int kv_heads, int T, int slots, int sinks, int ring, int rotate_k, int code_base, int sink_kind,
    int fed_v) {
    constexpr int KW = SaStore<KIND>::WIDTH(HD), VW = SaStore<VKIND>::WIDTH(HD);
    const int t = blockIdx.x, h = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
    if (t >= counts[b]) return;                     // the whole block: a padding row
    const int pos = lengths[b] + t, batch = (int)gridDim.z;
    const bool to_sink = sink_kind >= 0 && pos < sinks;                      // a sink row, kept apart
    const long long slot = sink_kind >= 0 ? (to_sink ? 0 : (pos - sinks) % ring)
                                          : (pos < sinks ? pos : sinks + (pos - sinks) % ring);
    const long long row = ((long long)b * kv_heads + h) * slots + slot;      // the slot's row
    const long long in = (((long long)b * kv_heads + h) * T + t);             // the chunk's row
    unsigned char* ks = to_sink ? undo_k + in * KW : k_store + row * KW;     // a sink row: checked only
    unsigned char* vs = to_sink ? undo_v + in * VW : v_store + row * VW;
    if (!to_sink) {
        for (int i = tid; i < KW; i += HD) undo_k[in * KW + i] = ks[i];
        for (int i = tid; i < VW; i += HD) undo_v[in * VW + i] = vs[i];
    }
    __syncthreads();                                // every old byte saved before any is overwritten
    float x = k_in[in * HD + tid];
    const float y = v_in[in * HD + tid];
    if (rotate_k) x = sa_rotate32(x, tid & 31);
    if (sa_store_row<KIND>(x, ks, tid)) atomicMin(flag, code_base + b);
    if (sa_store_row<VKIND>(y, vs, tid)) atomicMin(flag, code_base + batch + b);
    if constexpr (VKIND == 4) {
        if (fed_v) sa_fed_q4<HD>(y, vs, v_fed + (long long)h * HD * HD, tid);
    }
    if (to_sink) {
        const long long srow = ((long long)b * kv_heads + h) * sinks + pos;  // [b, h, pos]
        const bool bad_k = sink_kind == 1 ? sa_store_row<1>(x, sink_k + srow * 2 * HD, tid)
                                          : sa_store_row<0>(x, sink_k + srow * 4 * HD, tid);
        const bool bad_v = sink_kind == 1 ? sa_store_row<1>(y, sink_v + srow * 2 * HD, tid)
                                          : sa_store_row<0>(y, sink_v + srow * 4 * HD, tid);
        if (bad_k) atomicMin(flag, code_base + 2 * batch + b);
        if (bad_v) atomicMin(flag, code_base + 3 * batch + b);
    }
}
