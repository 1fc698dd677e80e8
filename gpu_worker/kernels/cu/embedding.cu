#include "gpuplane_common.cuh"
// One block per row (grid-stride over rows); threads stride over the hidden dimension.
extern "C" __global__ void gp_embedding_gather(float* out, const unsigned short* __restrict__ table,
                                               const int* __restrict__ ids, int rows, int hidden,
                                               int vocab, int accumulate) {
    GP_PDL_ENTRY();
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const int id = ids[r];
        const bool valid = id >= 0 && id < vocab;
        const unsigned short* t = table + (size_t)(valid ? id : 0) * hidden;
        float* o = out + (size_t)r * hidden;
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
            const float v = valid ? gp_half_to_float(t[c]) : 0.f;
            o[c] = accumulate ? o[c] + v : v;
        }
    }
}
