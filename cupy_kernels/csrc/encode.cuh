// Encode/append: rotate, radius, quantise, pack and write states straight into their pages
// (DESIGN §3 steps 0-5, §6; bit layout in docs/format.md). Two generations:
//
// encode_v2_kernel (the default; docs/PERF_NOTES.md "Encode v2")
//   eight lanes per input vector, four vectors per warp (grid-stride over groups of four).
//   Group lane g holds registers i = 4k + e (k < D/32, e < 4) = coordinate j = 32k + 4g + e,
//   so consecutive lanes read consecutive float4 of a row. The Walsh–Hadamard transform runs
//   in float32 (spans 1, 2 and >= 32 in-lane, spans 4, 8, 16 by shuffles inside the group),
//   the cell of every coordinate is found by a binary search over float32 midpoints (the
//   first two steps from registers, the rest from shared memory), and the fp16 scale comes
//   from the float32 radius and a float32 sum of squared levels. A coordinate closer to a cell boundary than the float32 error bound, a
//   scale close to an fp16 rounding boundary, a radius outside the safe float32 range, or a
//   16-bit destination tier sends the vector through v1's float64 pipeline afterwards (the
//   whole warp on one such vector at a time): so every code and scale equals the float64
//   reference's. Each group packs its codes by
//   shuffle-ORs inside the group; the first lane of each word stores it.
// encode_kernel (v1, kept for comparison)
//   one warp per input vector; lane l owns coordinates l*V .. l*V+V-1 (V = D/32); the whole
//   pipeline in float64 (warp_encode in spherical_common.cuh).
// In both, the destination page's tier (page header, read on the device) picks the bit width,
// so one launch serves mixed tiers, and problems (NaN/Inf input, no fp16 scale, bad
// page/slot) are OR-ed into *status.
#pragma once
#include "spherical_common.cuh"

namespace skv {

// Where one vector's codes and scale go: the page's tier row gm, key (part 0) or value part.
struct EncodeDest {
  u32* codes;
  __half* scale;   // nullptr for the 16-bit tier
  int bits;
  __device__ __forceinline__ EncodeDest(u32* pages, int page_words, int page, int slot,
                                        const int* gm, int part) {
    bits = part == 0 ? gm[G_KBITS] : gm[G_VBITS];
    const int words = part == 0 ? gm[G_KWORDS] : gm[G_VWORDS];
    u32* pg = pages + (size_t)page * page_words;
    codes = pg + (part == 0 ? 0 : gm[G_VOFF]) + (size_t)slot * words;
    const int soff = part == 0 ? gm[G_KSOFF] : gm[G_VSOFF];
    scale = soff >= 0 ? reinterpret_cast<__half*>(reinterpret_cast<char*>(pg) + soff) + slot
                      : nullptr;
  }
};

// v1 layout (one warp, lane l: coordinates l*V .. l*V+V-1, V = D/32): y = (x - mu) * sigma in
// float64; returns whether this lane saw NaN/Inf.
template <int D>
__device__ __forceinline__ bool warp_load_centred(double (&y)[D / 32], const float* __restrict__ xi,
                                                  const float* __restrict__ sg,
                                                  const float* __restrict__ mu, int lane) {
  constexpr int V = D / 32;
  float xv[V];   // x rows are 16-byte aligned (the launcher checks)
  if (V == 4) {
    const float4 f = *reinterpret_cast<const float4*>(xi + lane * V);
    xv[0] = f.x; xv[1] = f.y; xv[2 % V] = f.z; xv[3 % V] = f.w;
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) xv[k] = xi[lane * V + k];
  }
  bool bad = false;
#pragma unroll
  for (int k = 0; k < V; ++k) {
    const int j = lane * V + k;
    const float v = xv[k];
    bad |= !isfinite(v);
    double c = (double)v - (mu ? (double)mu[j] : 0.0);
    y[k] = c * (double)sg[j];
  }
  return bad;
}

// The float64 pipeline after the load (v1, and v2's exact path): rotate, normalise, quantise,
// pack and store. Returns status bits (the same on every lane).
template <int D>
__device__ __forceinline__ int warp_rotate_encode(const QuantTables& qt, double (&y)[D / 32],
                                                  const EncodeDest& dst, int lane) {
  warp_fwht<D>(y, lane);
  const double inv = 1.0 / sqrt((double)D);
#pragma unroll
  for (int k = 0; k < D / 32; ++k) y[k] *= inv;
  return qt.encode<D>(y, dst.bits, dst.codes, dst.scale, lane);
}

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
    double y[D / 32];
    const bool bad = warp_load_centred<D>(y, xi, sg, mu, lane);
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
    const int st = warp_rotate_encode<D>(qt, y, EncodeDest(pages, page_words, page, slot, gm, part), lane);
    if (st && lane == 0) atomicOr(status, st);
  }
}

