// Encode/append: rotate, radius, quantise, pack and write states straight into their pages
// (DESIGN §3 steps 0-5, §6; bit layout in docs/format.md).
//
// Thread -> data map
//   one warp per input vector (grid-stride over vectors); lane l owns coordinates
//   l*V .. l*V+V-1 (V = D/32). The Walsh–Hadamard transform runs on those registers
//   (butterflies of span < V in-lane, the rest across lanes by shuffles), in float64 so the
//   codes match the float64 reference. Lane groups then OR their code chunks into words by
//   shuffles; the first lane of each word stores it. The destination page's tier (page
//   header, read on the device) picks the bit width, so one launch serves mixed tiers.
//   Problems (NaN/Inf input, no fp16 scale, bad page/slot) are OR-ed into *status.
#pragma once
#include "spherical_common.cuh"

namespace skv {

template <int D>
__global__ void __launch_bounds__(256)
encode_kernel(const float* __restrict__ x, long long x_row_stride, int n,
              const int* __restrict__ head, const float* __restrict__ sigma,
              const float* __restrict__ mean, const int* __restrict__ mean_index,
              const int* __restrict__ dst_page, const int* __restrict__ dst_slot, int part,
              u32* __restrict__ pages, int page_words, const int* __restrict__ page_tier,
              const int* __restrict__ geom, int num_tiers,
              const double* __restrict__ levels, const double* __restrict__ mids,
              int* __restrict__ status) {
  constexpr int V = D / 32;
  __shared__ QuantTables qt;   // 20 KiB
  qt.load(levels, mids);
  const int lane = threadIdx.x & 31;
  const int warps = (gridDim.x * blockDim.x) >> 5;
  for (int i = (blockIdx.x * blockDim.x + threadIdx.x) >> 5; i < n; i += warps) {
    // Independent loads first (x row, signs, mean, destination), then the page header.
    const float* xi = x + (long long)i * x_row_stride;
    const float* sg = sigma + (size_t)head[i] * D;
    const float* mu = mean ? mean + (size_t)mean_index[i] * D : nullptr;
    const int page = dst_page[i], slot = dst_slot[i];
    float xv[V];   // x rows are 16-byte aligned (the launcher checks)
    if (V == 4) {
      const float4 f = *reinterpret_cast<const float4*>(xi + lane * V);
      xv[0] = f.x; xv[1] = f.y; xv[2 % V] = f.z; xv[3 % V] = f.w;
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) xv[k] = xi[lane * V + k];
    }
    double y[V];
    bool bad = false;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const int j = lane * V + k;
      const float v = xv[k];
      bad |= !isfinite(v);
      double c = (double)v - (mu ? (double)mu[j] : 0.0);
      y[k] = c * (double)sg[j];
    }
    const int tier = page_tier[page];
    if (tier < 1 || tier > num_tiers) {
      if (lane == 0) atomicOr(status, ST_BAD_TIER);
      continue;
    }
    const int* gm = geom + tier * SKV_GEOM_STRIDE;
    if (slot < 0 || slot >= gm[G_P]) {
      if (lane == 0) atomicOr(status, ST_BAD_SLOT);
      continue;
    }
    if (__any_sync(0xffffffffu, bad)) {
      if (lane == 0) atomicOr(status, ST_NONFINITE);
      continue;
    }
    warp_fwht<D>(y, lane);
    const double inv = 1.0 / sqrt((double)D);
#pragma unroll
    for (int k = 0; k < V; ++k) y[k] *= inv;
    const int bits = part == 0 ? gm[G_KBITS] : gm[G_VBITS];
    const int words = part == 0 ? gm[G_KWORDS] : gm[G_VWORDS];
    u32* pg = pages + (size_t)page * page_words;
    u32* codes = pg + (part == 0 ? 0 : gm[G_VOFF]) + (size_t)slot * words;
    const int soff = part == 0 ? gm[G_KSOFF] : gm[G_VSOFF];
    __half* sc = soff >= 0 ? reinterpret_cast<__half*>(reinterpret_cast<char*>(pg) + soff) + slot
                           : nullptr;
    const int st = qt.encode<D>(y, bits, codes, sc, lane);
    if (st && lane == 0) atomicOr(status, st);
  }
}

}  // namespace skv
