// Shared device code for the Spherical KV kernels (docs/format.md is the contract).
//
// Thread -> data maps live in the kernels that use these helpers; this file only holds
//   * the page geometry table (one row per tier, built on the host),
//   * code -> fp16 look-up tables in shared memory (one entry per *pair* of codes, so one
//     shared load yields a half2 of two coordinates),
//   * per-"group" code loads: a group is 8 consecutive coordinates (one uint32 word at
//     4 bits), the unit both the decode and the encode kernels move,
//   * a float64 encoder for one vector held by one warp (rotation already applied),
//   * the tensor-core mma wrapper.
// Everything here compiles under NVRTC (only <cuda_fp16.h> is included).
#pragma once
#include <cuda_fp16.h>

namespace skv {

typedef unsigned int u32;
typedef unsigned long long u64;

// +inf without <math.h> (NVRTC has no host headers)
#define SKV_INF __int_as_float(0x7f800000)

// ---------------------------------------------------------------- page geometry ----
// geom[t * GEOM_STRIDE + field], t = tier index 0..T (row 0 unused: evicted/free).
enum GeomField {
  G_KBITS = 0,    // key bits per coordinate (1, 2, 3, 4, 8 or 16)
  G_VBITS = 1,    // value bits per coordinate
  G_P = 2,        // states per page
  G_KWORDS = 3,   // uint32 words of one key's codes
  G_VWORDS = 4,   // uint32 words of one value's codes
  G_VOFF = 5,     // word offset of the value codes inside the page (P * KWORDS)
  G_KSOFF = 6,    // byte offset of the key scales (fp16 [P]); -1: no scales (16 bits)
  G_VSOFF = 7,    // byte offset of the value scales; -1: none
};
#define SKV_GEOM_STRIDE 8

// Status bits raised by the encode / re-tier kernels (checked by the launcher).
enum StatusBits {
  ST_NONFINITE = 1,       // NaN/Inf in an input vector
  ST_SCALE_OVERFLOW = 2,  // r / ||c_hat|| > 65504: no fp16 scale
  ST_TOP_OVERFLOW = 4,    // |y_j| > 65504 in a 16-bit tier
  ST_BAD_TIER = 8,        // destination/source page is free or its tier is out of range
  ST_BAD_SLOT = 16,       // slot >= states per page of that tier
  ST_PROMOTION = 32,      // a re-tier that would add bits (never allowed)
};

// Index of a bit width in the level tables ((5, 256) arrays: rows b = 1, 2, 3, 4, 8).
__device__ __forceinline__ int level_row(int bits) {
  return bits == 8 ? 4 : bits - 1;
}

// ---------------------------------------------------------------- look-up tables ----
// Pair tables: entry i is half2(C[code0], C[code1]) for the two coordinates of a pair.
//   1 bit : i = c0 | c1 << 1
//   2 bits: i = c0 | c1 << 2
//   3 bits: i = lo(c0) | lo(c1) << 2 | hi(c0) << 4 | hi(c1) << 5   (lo = low 2 bits, hi = bit 2;
//           the low fields and the bit plane are stored apart, docs/format.md)
//   4 bits: i = c0 | c1 << 4 (one byte of the packed words)
//   8 bits: single-level table of 256 halves.
// Look-ups land on random entries, so a single shared copy costs ~3.5 bank conflicts per
// warp access. The 1-, 2- and 4-bit tables are therefore replicated once per lane, entry i
// of lane l at word 32*i + l (bank l: conflict-free); the 3-bit table 8 times (word
// 8*i + l%8); the 8-bit table is shared. 37 KiB of shared memory in all (LUT_BYTES).
// Head dims from this one on are "wide": their kernels ask ptxas for fewer resident CTAs
// per SM (TABLE_CTAS_WIDE, AFF_CTAS_WIDE, ENC_CTAS_WIDE) so that no lane spills.
constexpr int WIDE_DIM = 256;
constexpr int LUT4_WORDS = 256 * 32, LUT2_WORDS = 16 * 32, LUT1_WORDS = 4 * 32, LUT3_WORDS = 64 * 8;
constexpr int LUT_BYTES = 4 * (LUT4_WORDS + LUT2_WORDS + LUT1_WORDS + LUT3_WORDS) + 2 * 256;

struct Luts {
  const __half2* l4;
  const __half2* l2;
  const __half2* l1;
  const __half2* l3;
  const __half* l8;
  int lane;
};

// Builds the tables at `base` (LUT_BYTES of shared memory) and returns the lane's view.
__device__ __forceinline__ Luts build_luts(unsigned char* base, const float* __restrict__ levels,
                                           int tid, int nthreads) {
  __half2* l4 = reinterpret_cast<__half2*>(base);
  __half2* l2 = l4 + LUT4_WORDS;
  __half2* l1 = l2 + LUT2_WORDS;
  __half2* l3 = l1 + LUT1_WORDS;
  __half* l8 = reinterpret_cast<__half*>(l3 + LUT3_WORDS);
  const float* L1 = levels;
  const float* L2 = levels + 256;
  const float* L3 = levels + 2 * 256;
  const float* L4 = levels + 3 * 256;
  for (int w = tid; w < LUT4_WORDS; w += nthreads) {
    int i = w >> 5;
    l4[w] = __floats2half2_rn(L4[i & 15], L4[i >> 4]);
  }
  for (int w = tid; w < LUT2_WORDS; w += nthreads) {
    int i = w >> 5;
    l2[w] = __floats2half2_rn(L2[i & 3], L2[i >> 2]);
  }
  for (int w = tid; w < LUT1_WORDS; w += nthreads) {
    int i = w >> 5;
    l1[w] = __floats2half2_rn(L1[i & 1], L1[i >> 1]);
  }
  for (int w = tid; w < LUT3_WORDS; w += nthreads) {
    int i = w >> 3;
    int c0 = (i & 3) | (((i >> 4) & 1) << 2);
    int c1 = ((i >> 2) & 3) | (((i >> 5) & 1) << 2);
    l3[w] = __floats2half2_rn(L3[c0], L3[c1]);
  }
  for (int i = tid; i < 256; i += nthreads) l8[i] = __float2half_rn(levels[4 * 256 + i]);
  Luts v;
  v.l4 = l4; v.l2 = l2; v.l1 = l1; v.l3 = l3; v.l8 = l8;
  v.lane = tid & 31;
  return v;
}

// Where a vector's code words are read from: a page staged in shared memory (32-bit shared
// addresses, ld.shared) or a page read in place from global memory (read-only cache).
struct SharedRow {
  u32 a;  // shared-space byte address of the vector's first word
  __device__ __forceinline__ u32 w(int i) const {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a + 4 * i));
    return v;
  }
  __device__ __forceinline__ uint2 w2(int i) const {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a + 4 * i));
    return v;
  }
  __device__ __forceinline__ float half_at(int byte_off) const {   // fp16 at a + byte_off
    unsigned short h;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(h) : "r"(a + byte_off));
    return __half2float(__ushort_as_half(h));
  }
  __device__ __forceinline__ SharedRow at(int words) const { SharedRow r; r.a = a + 4 * words; return r; }
};
struct GlobalRow {
  const u32* p;
  __device__ __forceinline__ u32 w(int i) const { return __ldg(p + i); }
  __device__ __forceinline__ uint2 w2(int i) const {
    return __ldg(reinterpret_cast<const uint2*>(p + i));
  }
  __device__ __forceinline__ float half_at(int byte_off) const {
    return __half2float(__ldg(reinterpret_cast<const __half*>(reinterpret_cast<const char*>(p) + byte_off)));
  }
  __device__ __forceinline__ GlobalRow at(int words) const { GlobalRow r; r.p = p + words; return r; }
};

