#include "gpuplane_common.cuh"
// w16[r - row0, c] = fp16((nib(r, c) - 8) * scale(r, c / 32)) for r in [row0, row0 + rows)
// Byte j of a packed word (k 2j and 2j + 1 in its low and high nibble) -> one fp16x2: byte j
// goes to both halves of a register (PRMT); one LOP3 makes fp16 (1024 + lo, 1024 + 16 hi); one
// HFMA2 by (1, 1/16) plus (-1032, -72) gives the exact integers (lo - 8, hi - 8); one HMUL2 by
// the scale rounds the exact product once to nearest even: bit-equal to (nib - 8) * scale in
// f32 then cvt.rn.f16.
__device__ __forceinline__ unsigned gp_dq_pair(unsigned word, unsigned j, unsigned s2) {
    const unsigned t = __byte_perm(word, 0u, 0x4040u | (j << 8) | j);
    unsigned v, r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(v) : "r"(t), "r"(0x00F0000Fu), "r"(0x64006400u));
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(v), "r"(0x2C003C00u), "r"(0xD480E408u));
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(v) : "r"(r), "r"(s2));
    return v;
}

#ifndef GP_DQ_WORDS
#error "GP_DQ_WORDS: packed words a thread dequantizes per pass (gpu_worker/kernels/half.py sets it)"
#endif

// Rows [row0, row0 + rows) of the int4 weight into w16 (rows x k halves). K % 8 == 0 (every
// Llama-shaped weight): a pass of a block covers GP_DQ_WORDS x blockDim consecutive packed words
// (8 weights each), thread t taking words t, t + blockDim, ...: every load and store of a warp
// is contiguous (128 bytes in, 512 out), and a thread issues all its words' loads before its
// first store, so GP_DQ_WORDS loads are in flight per thread. Any grid is correct (a
// grid-stride loop over passes); the launcher sizes it for the build's GP_DQ_WORDS.
// 32-bit index math (the launcher bounds rows * k / 8 below 2^31). Other K: a thread per weight.
// TILED: the weight in the 16-row tile layout (int4_batched.rows_tiled; K % 128 == 0, row0 a
// multiple of 16): quant block qb of row r is block (r / 16 * KG + qb / 4) * 64 + 32 (r / 8 % 2)
// + 4 (r % 8) + qb % 4, its scale at the same index; a warp's loads are 64-byte runs then.
template <bool TILED>
__device__ __forceinline__ void gp_int4_dequant_f16_rows(unsigned short* __restrict__ w16,
                                                         const unsigned char* __restrict__ packed,
                                                         const unsigned short* __restrict__ scales,
                                                         int row0, int rows, int k) {
    const int kb = (k + 31) >> 5;
    if ((k & 7) == 0) {
        const unsigned words = (unsigned)k >> 3, total = (unsigned)rows * words;
        const unsigned* src = reinterpret_cast<const unsigned*>(packed);
        const unsigned pass = blockDim.x * GP_DQ_WORDS;
        for (unsigned first = blockIdx.x * pass + threadIdx.x; first < total; first += gridDim.x * pass) {
            unsigned q[GP_DQ_WORDS], s[GP_DQ_WORDS];
            unsigned r = first / words, wd = first - r * words;   // one division a pass
#pragma unroll
            for (int u = 0; u < GP_DQ_WORDS; ++u) {
                if (u) {                                 // word first + u * blockDim: step on
                    wd += blockDim.x;
                    while (wd >= words) { wd -= words; ++r; }
                }
                if (first + u * blockDim.x < total) {
                    const size_t gr = (size_t)(row0 + (int)r);
                    const size_t qb = TILED ? ((gr >> 4) * (kb >> 2) + (wd >> 4)) * 64 +
                                              32 * ((gr >> 3) & 1) + 4 * (gr & 7) + ((wd >> 2) & 3)
                                            : gr * kb + (wd >> 2);
                    q[u] = __ldg(src + qb * 4 + (wd & 3));
                    s[u] = __ldg(scales + qb);
                }
            }
#pragma unroll
            for (int u = 0; u < GP_DQ_WORDS; ++u) {
                const unsigned i = first + u * blockDim.x;
                if (i < total) {
                    const unsigned s2 = s[u] | (s[u] << 16);
                    *reinterpret_cast<uint4*>(w16 + (size_t)i * 8) =
                        make_uint4(gp_dq_pair(q[u], 0, s2), gp_dq_pair(q[u], 1, s2),
                                   gp_dq_pair(q[u], 2, s2), gp_dq_pair(q[u], 3, s2));
                }
            }
        }
    } else if (!TILED) {
        GP_GRID_STRIDE(i, (long long)rows * k) {
            const int r = (int)(i / k), c = (int)(i % k);
            const size_t gr = (size_t)(row0 + r);
            const unsigned char byte = packed[gr * kb * 16 + (c >> 1)];
            const int nib = (c & 1) ? (byte >> 4) : (byte & 15);
            w16[i] = gp_float_to_half((float)(nib - 8) * gp_half_to_float(scales[gr * kb + (c >> 5)]));
        }
    }
}

extern "C" __global__ void gp_int4_dequant_f16(unsigned short* __restrict__ w16,
                                               const unsigned char* __restrict__ packed,
                                               const unsigned short* __restrict__ scales,
                                               int row0, int rows, int k) {
    gp_int4_dequant_f16_rows<false>(w16, packed, scales, row0, rows, k);
}
extern "C" __global__ void gp_int4_dequant_f16_tiled(unsigned short* __restrict__ w16,
                                                     const unsigned char* __restrict__ packed,
                                                     const unsigned short* __restrict__ scales,
                                                     int row0, int rows, int k) {
    gp_int4_dequant_f16_rows<true>(w16, packed, scales, row0, rows, k);
}

extern "C" __global__ void gp_to_f16(unsigned short* __restrict__ out, const float* __restrict__ x,
                                     long long n) {
    GP_GRID_STRIDE(i, n) out[i] = gp_float_to_half(x[i]);
}
