#include "gpuplane_common.cuh"
// Stored floats -> our int4 blocks (block 32 along a row, fp16 scale absmax / 7, nibble q + 8),
// bit for bit what reference.int4_quantize_stored (and models.weights.quantize) makes, for every
// input: zeros, subnormals, values past fp16's range, inf and NaN.
//   scale = fp16_rn(max|x| / 7)          the maximum taken on the stored bits less the sign:
//                                        |x| orders as those bits for every x but NaN, and a
//                                        block holding a NaN gets a NaN scale either way
//   q     = clip(rint(x / safe), -8, 7)  safe = 1 where the scale is 0, else the scale in f32;
//                                        NaN -> 0 (NumPy's float -> int cast of NaN gives 0 in
//                                        the low bits on x86-64 and on AArch64, so nibble 8)
// Divisions are IEEE (__fdiv_rn, whatever the build's flags), subnormals kept (no -ftz).

#define GP_Q_BF16 0
#define GP_Q_F16 1
#define GP_Q_F32 2

// Element i of a block (stored bits in `bits`) as f32, and its magnitude's bits.
template <int DT> __device__ __forceinline__ float gp_q_value(unsigned bits) {
    if (DT == GP_Q_BF16) return __uint_as_float(bits << 16);
    if (DT == GP_Q_F16) return gp_half_to_float((unsigned short)bits);
    return __uint_as_float(bits);
}

template <int DT> __device__ __forceinline__ unsigned gp_q_magnitude(unsigned bits) {
    return bits & (DT == GP_Q_F32 ? 0x7FFFFFFFu : 0x7FFFu);
}

// One quant block: 32 stored values (64 or 128 bytes) read as 16-byte words into `bits`.
template <int DT> __device__ __forceinline__ void gp_q_load(unsigned (&bits)[32], const void* raw,
                                                            long long block) {
    if (DT == GP_Q_F32) {
        const uint4* src = reinterpret_cast<const uint4*>(raw) + block * 8;
#pragma unroll
        for (int w = 0; w < 8; ++w) {
            const uint4 v = src[w];
            bits[4 * w] = v.x; bits[4 * w + 1] = v.y; bits[4 * w + 2] = v.z; bits[4 * w + 3] = v.w;
        }
    } else {
        const uint4* src = reinterpret_cast<const uint4*>(raw) + block * 4;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            const uint4 v = src[w];
            const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                bits[8 * w + 2 * j] = words[j] & 0xFFFFu;
                bits[8 * w + 2 * j + 1] = words[j] >> 16;
            }
        }
    }
}

__device__ __forceinline__ unsigned gp_q_nibble(float x, float safe) {
    const float v = __fdiv_rn(x, safe);
    if (v != v) return 8u;   // NaN
    return (unsigned)((int)fminf(fmaxf(rintf(v), -8.f), 7.f) + 8);
}

// grid-stride over `blocks` quant blocks (a thread each): packed[16 * b .. 16 * b + 15] and
// scales[b] (fp16 bits) from the 32 stored values of block b. raw 16-byte aligned.
template <int DT> __device__ __forceinline__ void gp_int4_quantize_blocks(
        unsigned char* __restrict__ packed, unsigned short* __restrict__ scales,
        const void* __restrict__ raw, long long blocks) {
    GP_GRID_STRIDE(b, blocks) {
        unsigned bits[32];
        gp_q_load<DT>(bits, raw, b);
        unsigned top = 0;
#pragma unroll
        for (int i = 0; i < 32; ++i) top = max(top, gp_q_magnitude<DT>(bits[i]));
        const unsigned short scale = gp_float_to_half(__fdiv_rn(gp_q_value<DT>(top), 7.f));
        const float safe = (scale == 0) ? 1.f : gp_half_to_float(scale);
        unsigned out[4];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            unsigned word = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j)
                word |= gp_q_nibble(gp_q_value<DT>(bits[8 * w + j]), safe) << (4 * j);
            out[w] = word;
        }
        reinterpret_cast<uint4*>(packed)[b] = make_uint4(out[0], out[1], out[2], out[3]);
        scales[b] = scale;
    }
}

// dtype: GP_Q_BF16, GP_Q_F16 or GP_Q_F32 (gpu_worker/kernels/quantize.py's STORED_DTYPES).
extern "C" __global__ void __launch_bounds__(GP_THREADS)
gp_int4_quantize(unsigned char* __restrict__ packed, unsigned short* __restrict__ scales,
                 const void* __restrict__ raw, int dtype, long long blocks) {
    if (dtype == GP_Q_BF16) gp_int4_quantize_blocks<GP_Q_BF16>(packed, scales, raw, blocks);
    else if (dtype == GP_Q_F16) gp_int4_quantize_blocks<GP_Q_F16>(packed, scales, raw, blocks);
    else gp_int4_quantize_blocks<GP_Q_F32>(packed, scales, raw, blocks);
}