// ------------------------------------------------------------------------ v2: 8 lanes ----
constexpr u32 ENC_FULL = 0xffffffffu;

// The quantiser tables of the v2 kernel: the float64 levels and midpoints (v1's float64
// pipeline, the fallback), and rounded to float32 the midpoints (the search of the fast path)
// and the squared levels (its scale). 30 KiB.
struct EncodeTables {
  QuantTables q;
  float mid[5 * 256], lev2[5 * 256];
  __device__ __forceinline__ void load(const double* __restrict__ levels,
                                       const double* __restrict__ mids) {
    q.load(levels, mids);
    for (int k = threadIdx.x; k < 5 * 256; k += blockDim.x) {
      mid[k] = (float)q.mid[k];
      lev2[k] = (float)(q.lev[k] * q.lev[k]);
    }
    __syncthreads();
  }
};

// Sum over the eight lanes of a group (xor 1, 2, 4 never leaves the group).
template <typename T>
__device__ __forceinline__ T group_sum(T v) {
#pragma unroll
  for (int m = 1; m < 8; m <<= 1) v += __shfl_xor_sync(ENC_FULL, v, m);
  return v;
}

// Whether any lane of this lane's group has p set (one ballot, every lane of the warp).
__device__ __forceinline__ bool group_any(bool p, int lane) {
  return ((__ballot_sync(ENC_FULL, p) >> (lane & 24)) & 0xffu) != 0u;
}

// Loads (x - mu) * sigma in float32 into the group layout (x - mu rounded once; the error
// bound counts it); returns whether a loaded x coordinate is NaN/Inf.
template <int D>
__device__ __forceinline__ bool group_load(float (&y)[D / 8], const float* __restrict__ xi,
                                           const float* __restrict__ sg,
                                           const float* __restrict__ mu, int g) {
  bool bad = false;
#pragma unroll
  for (int k = 0; k < D / 32; ++k) {
    const int j0 = 32 * k + 4 * g;   // rows are 16-byte aligned (the launcher checks)
    const float4 xv = *reinterpret_cast<const float4*>(xi + j0);
    const float4 sv = *reinterpret_cast<const float4*>(sg + j0);
    const float4 mv = mu ? *reinterpret_cast<const float4*>(mu + j0) : make_float4(0.f, 0.f, 0.f, 0.f);
    const float xs[4] = {xv.x, xv.y, xv.z, xv.w}, ss[4] = {sv.x, sv.y, sv.z, sv.w},
                ms[4] = {mv.x, mv.y, mv.z, mv.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      bad |= !isfinite(xs[e]);
      y[4 * k + e] = (xs[e] - ms[e]) * ss[e];
    }
  }
  return bad;
}

// Unnormalised Walsh–Hadamard transform of the group's vector, stages in the reference's
// order (span h = 1, 2, 4, ...; pairs (j, j + h) -> (a + b, a - b), each output rounded once).
template <int D>
__device__ __forceinline__ void group_fwht(float (&y)[D / 8], int g) {
  constexpr int V = D / 8;
#pragma unroll
  for (int h = 1; h < 4; h <<= 1) {          // spans 1, 2: register bits 0-1
#pragma unroll
    for (int i = 0; i < V; ++i) {
      if ((i & h) == 0) {
        const float a = y[i], b = y[i + h];
        y[i] = a + b;
        y[i + h] = a - b;
      }
    }
  }
#pragma unroll
  for (int m = 1; m < 8; m <<= 1) {          // spans 4, 8, 16: group-lane bits
    const float sgn = (g & m) ? -1.f : 1.f;  // lower lane: mine + other; upper: other - mine
#pragma unroll
    for (int i = 0; i < V; ++i) y[i] = fmaf(sgn, y[i], __shfl_xor_sync(ENC_FULL, y[i], m));
  }
#pragma unroll
  for (int h = 4; h < V; h <<= 1) {          // spans 32, 64: register bits 2-3
#pragma unroll
    for (int i = 0; i < V; ++i) {
      if ((i & h) == 0) {
        const float a = y[i], b = y[i + h];
        y[i] = a + b;
        y[i + h] = a - b;
      }
    }
  }
}

