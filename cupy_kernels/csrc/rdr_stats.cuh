// RDR on the device, the passes of rdr_device that would otherwise each be a chain of torch ops
// over large float64 arrays (docs/rdr.md §1, docs/PERF_NOTES.md "Compress"): the statistics'
// softmax and per-state means, the stored states, the solver's per-state convex hull and its
// bisection's (group, tier) counts. float64 throughout, the reference's precision.
//
// Thread -> data map
//   rdr_softmax_kernel: one block per (row, query) line of z (rows*queries lines of n states);
//     its threads stride over the line three times: the max, the sum of exp, then the write
//     P = a * exp(s z - max) / sum + b in place (a = 1 - prior, b = prior / n, s the softmax
//     scale > 0, applied as it reads: s z rounds as torch's z * s does, so no pass of its own).
//   rdr_state_sums_kernel: one thread per (row, state); it walks the row's queries in order
//     (the reference's sum order over queries) reading P and G = o . v at (row, query, state),
//     coalesced across the warp's consecutive states, and writes the three means
//     p2 = mean P^2, e = mean P^2 d2, ee = mean P^2 d2 / max(1 - P, 1e-12)^2 with
//     d2 = max(|v|^2 - 2 G + |o|^2, 0).
//   rdr_hull_kernel: one thread per state; it reads the state's T+1 distortions (one row of D)
//     and its current tier, and writes its rows of keep (the lower convex hull's points), nxt
//     (each point's next hull point, -1 after the last) and pos (each point's rank along the
//     hull), running greedy_allocation's loops in their order with unfused float64 arithmetic
//     (__dadd_rn etc.: no FMA), so the answer is bit for bit that of the torch ops.
//   rdr_cut_counts_kernel: one thread per state; the greedy's bisection step. It reads the
//     state's T+1 increment ranks and its problem's cut k, takes the hull point reached after
//     the increments of rank < k (a protected state stays at its base tier), and counts the
//     state in its (group, tier) bin, one atomic per distinct bin of a warp (a warp's states
//     are nearly always of one group): the counts greedy_allocation's torch ops would get
//     from bincount, without the host wait bincount makes to size its output.
//   rdr_rotated_kernel: one thread per (state, coordinate), a state's coordinates on
//     consecutive threads; it reads the state's page, slot and tier, the tier's geometry row,
//     the coordinate's packed field of the key and of the value (or the stored half at 16
//     bits) and each part's fp16 scale, and writes y = s * (C[code] * (1 / sqrt(d))) in float64:
//     DeviceKVCache.stored_rotated's rotated, centred point, bit for bit, for states of any
//     tiers in one pass (the statistics' input, yk and yv (n, d)).
#pragma once

#include <cuda_fp16.h>