// Raw bits of one group (8 coordinates) of a vector's codes. `row` points at the vector's
// first code word (a SharedRow or GlobalRow); `grp` is the group index
// (0 .. D/8-1).
template <int B>
struct Group;

template <> struct Group<1> {
  u32 bits;  // 8 one-bit codes in the low byte
  template <class R> __device__ __forceinline__ void load(const R& row, int grp, int) {
    bits = (row.w(grp >> 2) >> ((grp & 3) * 8)) & 0xffu;
  }
  __device__ __forceinline__ void zero() { bits = 0; }
  __device__ __forceinline__ __half2 pair(const Luts& lut, int p) const {
    return lut.l1[(((bits >> (2 * p)) & 3u) << 5) + lut.lane];
  }
};
template <> struct Group<2> {
  u32 bits;  // 8 two-bit codes in the low 16 bits
  template <class R> __device__ __forceinline__ void load(const R& row, int grp, int) {
    bits = (row.w(grp >> 1) >> ((grp & 1) * 16)) & 0xffffu;
  }
  __device__ __forceinline__ void zero() { bits = 0; }
  __device__ __forceinline__ __half2 pair(const Luts& lut, int p) const {
    return lut.l2[(((bits >> (4 * p)) & 15u) << 5) + lut.lane];
  }
};
template <> struct Group<3> {
  u32 bits;  // low 2-bit fields in bits 0..15, the bit-2 plane in bits 16..23
  // plane_word: word offset of the 1-bit plane = ceil(2D/32)
  template <class R> __device__ __forceinline__ void load(const R& row, int grp, int plane_word) {
    u32 lo = (row.w(grp >> 1) >> ((grp & 1) * 16)) & 0xffffu;
    u32 hi = (row.w(plane_word + (grp >> 2)) >> ((grp & 3) * 8)) & 0xffu;
    bits = lo | (hi << 16);
  }
  __device__ __forceinline__ void zero() { bits = 0; }
  __device__ __forceinline__ __half2 pair(const Luts& lut, int p) const {
    u32 i = ((bits >> (4 * p)) & 15u) | (((bits >> (16 + 2 * p)) & 3u) << 4);
    return lut.l3[(i << 3) + (lut.lane & 7)];
  }
};
template <> struct Group<4> {
  u32 bits;  // one word: nibble j = coordinate j of the group
  template <class R> __device__ __forceinline__ void load(const R& row, int grp, int) { bits = row.w(grp); }
  __device__ __forceinline__ void zero() { bits = 0; }
  __device__ __forceinline__ __half2 pair(const Luts& lut, int p) const {
    return lut.l4[(((bits >> (8 * p)) & 0xffu) << 5) + lut.lane];
  }
};
template <> struct Group<8> {
  u32 w0, w1;  // two words, one byte per coordinate
  template <class R> __device__ __forceinline__ void load(const R& row, int grp, int) {
    uint2 v = row.w2(2 * grp);
    w0 = v.x; w1 = v.y;
  }
  __device__ __forceinline__ void zero() { w0 = w1 = 0; }
  __device__ __forceinline__ __half2 pair(const Luts& lut, int p) const {
    u32 w = p < 2 ? w0 : w1;
    int s = (p & 1) * 16;
    return __halves2half2(lut.l8[(w >> s) & 0xffu], lut.l8[(w >> (s + 8)) & 0xffu]);
  }
};
template <> struct Group<16> {
  u32 w[4];  // fp16 values, coordinate 2p in the low half of word p
  template <class R> __device__ __forceinline__ void load(const R& row, int grp, int) {
    uint2 a = row.w2(4 * grp);
    uint2 b = row.w2(4 * grp + 2);
    w[0] = a.x; w[1] = a.y; w[2] = b.x; w[3] = b.y;
  }
  __device__ __forceinline__ void zero() { w[0] = w[1] = w[2] = w[3] = 0; }
  __device__ __forceinline__ __half2 pair(const Luts&, int p) const {
    u32 v = w[p];
    return *reinterpret_cast<const __half2*>(&v);
  }
};


