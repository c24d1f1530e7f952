// Encode/append: rotate, radius, quantise, pack and write states straight into their pages
// (docs/design.md §3 steps 0-5, §6; bit layout in docs/format.md).
//
// Thread -> data map (encode_table_kernel, encode_affine_kernel)
//   256 threads, eight lanes per input vector, four vectors per warp (grid-stride over groups
//   of four). Group lane g holds registers i = 4k + e (k < D/32, e < 4) = coordinate
//   j = 32k + 4g + e, so consecutive lanes read consecutive float4 of a row. The Walsh–Hadamard
//   transform runs in float32 (spans 1, 2 and >= 32 in-lane, spans 4, 8, 16 by shuffles inside
//   the group). The cell of a coordinate is found without a search: on the uniform codebook
//   (encode_affine_kernel) it is an affine function of t rounded to an integer, on any other
//   codebook (encode_table_kernel) one look-up in a table of buckets over t (each bucket holds
//   at most one midpoint) and one compare. The next vector's indices and destination tier are
//   loaded one iteration ahead and its x row streams into shared memory (cp.async) while the
//   current one is encoded. Each lane packs and stores its own codes (no shuffles, except the
//   1-bit plane of the 1- and 3-bit widths: one exchange with the neighbouring lane).
//   A coordinate closer to a cell boundary than the float32 error bound, a radius outside the
//   safe float32 range, or a 16-bit destination tier sends the vector through the float64
//   pipeline afterwards (the whole warp on one such vector at a time; lane l owns coordinates
//   l*V .. l*V+V-1, V = D/32; warp_encode in spherical_common.cuh); a scale alone in doubt has
//   its fp16 rounding decided in float64 by the whole warp after the loop (enc_encode). So
//   every code and scale equals the float64 reference's.
//   The destination page's tier (page header, read on the device) picks the bit width, so one
//   launch serves mixed tiers, and problems (NaN/Inf input, no fp16 scale, bad page/slot) are
//   OR-ed into *status.
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

// The float64 pipeline's layout (one warp, lane l: coordinates l*V .. l*V+V-1, V = D/32): y = (x - mu) * sigma in
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

// ----------------------------------------------------------- eight lanes per vector ----
constexpr u32 ENC_FULL = 0xffffffffu;
constexpr int ENC_THREADS = 256;   // threads per block (launcher THREADS)
constexpr int ENC_CTAS = 4;        // resident blocks per SM asked of ptxas (launcher BLOCKS_PER_SM)
// At D = 256 (WIDE_DIM) a group's coordinates take more than the 64 registers 4 blocks leave
// (80 and 100 bytes spilled): 2 blocks per SM there.
constexpr int ENC_CTAS_WIDE = 2;

// Sum over the eight lanes of a group (xor 1, 2, 4 never leaves the group); `mask`: the
// lanes taking part (the whole warp, or the group alone inside a group-divergent branch).
template <typename T>
__device__ __forceinline__ T group_sum(T v, u32 mask = ENC_FULL) {
#pragma unroll
  for (int m = 1; m < 8; m <<= 1) v += __shfl_xor_sync(mask, v, m);
  return v;
}

// One in-register Walsh–Hadamard stage of span h: pairs (i, i + h) -> (a + b, a - b).
template <int V>
__device__ __forceinline__ void reg_butterfly(float (&y)[V], int h) {
#pragma unroll
  for (int i = 0; i < V; ++i) {
    if ((i & h) == 0) {
      const float a = y[i], b = y[i + h];
      y[i] = a + b;
      y[i + h] = a - b;
    }
  }
}

// Unnormalised Walsh–Hadamard transform of the group's vector, stages in the reference's
// order (span h = 1, 2, 4, ...; pairs (j, j + h) -> (a + b, a - b), each output rounded once).
// FIRST = 2: from span 2 on (the loader does span 1, fused with the sign multiply).
template <int D, int FIRST = 1>
__device__ __forceinline__ void group_fwht(float (&y)[D / 8], int g) {
  constexpr int V = D / 8;
#pragma unroll
  for (int h = FIRST; h < 4; h <<= 1) reg_butterfly<V>(y, h);   // spans 1, 2: register bits 0-1
#pragma unroll
  for (int m = 1; m < 8; m <<= 1) {          // spans 4, 8, 16: group-lane bits
    const float sgn = (g & m) ? -1.f : 1.f;  // lower lane: mine + other; upper: other - mine
#pragma unroll
    for (int i = 0; i < V; ++i) y[i] = fmaf(sgn, y[i], __shfl_xor_sync(ENC_FULL, y[i], m));
  }
#pragma unroll
  for (int h = 4; h < V; h <<= 1) reg_butterfly<V>(y, h);       // spans 32, 64: register bits 2-3
}

