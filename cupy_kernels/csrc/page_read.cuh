// A bandwidth probe for the decode's page layout (validation/decode_floor.py); not part of the
// library's module. It reads every page a decode of the same page table reads, through the
// same indirection, and does nothing with the bytes but XOR them: its time is what any paged
// decode with that grid and that page assignment cannot beat.
//
// Thread -> data map
//   CTA (split, row) of PR_WARPS warps, the v7 decode's grid (PR_CTAS per SM, one wave). A
//   warp takes whole pages; lane l reads the 16-byte words l + 32 i (i < PR_VEC) of each page.
//   DEPTH pages per warp in flight (the v7 decode keeps two page buffers per warp: one page
//   streams while the other is decoded), and the page after those already named. Before a page's words, its header
//   chain: local index j -> indices[indptr[row] + j] -> page_count[page] (the loads wait on
//   the count, as the decode's copies do).
//   MODE 0: v7's static interleaved split, local page j = PR_WARPS s + w + PR_WARPS S k.
//   MODE 1: pages claimed one at a time from the row's counter claims[row] (a run-time balance
//           within the row: a warp on a fast SM takes more of its row's pages); the claim is
//           issued a page ahead of its use. The CTA (0, row) zeroes claims_next[row] for the
//           next launch (the caller alternates the two arrays).
//   MODE 2: no page table: warp gw of the grid reads pool pages gw, gw + W, ... (W warps).
//   Each warp stores the XOR of all its words (one 16-byte word, lanes reduced by shuffles).
#pragma once

namespace skv {

constexpr int PR_WARPS = 4;
constexpr int PR_CTAS = 4;
constexpr int PR_VEC = 8;   // 16-byte words per lane of a 4096-byte page

__device__ __forceinline__ void pr_xor(uint4& acc, const uint4 (&v)[PR_VEC]) {
#pragma unroll
  for (int i = 0; i < PR_VEC; ++i) {
    acc.x ^= v[i].x; acc.y ^= v[i].y; acc.z ^= v[i].z; acc.w ^= v[i].w;
  }
}

template <int MODE>
struct PrWarp {
  const uint4* pages;
  const int* indices;
  const int* page_count;
  int* claims;
  int row, rbeg, n, step, next, lane;

  // The next local page index this warp takes: MODE 1 lane 0's claim (broadcast by `index`
  // when the page is needed, so the atomic's latency is not waited for here).
  __device__ __forceinline__ int take() {
    if (MODE == 1) return lane == 0 ? atomicAdd(claims + row, 1) : 0;
    const int j = next;
    next += step;
    return j;
  }
  __device__ __forceinline__ int index(int raw) const {
    return MODE == 1 ? __shfl_sync(0xffffffffu, raw, 0) : raw;
  }
  // Issues the page's loads (none past the row's pages).
  __device__ __forceinline__ void load(uint4 (&v)[PR_VEC], int j) const {
    if (j >= n) return;
    const int page = MODE == 2 ? j : __ldg(indices + rbeg + j);
    const int count = MODE == 2 ? 1 : __ldg(page_count + page);
    if (count <= 0) {
#pragma unroll
      for (int i = 0; i < PR_VEC; ++i) v[i] = make_uint4(0u, 0u, 0u, 0u);
      return;
    }
    const uint4* p = pages + (size_t)page * (PR_VEC * 32) + lane;
#pragma unroll
    for (int i = 0; i < PR_VEC; ++i) v[i] = __ldg(p + 32 * i);
  }
};

template <int MODE, int DEPTH>
__global__ void __launch_bounds__(PR_WARPS * 32, PR_CTAS)
page_read_kernel(const uint4* __restrict__ pages, int num_pages, const int* __restrict__ indptr,
                 const int* __restrict__ indices, const int* __restrict__ page_count,
                 int num_splits, int* __restrict__ claims, int* __restrict__ claims_next,
                 uint4* __restrict__ out) {
  const int split = blockIdx.x, row = blockIdx.y;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gw = (row * gridDim.x + split) * PR_WARPS + warp;
  if (MODE == 1 && split == 0 && threadIdx.x == 0) claims_next[row] = 0;
  PrWarp<MODE> w{pages, indices, page_count, claims, row, 0, 0, 0, 0, lane};
  if (MODE == 2) {
    w.n = num_pages;
    w.step = gridDim.x * gridDim.y * PR_WARPS;
    w.next = gw;
  } else {
    w.rbeg = __ldg(indptr + row);
    w.n = __ldg(indptr + row + 1) - w.rbeg;
    w.step = PR_WARPS * num_splits;
    w.next = PR_WARPS * split + warp;
  }
  // Slot d holds the warp's pages d, d + DEPTH, ... in taking order; pages are consumed in the
  // order they were taken, so the first index past the row ends the warp (every later one is
  // past it too: static indices grow, and so do one warp's claims on a counter).
  uint4 acc = make_uint4(0u, 0u, 0u, 0u);
  uint4 buf[DEPTH][PR_VEC];
  int j[DEPTH];
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    j[d] = w.index(w.take());
    w.load(buf[d], j[d]);
  }
  int r = w.take();
  bool more = true;
  while (more) {
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      if (more && j[d] >= w.n) more = false;
      if (more) {
        pr_xor(acc, buf[d]);
        j[d] = w.index(r);
        w.load(buf[d], j[d]);
        r = w.take();
      }
    }
  }
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) {
    acc.x ^= __shfl_xor_sync(0xffffffffu, acc.x, m);
    acc.y ^= __shfl_xor_sync(0xffffffffu, acc.y, m);
    acc.z ^= __shfl_xor_sync(0xffffffffu, acc.z, m);
    acc.w ^= __shfl_xor_sync(0xffffffffu, acc.w, m);
  }
  if (lane == 0) out[gw] = acc;
}

}  // namespace skv
