// embed.cu: the embedding rows of a step's tokens, dequantized from GGUF blocks on the device.
//
// Grid (n, ceil(pieces of a row / SA_EMBED_THREADS)), SA_EMBED_THREADS threads. Block (i, c) writes row i
// of the output: token ids[i]'s row of the matrix, read in the file's blocks, times `scale` (the model's
// embedding scale, 1 for most). Thread t of chunk c dequantizes piece c * SA_EMBED_THREADS + t of the row
// with gemv_packed.cu's sa_gemv_piece (the same bytes -> floats the matmuls use) and stores its values.
//
// Every dequantized value is one rounding of an exact product, as gguf-py computes it (gguf/quants.py):
// d q, d q + m, (d sc) q - dmin m; the products of a float16 scale and small integers fit float32's 24
// bits, so any order (FMA contraction included) gives gguf.quants.dequantize's float32 bits; times the
// scale is one more rounding, as the CPU's `x * float32(scale)`. Nonzero values are at least 2^-24 in
// magnitude, far above float32's subnormals, so -ftz changes nothing for a scale >= 2^-100.
//
// An id outside [0, rows) writes a row of NaN: ids come from the device, so the kernel cannot raise,
// and a NaN row reaches the step's finite flag (the K/V append's), which rolls the step back.
#include "gemv_packed.cu"

#ifndef SA_EMBED_THREADS
#define SA_EMBED_THREADS 128
#endif

template <int TYPE>
__global__ void __launch_bounds__(SA_EMBED_THREADS) sa_embed(
    const unsigned char* __restrict__ weight,  // [rows, cols / VALUES * BYTES] the file's blocks, 16-aligned
    const int* __restrict__ ids,               // [n] token ids
    float* __restrict__ out,                   // [n, cols] float32
    int rows, int cols, float scale) {
    using T = SaGemvType<TYPE>;
    constexpr int PIECES = T::VALUES / T::PIECE;  // pieces per block
    const int i = blockIdx.x;
    const int j = blockIdx.y * SA_EMBED_THREADS + threadIdx.x;  // piece j of the row
    const int blocks = cols / T::VALUES;
    if (j >= blocks * PIECES) return;
    const int id = ids[i];
    const int blk = j / PIECES;
    float* orow = out + (long long)i * cols + (long long)blk * T::VALUES;
    float w[T::PIECE];
    int off[T::PIECE / 4];
    if (id < 0 || id >= rows) {  // no row to read: NaN at the piece's columns (row 0 read for them alone)
        sa_gemv_piece<TYPE>(weight + (long long)blk * T::BYTES, j % PIECES, w, off);
#pragma unroll
        for (int g = 0; g < T::PIECE / 4; ++g)
#pragma unroll
            for (int e = 0; e < 4; ++e) orow[off[g] + e] = __uint_as_float(0x7fc00000u);
        return;
    }
    const unsigned char* wrow = weight + (long long)id * blocks * T::BYTES;
    sa_gemv_piece<TYPE>(wrow + (long long)blk * T::BYTES, j % PIECES, w, off);
#pragma unroll
    for (int g = 0; g < T::PIECE / 4; ++g)
#pragma unroll
        for (int e = 0; e < 4; ++e) orow[off[g] + e] = w[4 * g + e] * scale;
}