__device__ __forceinline__ u32 h2_as_u32(__half2 h) { return *reinterpret_cast<u32*>(&h); }
__device__ __forceinline__ __half2 u32_as_h2(u32 v) { return *reinterpret_cast<__half2*>(&v); }

// ------------------------------------------------------- uniform codebook, no tables ----
// With the uniform codebook C[c] = hs * (2c - (2^B - 1)) (hs = half the step, docs/format.md),
// so the kernel feeds the tensor cores small integers in the code, exact in fp16, and
// multiplies hs into the per-state scale: no tables, no shared memory. AffineFields holds a
// group's code fields so that a pair holds coordinates (p, p + 4) of its group of 8 (the same
// fields land 16 bits apart after at most one prmt/imad per group), not (2p, 2p + 1) as the
// table path does; the kernel permutes the query the same way.

template <int B>
struct AffineFields;

template <> struct AffineFields<1> {
  u32 y;  // the group's byte b as b | b << 12: coordinate j at bit j, coordinate j + 4 at 16 + j
  template <class R> __device__ __forceinline__ void load(const R& row, int grp, int) {
    y = ((row.w(grp >> 2) >> ((grp & 3) * 8)) & 0xffu) * 0x1001u;
  }
  __device__ __forceinline__ void zero() { y = 0; }
};
template <> struct AffineFields<2> {
  u32 y;  // coordinates 0..3 of the group in bits 0..7, coordinates 4..7 in bits 16..23
  template <class R> __device__ __forceinline__ void load(const R& row, int grp, int) {
    y = __byte_perm(row.w(grp >> 1), 0u, 0x4140u + 0x202u * (grp & 1));
  }
  __device__ __forceinline__ void zero() { y = 0; }
};
template <> struct AffineFields<3> {
  u32 lo;  // low 2-bit fields laid out as AffineFields<2>
  u32 hi;  // bit-2 plane laid out as AffineFields<1>
  template <class R> __device__ __forceinline__ void load(const R& row, int grp, int plane_word) {
    lo = __byte_perm(row.w(grp >> 1), 0u, 0x4140u + 0x202u * (grp & 1));
    hi = ((row.w(plane_word + (grp >> 2)) >> ((grp & 3) * 8)) & 0xffu) * 0x1001u;
  }
  __device__ __forceinline__ void zero() { lo = hi = 0; }
};
template <> struct AffineFields<4> {
  u32 w;  // nibble j = coordinate j
  template <class R> __device__ __forceinline__ void load(const R& row, int grp, int) { w = row.w(grp); }
  __device__ __forceinline__ void zero() { w = 0; }
};
template <> struct AffineFields<8> {
  u32 w0, w1;  // bytes: coordinates 0..3, 4..7
  template <class R> __device__ __forceinline__ void load(const R& row, int grp, int) {
    uint2 v = row.w2(2 * grp);
    w0 = v.x; w1 = v.y;
  }
  __device__ __forceinline__ void zero() { w0 = w1 = 0; }
};
template <> struct AffineFields<16> {
  u32 w[4];  // fp16 values, coordinate 2m in the low half of word m
  template <class R> __device__ __forceinline__ void load(const R& row, int grp, int) {
    uint2 a = row.w2(4 * grp);
    uint2 b = row.w2(4 * grp + 2);
    w[0] = a.x; w[1] = a.y; w[2] = b.x; w[3] = b.y;
  }
  __device__ __forceinline__ void zero() { w[0] = w[1] = w[2] = w[3] = 0; }
  __device__ __forceinline__ __half2 pair(const Luts&, int p) const {
    return u32_as_h2(__byte_perm(w[p >> 1], w[2 + (p >> 1)], (p & 1) ? 0x7632u : 0x5410u));
  }
};