// ------------------------------------------------------------- cells without a search ----
// Exactness of the float32 path. With u = 2^-24
// (each float32 rounding: relative error <= u), L = log2 D and M the row's largest |midpoint|,
// the float32 t = z_j / ||x'|| (x' = (x - mu) sigma, z its unnormalised transform) differs
// from the float64 reference's by at most (L + 1) u sqrt(D) (L butterfly stages and the
// x - mu rounding, element-wise through ||x'||_1 <= sqrt(D) ||x'||) plus 20 u |t| (the
// radius: a sum of squares of span-1 outputs 19 additions deep, 23 u, under rsqrtf (2 ulp);
// sqrt(2) and the row's constant). Each row's test uses 2 (L + 1) u sqrt(D) + 48 u M, at
// least twice that: a coordinate within it of a midpoint (the uniform path tests the same
// distance in units of A = (t - mid0)/step + 1/2, widened by the rounding of A) sends its
// vector to the float64 pipeline. The scale s = ||z|| / sqrt(sum C[c]^2) is within 34 u
// (Lloyd–Max: the float32 sum of squared levels adds 20 u under a square root) or 24 u
// (uniform: the sum of squared odd integers is exact) of the exact value, so a scale 64
// (uniform: 48) float32 ulps or more from an fp16 rounding boundary rounds as the
// reference's does; a closer one is decided in float64 (enc_encode, ENC_SCALE).
constexpr float ENC_MAGIC = 12582912.0f;     // 1.5 * 2^23: v + MAGIC rounds v (|v| < 2^22) to an integer
constexpr int ENC_MAGIC_BITS = 0x4B400000;   // its bits; (v + MAGIC) - these bits = rint(v) (as int)
// Table blob (float words, built by cupy_kernels/encode.py `cell_tables`; both sides check
// ENC_WORDS): per bit row (1, 2, 3, 4, 8) ENC_PRM parameters; the Lloyd–Max kernel also
// reads the squared levels (float32, 5 x 256) and the buckets: their midpoints (float) and
// the cell below each bucket (int), ENC_NB of each, row b at EncRow<b>::OFF.
constexpr int ENC_PRM = 8;
constexpr int ENC_LEV2 = 5 * ENC_PRM;
constexpr int ENC_BM = ENC_LEV2 + 5 * 256;
constexpr int ENC_NB = 8 + 32 + 64 + 128 + 768;
constexpr int ENC_BC = ENC_BM + ENC_NB;
constexpr int ENC_WORDS = ENC_BC + ENC_NB;
// Parameters of a row: [0] uniform: 1/(step (2^B - 1)); table: 1/bucket width; [1] offset of
// the index (uniform: divided by 2^B - 1 too); [2] table: largest bucket (the clamp of the
// 8-bit row); [3] uniform: |A - rint(A)| >= this is too close to a boundary; table:
// |t - m| <= this is; [4] sqrt(D/2) (uniform: over the half step); [5] (int) the scale's
// guard in float32 ulps; [6] table: (int) -4 ENC_MAGIC_BITS.
template <int B> struct EncRow;
template <> struct EncRow<1> { static constexpr int G = 8, OFF = 0; };
template <> struct EncRow<2> { static constexpr int G = 32, OFF = 8; };
template <> struct EncRow<3> { static constexpr int G = 64, OFF = 40; };
template <> struct EncRow<4> { static constexpr int G = 128, OFF = 104; };
template <> struct EncRow<8> { static constexpr int G = 768, OFF = 232; };