// Cell of every t by binary search over the 2^bits - 1 midpoints `mid` (a tie goes to the
// lower code, like searchsorted(side="left")); the steps are unrolled (constant offsets into
// the row) and outside the coordinates, so V independent searches overlap. Returns whether
// some t lies within `margin` of a midpoint it was compared with; both bounds of a t's final
// cell are compared on the way, so this says whether t is that close to its cell's boundary.
// The first two steps compare with three midpoints shared by every coordinate (held in
// registers: no shared-memory load per coordinate), the rest load theirs.
template <int V>
__device__ __forceinline__ bool group_search(const float (&t)[V], const float* mid, int bits,
                                             int (&c)[V], float margin) {
  bool near = false;
  const int h = 1 << (bits - 1), q = h >> 1;
  const float m0 = mid[h - 1];
  const float ma = q ? mid[q - 1] : 0.f, mb = q ? mid[h + q - 1] : 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const bool up = t[i] > m0;
    near |= fabsf(t[i] - m0) <= margin;
    c[i] = up ? h : 0;
    if (q) {
      const float m = up ? mb : ma;
      near |= fabsf(t[i] - m) <= margin;
      if (t[i] > m) c[i] += q;
    }
  }
#pragma unroll
  for (int s = 32; s >= 1; s >>= 1) {
    if (s < q) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float m = mid[c[i] + s - 1];
        near |= fabsf(t[i] - m) <= margin;
        if (t[i] > m) c[i] += s;
      }
    }
  }
  return near;
}

// Packs a field array of nb bits per coordinate (nb in 1, 2, 4, 8; code >> down & mask) of the
// group's codes and, when `store`, writes it at dst. Register chunk k of group lane g covers
// coordinates 32k + 4g .. +3 = bits (32k + 4g) nb .. +4nb: word k nb + g nb / 8. The three
// shuffle rounds run on every lane whatever nb (groups of a warp may differ in bits).
template <int D>
__device__ __forceinline__ void group_pack(const int (&code)[D / 8], int nb, int down, u32 mask,
                                           u32* dst, bool store, int g) {
  const int lanes_per_word = 8 >> (31 - __clz(nb));   // 8 / nb, nb a power of two
#pragma unroll
  for (int k = 0; k < D / 32; ++k) {
    u32 chunk = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) chunk |= ((u32)(code[4 * k + e] >> down) & mask) << (e * nb);
    u32 w = chunk << ((4 * g * nb) & 31);
#pragma unroll
    for (int m = 1; m < 8; m <<= 1) {
      const u32 o = __shfl_xor_sync(ENC_FULL, w, m);
      if (m < lanes_per_word) w |= o;
    }
    if (store && (g & (lanes_per_word - 1)) == 0) dst[k * nb + (g * nb >> 3)] = w;
  }
}

// Packs codes at `bits` (< 16; 3 bits: a 2-bit field array, then the bit plane).
template <int D>
__device__ __forceinline__ void group_pack_codes(const int (&code)[D / 8], int bits, u32* dst,
                                                 bool store, int g) {
  const int nb = bits == 3 ? 2 : bits;
  group_pack<D>(code, nb, 0, (1u << nb) - 1u, dst, store, g);
  if (__any_sync(ENC_FULL, bits == 3))   // the bit plane, when a group of the warp needs one
    group_pack<D>(code, 1, 2, 1u, dst + (2 * D + 31) / 32, store && bits == 3, g);
}

