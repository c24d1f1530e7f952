// Re-tier / compaction: move states between pages after an applied RDR decision (docs/design.md §4, §6).
//
// Thread -> data map
//   one warp per move (grid-stride); the warp handles the key, then the value, of the state
//   at (src_page, src_slot) -> (dst_page, dst_slot). Same bit width at both ends: a plain
//   copy of the code words (lane-strided) and the fp16 scale (compaction). Fewer bits at the
//   destination (a demotion): lane l decodes coordinates l*V .. l*V+V-1 of the stored state
//   to y = s * C[c] / sqrt(D) in float64 (16-bit tier: y = the stored fp16), and re-encodes
//   y at the destination's bits with the same quantiser as the encode kernel (the rotation
//   and the centring are shared by every tier, so no rotation is applied). Moves must not
//   overlap (no slot is both a source and a destination of one launch).
#pragma once
#include "spherical_common.cuh"

namespace skv {

constexpr int RETIER_THREADS = 256;   // threads per block (launcher THREADS)

template <int D>
__global__ void __launch_bounds__(RETIER_THREADS)
retier_kernel(int n, const int* __restrict__ src_page, const int* __restrict__ src_slot,
              const int* __restrict__ dst_page, const int* __restrict__ dst_slot,
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
    const int sp = src_page[i], ss = src_slot[i], dp = dst_page[i], ds = dst_slot[i];
    const int ts = page_tier[sp], td = page_tier[dp];
    if (ts < 1 || ts > num_tiers || td < 1 || td > num_tiers) {
      if (lane == 0) atomicOr(status, ST_BAD_TIER);
      continue;
    }
    const int* gs = geom + ts * SKV_GEOM_STRIDE;
    const int* gd = geom + td * SKV_GEOM_STRIDE;
    if (ss < 0 || ss >= gs[G_P] || ds < 0 || ds >= gd[G_P]) {
      if (lane == 0) atomicOr(status, ST_BAD_SLOT);
      continue;
    }
    if (gd[G_KBITS] > gs[G_KBITS] || gd[G_VBITS] > gs[G_VBITS]) {
      if (lane == 0) atomicOr(status, ST_PROMOTION);
      continue;
    }
    u32* ps = pages + (size_t)sp * page_words;
    u32* pd = pages + (size_t)dp * page_words;
    for (int part = 0; part < 2; ++part) {
      const int bs = gs[part == 0 ? G_KBITS : G_VBITS], bd = gd[part == 0 ? G_KBITS : G_VBITS];
      const int ws = gs[part == 0 ? G_KWORDS : G_VWORDS], wd = gd[part == 0 ? G_KWORDS : G_VWORDS];
      const u32* cs = ps + (part == 0 ? 0 : gs[G_VOFF]) + (size_t)ss * ws;
      u32* cd = pd + (part == 0 ? 0 : gd[G_VOFF]) + (size_t)ds * wd;
      const int sso = gs[part == 0 ? G_KSOFF : G_VSOFF], sdo = gd[part == 0 ? G_KSOFF : G_VSOFF];
      const __half* scs = sso >= 0 ? reinterpret_cast<const __half*>(reinterpret_cast<const char*>(ps) + sso) + ss : nullptr;
      __half* scd = sdo >= 0 ? reinterpret_cast<__half*>(reinterpret_cast<char*>(pd) + sdo) + ds : nullptr;
      if (bs == bd) {
        for (int w = lane; w < ws; w += 32) cd[w] = cs[w];
        if (lane == 0 && scd) *scd = *scs;
        continue;
      }
      double y[V];
      if (bs == 16) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const int j = lane * V + k;
          const u32 w = cs[j >> 1];
          const unsigned short hbits = (unsigned short)((j & 1) ? (w >> 16) : (w & 0xffffu));
          y[k] = (double)__half2float(__ushort_as_half(hbits));
        }
      } else {
        const double s = (double)__half2float(*scs) / sqrt((double)D);
        const double* lev = qt.lev + level_row(bs) * 256;
#pragma unroll
        for (int k = 0; k < V; ++k) y[k] = s * lev[read_code<D>(cs, bs, lane * V + k)];
      }
      const int st = qt.encode<D>(y, bd, cd, scd, lane);
      if (st && lane == 0) atomicOr(status, st);
    }
  }
}

}  // namespace skv
