#pragma once
// The int4 tensor-core kernels' shared pieces (int4_batched.cu: the weight as the mma's A
// operand; int4_xa.cu: x as A): fp16x2 arithmetic, the m16n8k16 mma and the LOP3 of the fp16
// magics. Every int4 linear's contract is reference.int4_matmul's (int4_batched.py).
#include "gpuplane_common.cuh"
#define GP_MMA_WARPS 8

__device__ __forceinline__ unsigned gp_hsub2(unsigned a, unsigned b) {
    unsigned r;
    asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ unsigned gp_hmul2(unsigned a, unsigned b) {
    unsigned r;
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// d += a * b (16x16 fp16 row, 16x8 fp16 col), fp32 accumulate.
__device__ __forceinline__ void gp_mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// (w & mask) | magic, one LOP3.
__device__ __forceinline__ unsigned gp_lop(unsigned w, unsigned mask, unsigned magic) {
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(r) : "r"(w), "r"(mask), "r"(magic));
    return r;
}