// z = span-1 butterflies of x' = (x - mu) sigma for the lane's coordinates: a + b =
// fma(x0, s0, x1 s1) rounds the exact sum of the exact products once, like adding x'0 and
// x'1 (x - mu is rounded once first when centred; the bound counts it).
template <int D, bool CENTRED>
__device__ __forceinline__ void enc_load(float (&z)[D / 8], const float4* xs,
                                          const float* __restrict__ sg,
                                          const float* __restrict__ mu) {
#pragma unroll
  for (int k = 0; k < D / 32; ++k) {
    float4 xv = xs[8 * k];
    const float4 sv = __ldg(reinterpret_cast<const float4*>(sg + 32 * k));
    if (CENTRED) {
      const float4 mv = __ldg(reinterpret_cast<const float4*>(mu + 32 * k));
      xv.x -= mv.x; xv.y -= mv.y; xv.z -= mv.z; xv.w -= mv.w;
    }
    const float b0 = xv.y * sv.y, b1 = xv.w * sv.w;
    z[4 * k] = fmaf(xv.x, sv.x, b0);
    z[4 * k + 1] = fmaf(xv.x, sv.x, -b0);
    z[4 * k + 2] = fmaf(xv.z, sv.z, b1);
    z[4 * k + 3] = fmaf(xv.z, sv.z, -b1);
  }
}

__device__ __forceinline__ void enc_cp_async16(void* smem, const void* gmem) {
  const u32 s = (u32)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void enc_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void enc_cp_async_wait() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Uniform codebook: the cell of t is clamp(rint(A), 0, 2^B - 1) with A = (t - mid0)/step + 1/2
// (the midpoints sit at half-integers of A; a tie is a near boundary, so rint's tie rule never
// decides a code). The kernel forms A_s = sat(A / (2^B - 1)) in one fma.sat (NaN -> 0) and
// rounds A_s (2^B - 1) + MAGIC in one fma (the product is exact inside it); d = A - rint(A) is
// exact up to 2^-25. c[i] gets the bits of rint(A) + MAGIC (the packer drops MAGIC's bits);
// sumsq the sum of the squared odd integers 2c + 1 - 2^B, exact in float32 (< 2^24). The width
// comes from the row (prm[2] = 2^B - 1): one loop serves every width (enc_encode).
template <int V>
__device__ __forceinline__ bool enc_cells_uniform(const float (&z)[V], float kt,
                                                   const float* prm, int (&c)[V], float& sumsq) {
  const float k = kt * prm[0], o = prm[1], hi = prm[2], thr = prm[3];
  bool near = false;
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const float as = __saturatef(fmaf(z[i], k, o));
    const float ar = fmaf(as, hi, ENC_MAGIC);
    const float r = ar - ENC_MAGIC;                 // rint(A), exact
    near |= fabsf(fmaf(as, hi, -r)) >= thr;
    const float odd = fmaf(2.f, r, -hi);
    s = fmaf(odd, odd, s);
    c[i] = __float_as_int(ar);
  }
  sumsq = s;
  return near;
}

// Any codebook: bucket b = rint((t - lo)/w) of a grid fine enough that the bucket, widened by
// more than the float32 error of t and of the index, holds at most one midpoint m; the cell
// is (cell below the bucket) + (t > m), and |t - m| <= margin is a near boundary. Rows of
// 1-4 bits span |t| <= sqrt(D) + 1/2 (|t| <= sqrt(D) (1 + 2^-18) whenever the radius is in
// range), so their index needs no clamp; the 8-bit row clamps (CLAMP), and so does every row
// at D >= WIDE_DIM, where a grid over all of |t| <= 16.5 would be too coarse. sumsq: sum of the
// float32 squared levels. The row (lr: level_row, off: EncRow::OFF) comes at run time: one
// loop serves 1-4 bits, one more 8 bits (enc_encode).
template <bool CLAMP, int V>
__device__ __forceinline__ bool enc_cells_table(const float (&z)[V], float kt, const float* tab,
                                                 int lr, int off, int (&c)[V], float& sumsq) {
  const float* prm = tab + lr * ENC_PRM;
  const float k = kt * prm[0], o = prm[1], hi = prm[2], margin = prm[3];
  // shared addresses: bucket b's midpoint at bm + 4b (its cell ENC_NB words further), minus
  // the MAGIC bits so that the rounded float's bits index the table in one multiply-add
  // (the offset -4 MAGIC_BITS comes from the table, prm[6]: a compile-time constant would be
  // folded back into every address, one more add per look-up)
  const u32 bm = (u32)__cvta_generic_to_shared(tab + ENC_BM + off) + (u32)__float_as_int(prm[6]);
  const u32 l2 = (u32)__cvta_generic_to_shared(tab + ENC_LEV2 + lr * 256);
  bool near = false;
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    float a = fmaf(z[i], k, o);
    if (CLAMP) a = fminf(fmaxf(a, 0.f), hi);
    const u32 addr = 4u * (u32)__float_as_int(a + ENC_MAGIC) + bm;
    float m, l;
    int c0;
    asm("ld.shared.f32 %0, [%1];" : "=f"(m) : "r"(addr));
    asm("ld.shared.s32 %0, [%1+%2];" : "=r"(c0) : "r"(addr), "n"(4 * ENC_NB));
    const float e = fmaf(-z[i], kt, m);                // m - t, one rounding: negative iff t > m
    near |= fabsf(e) <= margin;
    const int cc = c0 + (int)(__float_as_uint(e) >> 31);
    asm("ld.shared.f32 %0, [%1];" : "=f"(l) : "r"(l2 + 4u * (u32)cc));
    c[i] = cc;
    s += l;
  }
  sumsq = s;
  return near;
}