template <int D>
__global__ void __launch_bounds__(256, 4)
encode_v2_kernel(const float* __restrict__ x, long long x_row_stride, int n,
                 const int* __restrict__ head, const float* __restrict__ sigma,
                 const float* __restrict__ mean, const int* __restrict__ mean_index,
                 const int* __restrict__ dst_page, const int* __restrict__ dst_slot, int part,
                 u32* __restrict__ pages, int page_words, const int* __restrict__ page_tier,
                 const int* __restrict__ geom, int num_tiers,
                 const double* __restrict__ levels, const double* __restrict__ mids,
                 int* __restrict__ status) {
  constexpr int V = D / 8;
  constexpr int LOG2D = D == 64 ? 6 : 7;
  __shared__ EncodeTables tb;
  tb.load(levels, mids);
  const int lane = threadIdx.x & 31, g = lane & 7;
  const int warps = (gridDim.x * blockDim.x) >> 5;
  // Float32 error bound of t = sqrt(D) z_j / ||z|| against the float64 reference (unit
  // roundoff u = 2^-24): |dt| <= (L + 1) u sqrt(D) from the L = log2 D butterfly stages and
  // the x - mu rounding (each output of a stage is a +-1 sum of the inputs, |x'|_1 <=
  // sqrt(D) |x'|), plus <= ~22 u |t| from the radius (L + 1 stages norm-wise, the sum of
  // squares, the square root), the division, the product and the float32 midpoint. Near a
  // midpoint m, |t| ~ |m| <= the row's largest midpoint M: the margin is
  // 2 (L + 1) u sqrt(D) + 64 u M (twice and thrice the bound).
  const float sqrt_d = sqrtf((float)D);
  const float margin0 = 2.0f * (LOG2D + 1) * sqrt_d * 0x1p-24f, margin1 = 64.0f * 0x1p-24f;
  for (int base = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * 4; base < n; base += warps * 4) {
    const int i = base + (lane >> 3);
    const bool live = i < n;
    const int ii = live ? i : n - 1;   // idle groups redo a valid vector and write nothing
    const float* xi = x + (long long)ii * x_row_stride;
    const float* sg = sigma + (size_t)head[ii] * D;
    const float* mu = mean ? mean + (size_t)mean_index[ii] * D : nullptr;
    const int page = dst_page[ii], slot = dst_slot[ii];
    float z[V];
    const bool bad = group_any(group_load<D>(z, xi, sg, mu, g), lane);
    // Destination checks in the order of v1: tier, then slot, then the input.
    const int tier = page_tier[page];
    const bool tier_ok = tier >= 1 && tier <= num_tiers;
    const int* gm = geom + (tier_ok ? tier : 1) * SKV_GEOM_STRIDE;
    const bool slot_ok = slot >= 0 && slot < gm[G_P];
    const int st0 = !tier_ok ? ST_BAD_TIER : !slot_ok ? ST_BAD_SLOT : bad ? ST_NONFINITE : 0;
    if (live && st0 && g == 0) atomicOr(status, st0);
    const bool ok = live && st0 == 0;
    const EncodeDest dst(pages, page_words, page, slot, gm, part);
    const int bits = ok ? dst.bits : 1;
    const int qbits = bits == 16 ? 1 : bits;   // the table row searched (a 16-bit group only idles)
    const int lr = level_row(qbits);

    // ---- fast path: float32 transform, radius and search
    group_fwht<D>(z, g);
    float r2 = 0.f;
#pragma unroll
    for (int k = 0; k < V; ++k) r2 += z[k] * z[k];
    r2 = group_sum(r2);
    const bool r_ok = r2 >= 1e-30f && r2 <= 1e30f;   // no underflow/overflow of the squares
    const float rz = sqrtf(r2);
    const float kt = r_ok ? sqrt_d / rz : 0.f;
#pragma unroll
    for (int k = 0; k < V; ++k) z[k] *= kt;          // z now holds t = sqrt(D) u
    int code[V];
    const float* mrow = tb.mid + lr * 256;
    const float margin = fmaf(mrow[(1 << qbits) - 2], margin1, margin0);   // symmetric rows
    bool near = group_search<V>(z, mrow, qbits, code, margin);
    near |= !r_ok || bits == 16;
    const float* l2row = tb.lev2 + lr * 256;
    float c2 = 0.f;
#pragma unroll
    for (int k = 0; k < V; ++k) c2 += l2row[code[k]];
    c2 = group_sum(c2);
    // s = r / ||c_hat|| = ||z|| / sqrt(sum C[c]^2). Relative error <= ~21 u from the radius,
    // ~10.5 u from the float32 sum of squared levels (positive terms, 19 additions deep, under
    // a square root) and ~1 u from the division: < 33 u, i.e. < 33 float32 ulps of s. A
    // scale 64 ulps or more from an fp16 rounding boundary (low 13 mantissa bits 0x1000) and
    // inside the normal fp16 range rounds as the reference's does.
    const float sf = rz / sqrtf(c2);
    near |= !(sf >= 0x1p-14f && sf < 65000.0f) || abs((__float_as_int(sf) & 0x1fff) - 0x1000) <= 64;
    const bool slow = group_any(near, lane) && ok;
    group_pack_codes<D>(code, qbits, dst.codes, ok && !slow, g);
    if (ok && !slow && g == 0) *dst.scale = __float2half_rn(sf);

    // ---- float64 path for the groups that need it: v1's pipeline, one vector at a time, the
    // whole warp on it (lane 8q of group q hands over its vector index)
    u32 todo = __ballot_sync(ENC_FULL, slow && g == 0);
    while (todo) {
      const int src = __ffs(todo) - 1;
      todo &= todo - 1;
      const int v = __shfl_sync(ENC_FULL, ii, src);
      const float* mu_v = mean ? mean + (size_t)mean_index[v] * D : nullptr;
      double y[D / 32];
      warp_load_centred<D>(y, x + (long long)v * x_row_stride, sigma + (size_t)head[v] * D, mu_v,
                           lane);
      const int* gv = geom + page_tier[dst_page[v]] * SKV_GEOM_STRIDE;
      const int st = warp_rotate_encode<D>(
          tb.q, y, EncodeDest(pages, page_words, dst_page[v], dst_slot[v], gv, part), lane);
      if (st && lane == 0) atomicOr(status, st);
    }
  }
}

}  // namespace skv