// ------------------------------------------- uniform codebook: lop3 + hfma2 per pair ----
// The affine path feeds the tensor cores u = c - 2^(B-1) (an integer in [-2^(B-1), 2^(B-1)), exact in
// fp16) instead of 2c - (2^B - 1) = 2u + 1; the kernel doubles the half step and adds the
// "+1" back once per head: + sum_j q'_j / 2 to a logit, + sum_i P'_i / 2 to an output.
// A field of B bits at bit POS of both halves (POS + B <= 10) is OR-ed into the mantissa of
// 0x6400 (= 1024) in one lop3 (mask and magic both immediates), which reads as
// 1024 + c * 2^POS; one fma.f16x2 by 2^-POS minus (1024 * 2^-POS + 2^(B-1)) gives u exactly
// (every operand and the result are exact in fp16). So a pair costs 2 instructions, plus a shift per two pairs at 4 bits.

// fp16 bits of a positive integer v < 2048 (exact).
__host__ __device__ constexpr u32 half_bits_of_int(u32 v, u32 e = 10) {
  return (v >> e) ? (((e + 15u) << 10) | ((v << (10u - e)) & 0x3ffu)) : half_bits_of_int(v, e - 1u);
}

template <int POS, int B>
__device__ __forceinline__ u32 dq_pair(u32 x) {
  static_assert(POS + B <= 10, "field must sit in the fp16 mantissa");
  constexpr u32 mask = (((1u << B) - 1u) << POS) * 0x10001u;
  constexpr u32 scale = ((15u - POS) << 10) * 0x10001u;                       // 2^-POS
  constexpr u32 bias = (0x8000u | half_bits_of_int((1024u >> POS) + (1u << (B - 1)))) * 0x10001u;
  u32 h, r;
  asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(h) : "r"(x), "n"(mask), "n"(0x64006400u));
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(h), "r"(scale), "r"(bias));
  return r;
}