// Packs and stores the lane's codes (bits of each code + `bias`, bias's low 8 bits zero) into
// the vector's code bytes `row` (docs/format.md). Lane g's chunk k (coordinates 32k + 4g ..
// +3) is 4B bits at byte (32k + 4g) B / 8: a byte (2 bits), a 16-bit half (4), a word (8); at
// 1 bit (and the 3-bit plane) a nibble, merged with the neighbouring lane's into a byte.
template <int B, int D>
__device__ __forceinline__ void enc_store_codes(const int (&c)[D / 8], unsigned char* row,
                                                 int g, u32 gmask) {
#pragma unroll
  for (int k = 0; k < D / 32; ++k) {
    const u32 c0 = c[4 * k], c1 = c[4 * k + 1], c2 = c[4 * k + 2], c3 = c[4 * k + 3];
    if (B == 4) {   // MAGIC * (1 + 16 + 256 + 4096) has 16 low zero bits
      const u32 h = c0 + 16u * (c1 + 16u * (c2 + 16u * c3));
      *reinterpret_cast<unsigned short*>(row + 16 * k + 2 * g) = (unsigned short)h;
    } else if (B == 2) {
      const u32 h = c0 + 4u * (c1 + 4u * (c2 + 4u * c3));
      row[8 * k + g] = (unsigned char)h;
    } else if (B == 8) {
      const u32 w = __byte_perm(__byte_perm(c0, c1, 0x0040u), __byte_perm(c2, c3, 0x0040u), 0x5410u);
      *reinterpret_cast<u32*>(row + 32 * k + 4 * g) = w;
    } else {        // 1 bit, or 3 bits: the 2-bit fields, then the bit-2 plane
      u32 nib;
      int plane_byte;
      if (B == 3) {
        const u32 f = (c0 & 3u) + 4u * ((c1 & 3u) + 4u * ((c2 & 3u) + 4u * (c3 & 3u)));
        row[8 * k + g] = (unsigned char)f;
        nib = ((c0 >> 2) & 1u) | ((c1 >> 1) & 2u) | (c2 & 4u) | ((c3 << 1) & 8u);
        plane_byte = 4 * ((2 * D + 31) / 32);
      } else {
        nib = (c0 + 2u * (c1 + 2u * (c2 + 2u * c3))) & 15u;
        plane_byte = 0;
      }
      const u32 other = __shfl_xor_sync(gmask, nib, 1);
      if ((g & 1) == 0) row[plane_byte + 4 * k + (g >> 1)] = (unsigned char)(nib | (other << 4));
    }
  }
}

// The bucket row of a width (EncRow<B>::OFF) at run time.
__device__ __forceinline__ int enc_row_off(int bits) {
  return bits == 8 ? EncRow<8>::OFF : bits == 4 ? EncRow<4>::OFF : bits == 3 ? EncRow<3>::OFF
       : bits == 2 ? EncRow<2>::OFF : EncRow<1>::OFF;
}

// enc_store_codes at a width known at run time.
template <int D>
__device__ __forceinline__ void enc_store_codes_at(int bits, const int (&c)[D / 8],
                                                    unsigned char* row, int g, u32 gmask) {
  switch (bits) {
    case 1: enc_store_codes<1, D>(c, row, g, gmask); break;
    case 2: enc_store_codes<2, D>(c, row, g, gmask); break;
    case 3: enc_store_codes<3, D>(c, row, g, gmask); break;
    case 4: enc_store_codes<4, D>(c, row, g, gmask); break;
    default: enc_store_codes<8, D>(c, row, g, gmask); break;
  }
}