namespace skv {

constexpr int RDR_STATS_THREADS = 256;   // threads per block of the five kernels (rdr_device)

__device__ __forceinline__ double rdr_neg_inf() { return __longlong_as_double((long long)0xfff0000000000000ULL); }

__device__ __forceinline__ double rdr_block_reduce(double x, bool take_max, double* shared) {
  for (int off = 16; off > 0; off >>= 1) {
    const double y = __shfl_down_sync(0xffffffffu, x, off);
    x = take_max ? fmax(x, y) : x + y;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  if (warp == 0) {
    x = lane < (RDR_STATS_THREADS / 32) ? shared[lane] : (take_max ? rdr_neg_inf() : 0.0);
    for (int off = 16; off > 0; off >>= 1) {
      const double y = __shfl_down_sync(0xffffffffu, x, off);
      x = take_max ? fmax(x, y) : x + y;
    }
    if (lane == 0) shared[0] = x;
  }
  __syncthreads();
  const double out = shared[0];
  __syncthreads();   // shared is reused by the next reduction
  return out;
}

__global__ void __launch_bounds__(RDR_STATS_THREADS)
rdr_softmax_kernel(double* __restrict__ z, long long n, double scale, double a, double b) {
  __shared__ double shared[RDR_STATS_THREADS / 32];
  double* line = z + (long long)blockIdx.x * n;
  double mx = rdr_neg_inf();
  for (long long i = threadIdx.x; i < n; i += RDR_STATS_THREADS) mx = fmax(mx, line[i]);
  // scale > 0 and rounding is monotone, so the largest scaled logit is the scaled largest
  mx = __dmul_rn(scale, rdr_block_reduce(mx, true, shared));
  double sum = 0.0;
  for (long long i = threadIdx.x; i < n; i += RDR_STATS_THREADS)
    sum += exp(__dmul_rn(scale, line[i]) - mx);
  sum = rdr_block_reduce(sum, false, shared);
  for (long long i = threadIdx.x; i < n; i += RDR_STATS_THREADS)
    line[i] = a * (exp(__dmul_rn(scale, line[i]) - mx) / sum) + b;
}

__global__ void __launch_bounds__(RDR_STATS_THREADS)
rdr_state_sums_kernel(const double* __restrict__ P, const double* __restrict__ G,
                      const double* __restrict__ o2, const double* __restrict__ vn,
                      int rows, int m, long long n, double* __restrict__ p2,
                      double* __restrict__ e, double* __restrict__ ee) {
  const long long i = (long long)blockIdx.x * RDR_STATS_THREADS + threadIdx.x;
  const int r = blockIdx.y;
  if (i >= n || r >= rows) return;
  const double v = vn[(long long)r * n + i];
  const double v2 = v * v;
  double sw = 0.0, se = 0.0, see = 0.0;
  for (int j = 0; j < m; ++j) {
    const long long at = ((long long)r * m + j) * n + i;
    const double p = P[at];
    const double d2 = fmax(v2 - 2.0 * G[at] + o2[(long long)r * m + j], 0.0);
    const double w = p * p;
    const double t = w * d2;
    const double den = fmax(1.0 - p, 1e-12);
    sw += w;
    se += t;
    see += t / (den * den);
  }
  const long long out = (long long)r * n + i;
  p2[out] = sw / m;
  e[out] = se / m;
  ee[out] = see / m;
}

// T1 = T + 1 options (eviction and T tiers) as a template parameter, so that the per-state
// arrays stay in registers (instances: RDR_HULL_OPTIONS in _module.py; other ladders take
// the torch ops)
template <int T1>
__global__ void __launch_bounds__(RDR_STATS_THREADS)
rdr_hull_kernel(const double* __restrict__ D, const long long* __restrict__ cur,
                const double* __restrict__ c, long long n, bool* __restrict__ keep,
                signed char* __restrict__ nxt, signed char* __restrict__ pos) {
  const long long i = (long long)blockIdx.x * RDR_STATS_THREADS + threadIdx.x;
  if (i >= n) return;
  double Dm[T1];
  unsigned k = 0;                                    // bit j: option j is a hull point
  const long long ct = cur[i];
#pragma unroll
  for (int j = 0; j < T1; ++j) {
    if (j <= ct) k |= 1u << j;                       // never promote
    Dm[j] = j <= ct ? D[i * T1 + j] : 1.7976931348623157e308;
  }
#pragma unroll
  for (int j = 1; j < T1; ++j) {                     // dominated by an earlier point
    bool any = false;
#pragma unroll
    for (int a = 0; a < j; ++a) any |= Dm[a] <= Dm[j];
    if (any) k &= ~(1u << j);
  }
#pragma unroll
  for (int j = 1; j < T1 - 1; ++j)                   // on or above a chord around it
#pragma unroll
    for (int a = 0; a < j; ++a)
#pragma unroll
      for (int b = j + 1; b < T1; ++b) {
        const double ratio = __ddiv_rn(__dsub_rn(c[j], c[a]), __dsub_rn(c[b], c[a]));
        const double chord = __dadd_rn(Dm[a], __dmul_rn(__dsub_rn(Dm[b], Dm[a]), ratio));
        if (((k >> a) & 1u) && ((k >> b) & 1u) && Dm[j] >= chord) k &= ~(1u << j);
      }
  int last = -1, rank = -1;
#pragma unroll
  for (int j = T1 - 1; j >= 0; --j) {
    nxt[i * T1 + j] = (signed char)last;
    if ((k >> j) & 1u) last = j;
  }
#pragma unroll
  for (int j = 0; j < T1; ++j) {
    const bool on = (k >> j) & 1u;
    rank += on ? 1 : 0;
    keep[i * T1 + j] = on;
    pos[i * T1 + j] = (signed char)rank;
  }
}

constexpr int RDR_LEVELS = 256;   // entries per (tier, part) of rdr_rotated_kernel's level table

// coordinate j of one part (its packed words w) at `bits` before the scale: C[code] / sqrt(d),
// as torch divides a tensor by a scalar on CUDA: times the reciprocal inv_sqrt_d = 1 / sqrt(d)
// (made on the host in float64; a true division differs by an ulp where sqrt(d) is irrational)
__device__ __forceinline__ double rdr_level(const unsigned* __restrict__ w, int bits, int j,
                                            int dim, const double* __restrict__ levels,
                                            double inv_sqrt_d) {
  unsigned code;
  if (bits == 3) {                                   // a 2-bit plane, then a 1-bit plane
    const int w2 = (2 * dim + 31) / 32;
    code = ((w[j >> 4] >> (2 * (j & 15))) & 3u) | (((w[w2 + (j >> 5)] >> (j & 31)) & 1u) << 2);
  } else {
    const int per = 32 / bits;
    code = (w[j / per] >> (bits * (j % per))) & ((1u << bits) - 1u);
  }
  return __dmul_rn(levels[code], inv_sqrt_d);
}

__device__ __forceinline__ double rdr_half(const unsigned short* __restrict__ h, long long at) {
  return (double)__half2float(__ushort_as_half(h[at]));
}

// one part of one state: the stored half at 16 bits, else s * C[code] / sqrt(d)
__device__ __forceinline__ double rdr_part(const unsigned* __restrict__ page_words,
                                           const unsigned short* __restrict__ page_halves,
                                           int bits, int words, int off_words, int soff_bytes,
                                           long long slot, int j, int dim,
                                           const double* __restrict__ levels, double inv_sqrt_d) {
  const long long first = off_words + slot * words;
  if (bits == 16) return rdr_half(page_halves, 2 * first + j);
  const double scale = rdr_half(page_halves, soff_bytes / 2 + slot);
  return __dmul_rn(scale, rdr_level(page_words + first, bits, j, dim, levels, inv_sqrt_d));
}

// pool: the page pool as 32-bit words (words_per_page a page); geom: (T+1, geom_stride) int32
// rows [kbits, vbits, P, kwords, vwords, voff_words, ksoff_bytes, vsoff_bytes]; levels:
// (T+1, 2, RDR_LEVELS) float64, the codebook of each (tier, key/value) part
__global__ void __launch_bounds__(RDR_STATS_THREADS)
rdr_rotated_kernel(const unsigned* __restrict__ pool, long long words_per_page,
                   const long long* __restrict__ page, const long long* __restrict__ slot,
                   const long long* __restrict__ tier, const int* __restrict__ geom,
                   int geom_stride, const double* __restrict__ levels, int dim, double inv_sqrt_d,
                   long long n, double* __restrict__ yk, double* __restrict__ yv) {
  const long long i = (long long)blockIdx.x * RDR_STATS_THREADS + threadIdx.x;
  if (i >= n * dim) return;
  const long long s = i / dim;
  const int j = (int)(i - s * dim);
  const int t = (int)tier[s];
  const int* g = geom + t * geom_stride;
  const unsigned* words = pool + page[s] * words_per_page;
  const unsigned short* halves = reinterpret_cast<const unsigned short*>(words);
  const double* lv = levels + (long long)t * 2 * RDR_LEVELS;
  yk[i] = rdr_part(words, halves, g[0], g[3], 0, g[6], slot[s], j, dim, lv, inv_sqrt_d);
  yv[i] = rdr_part(words, halves, g[1], g[4], g[5], g[7], slot[s], j, dim, lv + RDR_LEVELS, inv_sqrt_d);
}

template <int T1>
__global__ void __launch_bounds__(RDR_STATS_THREADS)
rdr_cut_counts_kernel(const int* __restrict__ ranks, const signed char* __restrict__ hull,
                      const bool* __restrict__ free_state, const long long* __restrict__ base_tier,
                      const long long* __restrict__ group, const long long* __restrict__ segment,
                      const long long* __restrict__ cut, long long n,
                      unsigned long long* __restrict__ counts) {
  const long long i = (long long)blockIdx.x * RDR_STATS_THREADS + threadIdx.x;
  long long key = -1;
  if (i < n) {
    long long t = base_tier[i];
    if (free_state[i]) {
      const long long k = cut[segment[i]];
      int reached = 0;
#pragma unroll
      for (int j = 0; j < T1; ++j) reached += (long long)ranks[i * T1 + j] < k ? 1 : 0;
      t = hull[i * T1 + reached];
    }
    key = group[i] * T1 + t;
  }
  const unsigned peers = __match_any_sync(0xffffffffu, key);
  if (key >= 0 && (int)(threadIdx.x & 31) == __ffs(peers) - 1)
    atomicAdd(counts + key, (unsigned long long)__popc(peers));
}

}  // namespace skv