// The affine path's groups: AffineFields' layout (pair p = coordinates p, p + 4 of the group),
// pairs by dq_pair.
template <int B>
struct AffineGroup;

template <> struct AffineGroup<1> : AffineFields<1> {
  __device__ __forceinline__ __half2 pair(const Luts&, int p) const {
    switch (p) {
      case 0: return u32_as_h2(dq_pair<0, 1>(y));
      case 1: return u32_as_h2(dq_pair<1, 1>(y));
      case 2: return u32_as_h2(dq_pair<2, 1>(y));
      default: return u32_as_h2(dq_pair<3, 1>(y));
    }
  }
};
template <> struct AffineGroup<2> : AffineFields<2> {
  __device__ __forceinline__ __half2 pair(const Luts&, int p) const {
    switch (p) {
      case 0: return u32_as_h2(dq_pair<0, 2>(y));
      case 1: return u32_as_h2(dq_pair<2, 2>(y));
      case 2: return u32_as_h2(dq_pair<4, 2>(y));
      default: return u32_as_h2(dq_pair<6, 2>(y));
    }
  }
};
template <> struct AffineGroup<3> : AffineFields<3> {
  // c = lo + 4 hi at bit 2p: lo's field stays, hi's bit p moves to 2p + 2 (one shift).
  template <int P> __device__ __forceinline__ u32 at() const {
    constexpr u32 mlo = (3u << (2 * P)) * 0x10001u, mhi = (4u << (2 * P)) * 0x10001u;
    constexpr u32 scale = ((15u - 2 * P) << 10) * 0x10001u;
    constexpr u32 bias = (0x8000u | half_bits_of_int((1024u >> (2 * P)) + 4u)) * 0x10001u;
    u32 m, h, r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(m) : "r"(lo), "n"(mlo), "n"(0x64006400u));
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(h) : "r"(hi << (P + 2)), "n"(mhi), "r"(m));
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(h), "r"(scale), "r"(bias));
    return r;
  }
  __device__ __forceinline__ __half2 pair(const Luts&, int p) const {
    switch (p) {
      case 0: return u32_as_h2(at<0>());
      case 1: return u32_as_h2(at<1>());
      case 2: return u32_as_h2(at<2>());
      default: return u32_as_h2(at<3>());
    }
  }
};
template <> struct AffineGroup<4> : AffineFields<4> {
  __device__ __forceinline__ __half2 pair(const Luts&, int p) const {
    switch (p) {
      case 0: return u32_as_h2(dq_pair<0, 4>(w));
      case 1: return u32_as_h2(dq_pair<4, 4>(w));
      case 2: return u32_as_h2(dq_pair<0, 4>(w >> 8));
      default: return u32_as_h2(dq_pair<4, 4>(w >> 8));
    }
  }
};
template <> struct AffineGroup<8> : AffineFields<8> {
  __device__ __forceinline__ __half2 pair(const Luts&, int p) const {
    const u32 sel = (u32)p * 0x11u + (u32)(4 + p) * 0x1100u;   // bytes [p, p, 4+p, 4+p]
    return u32_as_h2(dq_pair<0, 8>(__byte_perm(w0, w1, sel)));
  }
};
template <> struct AffineGroup<16> : AffineFields<16> {};

// Decode paths: the table path (any codebook), the affine path (the uniform codebook).
enum DecodePath { PATH_TABLE = 0, PATH_AFFINE = 1 };

// The group type of a bit width on each path.
template <int B, int PATH> struct GroupOf { typedef Group<B> type; };
template <int B> struct GroupOf<B, PATH_AFFINE> { typedef AffineGroup<B> type; };