// What enc_encode did with the group's vector.
enum EncOutcome { ENC_DONE = 0, ENC_SCALE = 1, ENC_SLOW = 2 };

// Relative distance of ||x'||^2 D from m^2 c2 below which the float64 scale decision defers the
// vector (enc_encode, ENC_SCALE): on the uniform codebook c2 is within O(2^-52), on any other
// (the float32 sum of the float32 squares of the levels: 16 in-lane additions and 3 across the
// group, each square rounded once) within 18.5 u = 2^-19.8.
template <bool UNIFORM> __device__ __forceinline__ double enc_scale_tol() { return UNIFORM ? 0x1p-40 : 0x1p-18; }

// Quantises the group's vector (z: unnormalised transform; kt = sqrt(D)/||z||; rz = ||z|| /
// sqrt(D/2)) at `bits` bits (1, 2, 3, 4 or 8). The width is a run-time value: one cells loop
// serves every width (the Lloyd–Max kernel: one for 1-4 bits and one for 8), only the packing
// is per width, so the tiers of an RDR mix run the same code (a loop per width took 12-15 %
// longer on the Lloyd–Max mix, 2-5 % on the uniform one, and 1-3 % less on one-tier pools:
// docs/PERF_NOTES.md). ENC_DONE: no coordinate or scale near a rounding boundary, codes and
// scale written. ENC_SCALE: only the scale's fp16 rounding is in doubt, codes written, mid16
// (m) and ssq set for encode_body's float64 decision. ENC_SLOW: the vector needs the float64
// pipeline. Called by whole groups (8 lanes) only.
template <bool UNIFORM, int D>
__device__ __forceinline__ int enc_encode(const float (&z)[D / 8], float kt, float rz,
                                           const float* tab, int bits, unsigned char* row,
                                           __half* scale, int g, u32 gmask, float& mid16,
                                           float& ssq) {
  int c[D / 8];
  float sumsq;
  const int lr = level_row(bits);
  bool near;
  if constexpr (UNIFORM) {
    near = enc_cells_uniform<D / 8>(z, kt, tab + lr * ENC_PRM, c, sumsq);
  } else {
    if (bits == 8) near = enc_cells_table<true, D / 8>(z, kt, tab, lr, EncRow<8>::OFF, c, sumsq);
    // 1-4 bits: no clamp, except at wide head dims, whose bucket grids span the midpoints
    // only (cupy_kernels/encode.py _bucket_row)
    else near = enc_cells_table<(D >= WIDE_DIM), D / 8>(z, kt, tab, lr, enc_row_off(bits), c, sumsq);
  }
#pragma unroll
  for (int m = 1; m < 8; m <<= 1) sumsq += __shfl_xor_sync(gmask, sumsq, m);
  // s = ||z|| / sqrt(sum C[c]^2) with ||z|| = rz * prm[4] (prm[4] = sqrt(D/2), over hs on the
  // uniform path, where C[c] = hs (2c + 1 - 2^B) makes sqrt(sum) = hs sqrt(sumsq))
  const float sf = rz * (rsqrtf(sumsq) * tab[lr * ENC_PRM + 4]);
  const int guard = __float_as_int(tab[lr * ENC_PRM + 5]);   // float32 ulps
  // sf is the same on the group's lanes: the codes decide `cells`, the scale `close`
  const bool cells = __any_sync(gmask, near || !(sf >= 0x1p-14f && sf < 65000.0f));
  const bool close = abs((__float_as_int(sf) & 0x1fff) - 0x1000) <= guard;
  if (!cells && !close) {
    enc_store_codes_at<D>(bits, c, row, g, gmask);
    if (g == 0) *scale = __float2half_rn(sf);
    return ENC_DONE;
  }
  if (!cells) {
    // Only the scale's fp16 rounding is in doubt: sf lies near the midpoint m between two fp16
    // values (sf's bits with the 13 below fp16 precision set to 0x1000: exact in float32), and
    // the codes are the reference's: stored now. The reference's s = ||x'|| / sqrt(c2 / D),
    // c2 = sum C[c]^2, rounds up iff ||x'||^2 D > m^2 c2, which encode_body decides in
    // float64 with ||x'||^2 read by the whole warp (the rotation keeps the norm), from ssq =
    // sumsq: on the uniform codebook c2 = hs^2 ssq (ssq the exact sum of the squared odd
    // integers, hs = C[2^(B-1)]: the reference's levels are fl(hs (2c + 1 - 2^B))), on any
    // other c2 = ssq, within 2^-19.8 (enc_scale_tol).
    ssq = sumsq;
    enc_store_codes_at<D>(bits, c, row, g, gmask);
    mid16 = __int_as_float((__float_as_int(sf) & ~0x1fff) | 0x1000);
    return ENC_SCALE;
  }
  return ENC_SLOW;
}

template <int D, bool UNIFORM>
__device__ __forceinline__ void encode_body(
    const float* __restrict__ x, long long x_row_stride, int n, const int* __restrict__ head,
    const float* __restrict__ sigma, const float* __restrict__ mean,
    const int* __restrict__ mean_index, const int* __restrict__ dst_page,
    const int* __restrict__ dst_slot, int part, u32* __restrict__ pages, int page_words,
    const int* __restrict__ page_tier, const int* __restrict__ geom, int num_tiers,
    const double* __restrict__ levels, const double* __restrict__ mids, const float* tab,
    float4* xw, int* __restrict__ status) {
  constexpr int V = D / 8;
  const int lane = threadIdx.x & 31, g = lane & 7, q = lane >> 3;
  const u32 gmask = 0xffu << (lane & 24);
  const int step = ((gridDim.x * blockDim.x) >> 5) * 4;
  float4* xs = xw + q * (D / 4) + g;   // this lane's float4 of its vector's row: xs[8k]

  int base = ((blockIdx.x * blockDim.x + threadIdx.x) >> 5) * 4;
  // The first vector's indices and row; later ones are fetched one iteration ahead.
  int ii = min(base + q, n - 1);       // idle groups redo a valid vector and write nothing
  int hd = head[ii], pg = dst_page[ii], sl = dst_slot[ii], mi = mean ? mean_index[ii] : 0;
  {
    const float* xi = x + (long long)ii * x_row_stride + 4 * g;
#pragma unroll
    for (int k = 0; k < D / 32; ++k) enc_cp_async16(xs + 8 * k, xi + 32 * k);
    enc_cp_async_commit();
  }
  int tier = page_tier[pg];
  for (; base < n; base += step) {
    const bool live = base + q < n;
    const int nii = min(base + step + q, n - 1);
    const int hd2 = head[nii], pg2 = dst_page[nii], sl2 = dst_slot[nii];
    const int mi2 = mean ? mean_index[nii] : 0;

    // (x - mu) * sigma from the staged row, fused with the first butterfly stage (span 1);
    // then the slots take the next vector's row.
    float z[V];
    enc_cp_async_wait();
    if (mean) enc_load<D, true>(z, xs, sigma + (size_t)hd * D + 4 * g, mean + (size_t)mi * D + 4 * g);
    else enc_load<D, false>(z, xs, sigma + (size_t)hd * D + 4 * g, nullptr);
    {
      const float* xi = x + (long long)nii * x_row_stride + 4 * g;
#pragma unroll
      for (int k = 0; k < D / 32; ++k) enc_cp_async16(xs + 8 * k, xi + 32 * k);
      enc_cp_async_commit();
    }
    const int tier2 = page_tier[pg2];

    // Radius from the span-1 outputs (their squares sum to 2 ||x'||^2, x' = (x - mu) sigma):
    // rinv = rsqrt(2 ||x'||^2), so kt = sqrt(D)/||z|| = sqrt(2) rinv and ||z|| = sqrt(D/2) rz.
    // NaN/Inf input, a zero or tiny radius and squares that could overflow all leave r2
    // outside [1e-30, 1e30]: the float64 pipeline takes them.
    float r2 = 0.f;
#pragma unroll
    for (int k = 0; k < V; ++k) r2 = fmaf(z[k], z[k], r2);
    r2 = group_sum(r2);
    const bool r_ok = r2 >= 1e-30f && r2 <= 1e30f;
    const float rinv = rsqrtf(r2);
    const float kt = 1.41421356f * rinv, rz = r2 * rinv;
    group_fwht<D, 2>(z, g);   // span 1 was fused into the load

    // Destination checks in the order of the float64 pipeline: tier, then slot (then the input: r_ok). The
    // tier's geometry row (8 ints, 32-byte aligned) in two 16-byte loads.
    const bool tier_ok = tier >= 1 && tier <= num_tiers;
    const int4* gm = reinterpret_cast<const int4*>(geom + (tier_ok ? tier : 1) * SKV_GEOM_STRIDE);
    const int4 g0 = __ldg(gm), g1 = __ldg(gm + 1);   // {kbits, vbits, P, kwords}, {vwords, voff, ksoff, vsoff}
    const bool slot_ok = sl >= 0 && sl < g0.z;
    const bool ok = live && tier_ok && slot_ok;
    if (live && !ok && g == 0) atomicOr(status, tier_ok ? ST_BAD_SLOT : ST_BAD_TIER);
    const int bits = part == 0 ? g0.x : g0.y;

    bool slow = ok, scale_due = false;
    float sm = 0.f, ssq = 0.f;   // ENC_SCALE: the fp16 midpoint near the scale, and sumsq
    if (ok && r_ok && bits != 16) {   // group-uniform
      // page bytes < 2^31 (a page of 4 KiB by default): byte offsets inside it are ints
      unsigned char* pgb = reinterpret_cast<unsigned char*>(pages + (size_t)pg * page_words);
      unsigned char* row = pgb + 4 * (part == 0 ? sl * g0.w : g1.y + sl * g1.x);
      __half* sc = reinterpret_cast<__half*>(pgb + (part == 0 ? g1.z : g1.w) + 2 * sl);
      const int out = enc_encode<UNIFORM, D>(z, kt, rz, tab, bits, row, sc, g, gmask, sm, ssq);
      slow = out == ENC_SLOW;
      scale_due = out == ENC_SCALE;
    }

    // The scales in doubt (ENC_SCALE), one vector at a time, the whole warp reading its x' in
    // float64 as the pipeline below does: rounded up iff ||x'||^2 D > m^2 c2, unless the two
    // are within enc_scale_tol (then the vector joins the float64 pipeline).
    // Lane 8q of group q hands its vector to the whole warp: y = x' = (x - mu) sigma in float64
    // (the float64 pipeline's layout: lane l, coordinates l D/32 ..), whether x' holds NaN/Inf, its destination.
    auto take = [&](int src, double (&y)[D / 32], bool& bad) {
      const int v = __shfl_sync(ENC_FULL, ii, src), vh = __shfl_sync(ENC_FULL, hd, src);
      const int vp = __shfl_sync(ENC_FULL, pg, src), vs = __shfl_sync(ENC_FULL, sl, src);
      const int vm = __shfl_sync(ENC_FULL, mi, src), vt = __shfl_sync(ENC_FULL, tier, src);
      bad = warp_load_centred<D>(y, x + (long long)v * x_row_stride, sigma + (size_t)vh * D,
                                 mean ? mean + (size_t)vm * D : nullptr, lane);
      return EncodeDest(pages, page_words, vp, vs, geom + vt * SKV_GEOM_STRIDE, part);
    };

    u32 due = __ballot_sync(ENC_FULL, scale_due && g == 0);
    while (due) {
      const int src = __ffs(due) - 1;
      due &= due - 1;
      double y[D / 32];
      bool bad;   // never: the float32 radius was in range
      const EncodeDest dv = take(src, y, bad);
      double r2 = 0.0;
#pragma unroll
      for (int k = 0; k < D / 32; ++k) r2 = fma(y[k], y[k], r2);
      const float m = __shfl_sync(ENC_FULL, sm, src);
      double c2 = __shfl_sync(ENC_FULL, ssq, src);
      if (UNIFORM) {
        const double hs = levels[level_row(dv.bits) * 256 + (1 << (dv.bits - 1))];
        c2 *= hs * hs;
      }
      const double lhs = warp_sum(r2) * D, rhs = (double)m * m * c2;
      if (fabs(lhs - rhs) <= enc_scale_tol<UNIFORM>() * rhs) {
        if ((lane >> 3) == (src >> 3)) slow = true;
      } else if (lane == 0) {
        *dv.scale = lhs > rhs ? __float2half_ru(m) : __float2half_rz(m);
      }
    }

    // Float64 pipeline for the groups that need it, one vector at a time, the whole
    // warp on it.
    u32 todo = __ballot_sync(ENC_FULL, slow && g == 0);
    while (todo) {
      const int src = __ffs(todo) - 1;
      todo &= todo - 1;
      double y[D / 32];
      bool bad;
      const EncodeDest dv = take(src, y, bad);
      if (__any_sync(ENC_FULL, bad)) {
        if (lane == 0) atomicOr(status, ST_NONFINITE);
        continue;
      }
      const int lr = dv.bits == 16 ? 0 : level_row(dv.bits);
      warp_fwht<D>(y, lane);
      const double inv = 1.0 / sqrt((double)D);
#pragma unroll
      for (int k = 0; k < D / 32; ++k) y[k] *= inv;
      const int st = warp_encode<D>(y, dv.bits, levels + lr * 256, mids + lr * 256, dv.codes,
                                    dv.scale, lane);
      if (st && lane == 0) atomicOr(status, st);
    }
    ii = nii; hd = hd2; pg = pg2; sl = sl2; mi = mi2; tier = tier2;
  }
  enc_cp_async_wait();   // the last prefetch (of a row nobody encodes) lands before exit
}