// D = A(16x16, row) * B(16x8, col) + C, fp16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3,
                                          u32 b0, u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// In-place unnormalised Walsh–Hadamard transform of `rows` vectors of length D in shared
// memory (row-major), all threads of the block taking part. Same butterfly order as the
// reference (pairs (i, i+h) inside blocks of 2h, h = 1, 2, 4, ...).
template <int D>
__device__ __forceinline__ void block_fwht(float* buf, int rows) {
  for (int h = 1; h < D; h <<= 1) {
    __syncthreads();
    for (int idx = threadIdx.x; idx < rows * (D / 2); idx += blockDim.x) {
      int r = idx / (D / 2), k = idx % (D / 2);
      int i = (k / h) * 2 * h + (k % h);
      float a = buf[r * D + i], b = buf[r * D + i + h];
      buf[r * D + i] = a + b;
      buf[r * D + i + h] = a - b;
    }
  }
  __syncthreads();
}

// ----------------------------------------------------------------- warp encoder ----
// One warp holds one vector: lane l owns coordinates l*V .. l*V+V-1 (V = D/32).

// Unnormalised Walsh–Hadamard transform of the warp's vector in block_fwht's stage order (span
// 1, 2, ...; pairs (j, j + h) -> (a + b, a - b)): spans below V inside the lane, the rest across
// lanes. T = double (the encoders' float64 pipeline) or float (the per-head merge's inverse rotation).
template <int D, class T>
__device__ __forceinline__ void warp_fwht(T (&y)[D / 32], int lane) {
  constexpr int V = D / 32;
#pragma unroll
  for (int h = 1; h < V; h <<= 1) {
#pragma unroll
    for (int i = 0; i < V; ++i) {
      if ((i & h) == 0) {
        T a = y[i], b = y[i + h];
        y[i] = a + b;
        y[i + h] = a - b;
      }
    }
  }
#pragma unroll
  for (int h = V; h < D; h <<= 1) {
    int m = h / V;  // partner lane distance
    bool upper = (lane & m) != 0;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      T other = __shfl_xor_sync(0xffffffffu, y[i], m);
      y[i] = upper ? other - y[i] : y[i] + other;
    }
  }
}

__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
  return v;
}

// Packs `nb` bits per coordinate (nb in 1, 2, 4, 8) of this lane's V codes and writes the
// words of a field array starting at dst. Each lane's chunk is V*nb bits, a power of two; up
// to 32 it never straddles a word; above (8 bits at D = 256: 64) the lane writes its V*nb/32
// whole words itself.
template <int D>
__device__ __forceinline__ void warp_pack_fields(const int (&code)[D / 32], int nb, int shift_down,
                                                 u32 mask, u32* dst, int lane) {
  constexpr int V = D / 32;
  int chunk_bits = V * nb;
  if constexpr (V > 4) {
    if (chunk_bits > 32) {   // nb = 8 (V <= 8): words of four codes
#pragma unroll
      for (int w = 0; w < V / 4; ++w) {
        u32 word = 0;
#pragma unroll
        for (int e = 0; e < 4; ++e) word |= ((u32)(code[4 * w + e] >> shift_down) & mask) << (8 * e);
        dst[lane * (V / 4) + w] = word;
      }
      return;
    }
  }
  u32 chunk = 0;
#pragma unroll
  for (int i = 0; i < V; ++i) chunk |= ((u32)(code[i] >> shift_down) & mask) << (i * nb);
  int bit0 = lane * chunk_bits;
  u32 word = chunk << (bit0 & 31);
  int lanes_per_word = 32 / chunk_bits;
  for (int m = 1; m < lanes_per_word; m <<= 1) word |= __shfl_xor_sync(0xffffffffu, word, m);
  if ((lane % lanes_per_word) == 0) dst[bit0 >> 5] = word;
}

// Levels and cell midpoints of every bit width (rows b = 1, 2, 3, 4, 8 of 256, float64),
// copied into shared memory by the whole block: the quantiser's tables for warp_encode
// (encode and re-tier kernels). Ends with a barrier.
struct QuantTables {
  double lev[5 * 256], mid[5 * 256];
  __device__ __forceinline__ void load(const double* __restrict__ levels,
                                       const double* __restrict__ mids) {
    for (int k = threadIdx.x; k < 5 * 256; k += blockDim.x) { lev[k] = levels[k]; mid[k] = mids[k]; }
    __syncthreads();
  }
  // Quantises y at `bits` with the tables of that width (warp_encode, below).
  template <int D>
  __device__ __forceinline__ int encode(const double (&y)[D / 32], int bits, u32* codes,
                                        __half* scale, int lane) const;
};

// Quantises and packs one rotated, centred vector y (float64, lane-distributed) at `bits`
// per coordinate into codes[] (+ *scale for bits < 16). lev/mid: the bit width's levels and
// midpoints (float64). Returns status bits (0 = fine). All lanes return the same value.
template <int D>
__device__ int warp_encode(const double (&y)[D / 32], int bits, const double* lev,
                           const double* mid, u32* codes, __half* scale, int lane) {
  constexpr int V = D / 32;
  int status = 0;
  if (bits == 16) {
    bool over = false;
    // lane l owns coordinates lV .. lV+V-1 = words lV/2 .. (l+1)V/2 - 1
#pragma unroll
    for (int i = 0; i < V; i += 2) {
      over |= fabs(y[i]) > 65504.0 || fabs(y[i + 1]) > 65504.0;
      __half2 h = __halves2half2(__double2half(y[i]), __double2half(y[i + 1]));
      codes[(lane * V + i) / 2] = h2_as_u32(h);
    }
    if (__any_sync(0xffffffffu, over)) status |= ST_TOP_OVERFLOW;
    return status;
  }
  double r2 = 0.0;
#pragma unroll
  for (int i = 0; i < V; ++i) r2 += y[i] * y[i];
  r2 = warp_sum(r2);
  double r = sqrt(r2);
  int code[V];
  double c2 = 0.0;
  const double tscale = r > 0.0 ? sqrt((double)D) / r : 0.0;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    int c = 0;
    if (r > 0.0) {
      // t = sqrt(D) * y / r, within an ulp of the reference's sqrt(d) * (y / r)
      const double t = y[i] * tscale;
      // the count of midpoints below t (a tie goes to the lower code), in `bits` halving
      // steps over the 2^bits - 1 sorted midpoints
      for (int h = 1 << (bits - 1); h > 0; h >>= 1) c += t > mid[c + h - 1] ? h : 0;
    }
    code[i] = c;
    c2 += lev[c] * lev[c];
  }
  c2 = warp_sum(c2);
  double s = 0.0;
  if (r > 0.0) {
    double chat = sqrt(c2 / (double)D);  // ||C[c] / sqrt(D)||
    s = r / chat;
    if (!(s <= 65504.0)) status |= ST_SCALE_OVERFLOW;
  }
  if (lane == 0) *scale = __double2half(s);
  if (bits == 3) {
    warp_pack_fields<D>(code, 2, 0, 3u, codes, lane);
    warp_pack_fields<D>(code, 1, 2, 1u, codes + (2 * D + 31) / 32, lane);
  } else {
    warp_pack_fields<D>(code, bits, 0, (1u << bits) - 1u, codes, lane);
  }
  return status;
}

template <int D>
__device__ __forceinline__ int QuantTables::encode(const double (&y)[D / 32], int bits, u32* codes,
                                                   __half* scale, int lane) const {
  const int lr = bits == 16 ? 0 : level_row(bits);
  return warp_encode<D>(y, bits, lev + lr * 256, mid + lr * 256, codes, scale, lane);
}

// Reads the code of coordinate j (0..D-1) of a vector stored at `bits` (< 16).
template <int D>
__device__ __forceinline__ int read_code(const u32* row, int bits, int j) {
  if (bits == 3) {
    int lo = (row[(2 * j) >> 5] >> ((2 * j) & 31)) & 3;
    int hi = (row[(2 * D + 31) / 32 + (j >> 5)] >> (j & 31)) & 1;
    return lo | (hi << 2);
  }
  int bit = j * bits;
  return (int)((row[bit >> 5] >> (bit & 31)) & ((1u << bits) - 1u));
}

}  // namespace skv