#define SKV_ENCODE_PARAMS                                                                   \
  const float* __restrict__ x, long long x_row_stride, int n, const int* __restrict__ head,    \
      const float* __restrict__ sigma, const float* __restrict__ mean,                         \
      const int* __restrict__ mean_index, const int* __restrict__ dst_page,                    \
      const int* __restrict__ dst_slot, int part, u32* __restrict__ pages, int page_words,     \
      const int* __restrict__ page_tier, const int* __restrict__ geom, int num_tiers,          \
      const double* __restrict__ levels, const double* __restrict__ mids,                      \
      const float* __restrict__ tables, int* __restrict__ status, const float* __restrict__ x2, \
      long long x2_row_stride, const float* __restrict__ sigma2, const float* __restrict__ mean2

// Any codebook (bucket tables in shared memory, 9.3 KiB) and the uniform one (parameters
// only). 256 threads; each warp owns 4 x D floats of shared memory for the staged rows.
// The block of either encode kernel: its shared table (bucket tables, or the uniform codebook's
// parameters), then encode_body with each warp's slice of the staged rows. A grid of two
// rows of blocks (gridDim.y = 2, part 0) encodes keys and values in one launch: row 1 reads
// the values' x2, sigma2 and mean2 (the same heads, destinations and mean rows) as part 1;
// with one row x2, sigma2, mean2 are unused.
template <int D, bool UNI>
__device__ __forceinline__ void encode_block(SKV_ENCODE_PARAMS) {
  constexpr int TAB = UNI ? ENC_LEV2 : ENC_WORDS;
  __shared__ float tab[TAB];
  __shared__ float4 xw[8 * D];
  for (int k = threadIdx.x; k < TAB; k += blockDim.x) tab[k] = tables[k];
  __syncthreads();
  const bool vrow = blockIdx.y != 0;   // the values' row of a two-part launch
  encode_body<D, UNI>(vrow ? x2 : x, vrow ? x2_row_stride : x_row_stride, n, head,
                         vrow ? sigma2 : sigma, vrow ? mean2 : mean, mean_index, dst_page,
                         dst_slot, vrow ? 1 : part, pages, page_words, page_tier, geom, num_tiers,
                         levels, mids, tab, xw + (threadIdx.x >> 5) * D, status);
}

template <int D>
__global__ void __launch_bounds__(ENC_THREADS, D >= WIDE_DIM ? ENC_CTAS_WIDE : ENC_CTAS)
    encode_table_kernel(SKV_ENCODE_PARAMS) {
  encode_block<D, false>(x, x_row_stride, n, head, sigma, mean, mean_index, dst_page,
                            dst_slot, part, pages, page_words, page_tier, geom, num_tiers, levels,
                            mids, tables, status, x2, x2_row_stride, sigma2, mean2);
}

template <int D>
__global__ void __launch_bounds__(ENC_THREADS, D >= WIDE_DIM ? ENC_CTAS_WIDE : ENC_CTAS)
    encode_affine_kernel(SKV_ENCODE_PARAMS) {
  encode_block<D, true>(x, x_row_stride, n, head, sigma, mean, mean_index, dst_page,
                           dst_slot, part, pages, page_words, page_tier, geom, num_tiers, levels,
                           mids, tables, status, x2, x2_row_stride, sigma2, mean2);
}
#undef SKV_ENCODE_PARAMS

}  // namespace skv
