// ADA paged decode: attention logits and values straight from spherical codes (docs/design.md §6).
//
// Thread -> data map
//   grid (num_splits, rows): one CTA per (sequence, kv-head) row and split of its page list;
//   the split takes pages [s*ceil(n/S), (s+1)*ceil(n/S)) of the row's n pages (affine path at D = 128:
//   pages 4s, 4s+1, 4s+2, 4s+3, then the same + 4S, + 8S, ..., interleaved; see decode_cta).
//   block = 4 warps; warp w walks the split's pages w, w+4, w+8, ... and, in each page, tiles
//   of 16 * NSUB states (table path: 16; affine path: 32 = two independent m16 sub-tiles per softmax step;
//   below, "tile" is one 16-state sub-tile). The warp serves all G <= 8 query heads of the kv-head's GQA group from one
//   read of the page (the heads are the n = 8 columns of the m16n8k16 tensor-core tile).
//   lane = 4*g + t  (g = lane / 4, t = lane % 4, the mma "group" and "thread in group"):
//   * logits  S^T[16 states, 8 heads] = K[16, D] . Q'^T[D, 8]: lane (g, t) decodes states
//     g and g+8 of the tile, coordinate groups t, t+4, t+8, ... (8 coordinates = one word
//     at 4 bits, so a warp load is 4 lanes x 4 bytes contiguous per state); every
//     coordinate group feeds two k16 chunks. Q' is held by the same lane for head g and the
//     same coordinates, so the permutation of the k axis is the same on both operands.
//   * values  O^T[D, 8 heads] += V^T[D, 16 states] . P'^T[16, 8], P' = p * s_V: lane (g, t)
//     decodes states 2t, 2t+1, 2t+8, 2t+9 and coordinate groups g, g+8 (D = 128); the
//     pair (2c, 2c+1) of a group fills rows g and g+8 of one m16 block. P' goes through a
//     256-byte shared tile per warp to change from the C layout to the B layout.
//   Pages stream through shared memory: each warp copies its next full page (cp.async, 16 B
//   per lane, 8 per lane for 4 KiB) while it decodes the current one from its other buffer,
//   so no global load sits on the dependent path (header -> codes -> logits -> scales ->
//   values). A partly filled page (at most one per row and tier) is read in place from
//   global memory instead, so no byte beyond its valid states is read. Look-up tables and
//   page buffers live in dynamic shared memory (decode_smem_bytes).
//   Online softmax per head in registers (base 2); the 4 warps' (m, l, O) merge through
//   shared memory at the end. One split: the CTA applies Pi_V^T (Walsh–Hadamard in shared
//   memory), adds mu_V and writes the output. Several splits: it writes (O / l, lse) to the
//   small partial buffers and ada_merge combines them. Nothing of size tokens x D exists.
//   The affine kernel (D = 128) decodes full pages of the 4/4 tier (page44), the 3/3 and the 2/2
//   tier (page_f2), the 8/8 tier (page_f8) and the 16/16 tier (page_f16) on fast paths (one
//   softmax step per page, staged and swizzled, codes as fp16 subnormals or fp16 words; their
//   own lane maps, described there) and every other page on the generic tile code above; at
//   D = 256 (WIDE_FAST_PAGES) the 4/4, 2/2, 3/3, 8/8 and 16/16 pages on page44w, page22w,
//   page33w, page88w and page1616w. It
//   starts each warp's page stream at kernel entry, before the query prologue (the query is
//   staged past the page buffers).
#pragma once
#include "spherical_common.cuh"

namespace skv {

constexpr int DEC_WARPS = 4;
constexpr int DEC_HEADS = 8;   // n of the mma tile: GQA groups up to 8 query heads
constexpr float DEC_LAZY_MAX = 4.0f;   // log2 slack of the running maximum (affine path, decode_page)

template <int D>
struct DecodeSmem {   // static part; tables and page buffers are dynamic (see below)
  float m[DEC_WARPS][DEC_HEADS];
  float l[DEC_WARPS][DEC_HEADS];
  __half ptile[DEC_WARPS][DEC_HEADS][32];  // P' of the current tile, [head][state]
  float qfac[DEC_HEADS];   // logit factor per head: max|q'| (q' stored / max|q'| in fp16)
  float qmu[DEC_HEADS];    // q . mu_K per head (0 without centring)
  float lse[DEC_HEADS];    // combined log2-sum-exp per head
  float kfac[DEC_HEADS];   // qfac * softmax scale * log2(e)
  float hstep[8];          // affine path: half step of the uniform codebook per level row
  float qhalf[DEC_HEADS];  // affine path: sum of the fp16 q' per head / 2
  uint2 qfrag[D / 16][32];  // affine path: the query's B fragments, [chunk][lane]
  int prange[2];            // affine path: the CTA's pages [prange[0] + pbeg, prange[0] + prange[1])
};

// The affine path adds the fast path's query fragment and per-head logit constants
// (page44); the table path keeps DecodeSmem (its 3 CTAs per SM have no 2 KiB to spare).
template <int D>
struct DecodeSmemAffine : DecodeSmem<D> {
  uint2 qfrag44[D / 16][32];          // [chunk][lane], see decode_cta
  __align__(16) float k12[DEC_HEADS][2];   // K1, K2 per head (page44)
};
// At D = 128 and 256 it adds the query fragments and logit constants of the 3/3, 2/2, 8/8 and
// 16/16 fast pages (D = 128: page_f2, page_f8, page_f16; D = 256: page22w, page33w, page88w,
// page1616w).
template <int D>
struct DecodeSmemFast : DecodeSmemAffine<D> {
  uint2 qfrag2[D / 16][32];                  // [chunk][lane], see decode_cta
  __align__(16) float k12b[2][DEC_HEADS][2];   // K1, K2 per head of the 2/2 [0] and 3/3 [1] tiers
  int pstride;   // pages between two of a warp's pages (interleaved splits: 4 S; affine_pages)
  uint2 qfrag8[D / 16][32];                  // 8/8 pages (page_f8): [chunk][lane], see decode_cta
  __align__(16) float k12c[2][DEC_HEADS][2];   // K1, K2 per head of the 8/8 [0] and 16/16 [1] tiers
};
// Shared address of the page stride of the interleaved splits (DecodeSmemFast only).
__device__ __forceinline__ u32 pstride_at(DecodeSmemFast<128>& sm) {
  return static_cast<u32>(__cvta_generic_to_shared(&sm.pstride));
}
template <class SM>
__device__ __forceinline__ u32 pstride_at(SM&) { return 0u; }
template <int D, bool AFFINE> struct SmemOf { typedef DecodeSmem<D> type; };
template <int D> struct SmemOf<D, true> { typedef DecodeSmemAffine<D> type; };
template <> struct SmemOf<128, true> { typedef DecodeSmemFast<128> type; };


// Dynamic shared memory: [LUT_BYTES tables][region], region = max(2 page buffers per warp,
// the per-warp output tiles of the final merge, which reuse it). The affine path stages the
// query past its page buffers: the launcher adds DEC_HEADS * (D + D / 32) floats (qs_at,
// decode_smem_bytes).
__host__ __device__ constexpr int decode_region_bytes(int D, int page_bytes) {
  return (DEC_WARPS * 2 * page_bytes > DEC_WARPS * DEC_HEADS * D * 4)
             ? DEC_WARPS * 2 * page_bytes : DEC_WARPS * DEC_HEADS * D * 4;
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;\n" ::); }
__device__ __forceinline__ void cp_async_wait0() { asm volatile("cp.async.wait_group 0;\n" ::); }

// Where the logit mma reads its B operand (the rotated query, fp16): the table path holds the
// whole fragment in registers (QRegs, 16 registers at D = 128); the affine path re-reads chunk c from shared
// memory once per 32-state step (QShared: one 8-byte ld.shared per chunk and lane,
// conflict-free), which frees those registers for a fourth CTA per SM.
template <int D>
struct QRegs {
  u32 v[D / 16][2];
  __device__ __forceinline__ void get(int c, u32& b0, u32& b1) const { b0 = v[c][0]; b1 = v[c][1]; }
};
struct QShared {
  u32 a;   // shared address of this lane's chunk 0; chunk c at a + 256 c ([chunk][lane] uint2)
  __device__ __forceinline__ void get(int c, u32& b0, u32& b1) const {
    // volatile: keeps the load inside the page loop (a hoisted copy would pin the registers)
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(b0), "=r"(b1) : "r"(a + 256 * c));
  }
};

__device__ __forceinline__ int tid_x() {
  int v;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(v));
  return v;
}
__device__ __forceinline__ int ctaid_x() {
  int v;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(v));
  return v;
}
__device__ __forceinline__ int ctaid_y() {
  int v;
  asm volatile("mov.u32 %0, %%ctaid.y;" : "=r"(v));
  return v;
}
__device__ __forceinline__ int lds_s32(u32 a) {   // not hoisted out of a loop (volatile)
  int v;
  asm volatile("ld.shared.s32 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}

// The query fragment source of a path: shared memory (SHARED: the affine path) or registers.
template <bool SHARED> struct QSource {
  template <int D>
  static __device__ __forceinline__ const QRegs<D>& of(const QShared&, const QRegs<D>& r) { return r; }
};
template <> struct QSource<true> {
  template <int D>
  static __device__ __forceinline__ const QShared& of(const QShared& s, const QRegs<D>&) { return s; }
};

// 8x8 transpose of 16-bit elements across the warp (the C fragment of the logit mma to the
// B fragment of the value mma, in registers).
__device__ __forceinline__ u32 transpose8x8(u32 x) {
  u32 y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

// Logit phase for NSUB sub-tiles of 16 states: s[u][0..3] = <q~[2t], c(st0)>, <q~[2t+1],
// c(st0)>, the same for st1, with st0 = tile0 + 16u + g, st1 = st0 + 8. The sub-tiles' mma
// chains are independent, so the scheduler interleaves them.
template <int B, int PATH, int D, int NSUB, class R, class QF>
__device__ __forceinline__ void tile_logits(const R& kbase, int kwords, int tile0, int count,
                                            const QF& qf, const Luts& lut, int g,
                                            int t, float (&s)[NSUB][4]) {
  constexpr bool UNI = PATH != PATH_TABLE;
  R r0[NSUB], r1[NSUB];
  bool ok0[NSUB], ok1[NSUB];
#pragma unroll
  for (int u = 0; u < NSUB; ++u) {
    const int st0 = tile0 + 16 * u + g, st1 = st0 + 8;
    ok0[u] = st0 < count;
    ok1[u] = st1 < count;
    r0[u] = kbase.at(st0 * kwords);
    r1[u] = kbase.at(st1 * kwords);
  }
  if constexpr (UNI && B == 16) {
    // fp16 top tier on the affine path: chunk (i, h) needs words h and 2 + h of the group
    // (coordinates 2h, 2h+1 and 2h+4, 2h+5); one prmt per operand, loads per chunk.
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        u32 b0, b1;
        qf.get(2 * i + h, b0, b1);
#pragma unroll
        for (int u = 0; u < NSUB; ++u) {
          const int w = 4 * (t + 4 * i) + h;
          const u32 x0 = ok0[u] ? r0[u].w(w) : 0u, y0 = ok0[u] ? r0[u].w(w + 2) : 0u;
          const u32 x1 = ok1[u] ? r1[u].w(w) : 0u, y1 = ok1[u] ? r1[u].w(w + 2) : 0u;
          mma_16816(s[u], __byte_perm(x0, y0, 0x5410u), __byte_perm(x1, y1, 0x5410u),
                    __byte_perm(x0, y0, 0x7632u), __byte_perm(x1, y1, 0x7632u), b0, b1);
        }
      }
    }
    return;
  }
  // Narrow codes are all loaded up front (more loads in flight); 8- and 16-bit groups
  // (2 and 4 words), and every group on the affine path (two sub-tiles), are loaded per
  // chunk, which keeps the affine kernels within their registers.
  constexpr bool EAGER = !UNI || (B < 8 && NSUB == 1);
  typename GroupOf<B, PATH>::type a[NSUB][D / 32], b[NSUB][D / 32];
#pragma unroll
  for (int u = 0; u < NSUB; ++u) {
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
      if (EAGER) {
        if (ok0[u]) a[u][i].load(r0[u], t + 4 * i, D / 16); else a[u][i].zero();
        if (ok1[u]) b[u][i].load(r1[u], t + 4 * i, D / 16); else b[u][i].zero();
      }
    }
  }
#pragma unroll
  for (int i = 0; i < D / 32; ++i) {
    u32 qb[2][2];
    qf.get(2 * i, qb[0][0], qb[0][1]);
    qf.get(2 * i + 1, qb[1][0], qb[1][1]);
#pragma unroll
    for (int u = 0; u < NSUB; ++u) {
      if (!EAGER) {
        if (ok0[u]) a[u][i].load(r0[u], t + 4 * i, D / 16); else a[u][i].zero();
        if (ok1[u]) b[u][i].load(r1[u], t + 4 * i, D / 16); else b[u][i].zero();
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        u32 a0 = h2_as_u32(a[u][i].pair(lut, 2 * h));
        u32 a2 = h2_as_u32(a[u][i].pair(lut, 2 * h + 1));
        u32 a1 = h2_as_u32(b[u][i].pair(lut, 2 * h));
        u32 a3 = h2_as_u32(b[u][i].pair(lut, 2 * h + 1));
        mma_16816(s[u], a0, a1, a2, a3, qb[h][0], qb[h][1]);
      }
    }
  }
}

// 4-bit affine pair p of a word holding nibbles 0..3 (low half) and 4..7 (high half) of a
// group: u = c - 8 (lop3, fma; a shift per two pairs).
template <int PATH>
__device__ __forceinline__ u32 nib_pair(u32 x, int p) {
  static_assert(PATH == PATH_AFFINE, "nib_pair: the affine path's operand");
  switch (p) {
    case 0: return dq_pair<0, 4>(x);
    case 1: return dq_pair<4, 4>(x);
    case 2: return dq_pair<0, 4>(x >> 8);
    default: return dq_pair<4, 4>(x >> 8);
  }
}

// The coordinate group that lane g holds as its j-th value group (j < D/64): VM = 0 (table
// path) groups g, g + 8; VM = 1 (affine path) groups 2g, 2g + 1 (adjacent words: one 8-byte
// load per state on the 4/4 fast path, which shares the accumulators with this path). D = 64:
// group g either way.
template <int VM, int D>
__device__ __forceinline__ int vgroup(int g, int j) {
  return VM ? (D / 64) * g + j : g + 8 * j;
}

// Value phase for one sub-tile of 16 states from tile0: acc[mb] += V^T block mb . P'^T.
template <int B, int PATH, int D, class R, int VM = 0>
__device__ __forceinline__ void tile_values(const R& vbase, int vwords, int tile0, int count,
                                            u32 pb0, u32 pb1, const Luts& lut, int g, int t,
                                            float (&acc)[D / 16][4]) {
  constexpr bool UNI = PATH != PATH_TABLE;
  constexpr int NG = D / 64;  // coordinate groups per lane per state
  int st[4] = {tile0 + 2 * t, tile0 + 2 * t + 1, tile0 + 2 * t + 8, tile0 + 2 * t + 9};
  if constexpr (UNI && B == 4) {
    // Affine 4-bit path: one prmt puts nibbles 0..3 (or 4..7) of two states side by side, so
    // each half2 (coordinate c of states 2t, 2t+1) costs nib_pair.
    u32 w[4][NG];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const R row = vbase.at(st[k] * vwords);
#pragma unroll
      for (int j = 0; j < NG; ++j) w[k][j] = st[k] < count ? row.w(vgroup<VM, D>(g, j)) : 0u;
    }
#pragma unroll
    for (int j = 0; j < NG; ++j) {
      const u32 lo01 = __byte_perm(w[0][j], w[1][j], 0x5410u), hi01 = __byte_perm(w[0][j], w[1][j], 0x7632u);
      const u32 lo23 = __byte_perm(w[2][j], w[3][j], 0x5410u), hi23 = __byte_perm(w[2][j], w[3][j], 0x7632u);
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        mma_16816(acc[4 * j + p], nib_pair<PATH>(lo01, p), nib_pair<PATH>(hi01, p),
                  nib_pair<PATH>(lo23, p), nib_pair<PATH>(hi23, p), pb0, pb1);
      }
    }
  } else if constexpr (UNI && B == 16) {
    // fp16 top tier on the affine path: pairs 2e, 2e+1 of words (e, 2+e) of each state.
#pragma unroll
    for (int j = 0; j < NG; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        u32 wl[4], wh[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const R row = vbase.at(st[k] * vwords);
          wl[k] = st[k] < count ? row.w(4 * vgroup<VM, D>(g, j) + e) : 0u;
          wh[k] = st[k] < count ? row.w(4 * vgroup<VM, D>(g, j) + 2 + e) : 0u;
        }
#pragma unroll
        for (int f = 0; f < 2; ++f) {
          const u32 sel = f ? 0x7632u : 0x5410u;
          mma_16816(acc[4 * j + 2 * e + f], __byte_perm(wl[0], wl[1], sel),
                    __byte_perm(wh[0], wh[1], sel), __byte_perm(wl[2], wl[3], sel),
                    __byte_perm(wh[2], wh[3], sel), pb0, pb1);
        }
      }
    }
  } else {
  constexpr bool EAGER = B < 8 || !UNI;   // as in tile_logits
  typename GroupOf<B, PATH>::type v[4][NG];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const R row = vbase.at(st[k] * vwords);
#pragma unroll
    for (int j = 0; j < NG; ++j) {
      if (EAGER) {
        if (st[k] < count) v[k][j].load(row, vgroup<VM, D>(g, j), D / 16); else v[k][j].zero();
      }
    }
  }
#pragma unroll
  for (int j = 0; j < NG; ++j) {
    if (!EAGER) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const R row = vbase.at(st[k] * vwords);
        if (st[k] < count) v[k][j].load(row, vgroup<VM, D>(g, j), D / 16); else v[k][j].zero();
      }
    }
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      __half2 x0 = v[0][j].pair(lut, p), x1 = v[1][j].pair(lut, p);
      __half2 x2 = v[2][j].pair(lut, p), x3 = v[3][j].pair(lut, p);
      u32 a0 = h2_as_u32(__lows2half2(x0, x1));
      u32 a1 = h2_as_u32(__highs2half2(x0, x1));
      u32 a2 = h2_as_u32(__lows2half2(x2, x3));
      u32 a3 = h2_as_u32(__highs2half2(x2, x3));
      mma_16816(acc[4 * j + p], a0, a1, a2, a3, pb0, pb1);
    }
  }
  }
}

template <int D, int PATH, int NSUB, class R, class QF>
__device__ __forceinline__ void dispatch_logits(int bits, const R& kbase, int kwords, int tile0,
                                                int count, const QF& qf,
                                                const Luts& lut, int g, int t,
                                                float (&s)[NSUB][4]) {
#define SKV_LOGITS(BB) tile_logits<BB, PATH, D, NSUB, R, QF>(kbase, kwords, tile0, count, qf, lut, g, t, s)
  switch (bits) {
    case 1: SKV_LOGITS(1); break;
    case 2: SKV_LOGITS(2); break;
    case 3: SKV_LOGITS(3); break;
    case 4: SKV_LOGITS(4); break;
    case 8: SKV_LOGITS(8); break;
    default: SKV_LOGITS(16); break;
  }
#undef SKV_LOGITS
}

// Values of the NSUB sub-tiles; a sub-tile past the page's last state is skipped (warp-uniform).
template <int D, int PATH, int NSUB, class R, int VM = 0>
__device__ __forceinline__ void dispatch_values(int bits, const R& vbase, int vwords, int tile0,
                                                int count, const u32 (&pb)[NSUB][2],
                                                const Luts& lut, int g, int t,
                                                float (&acc)[D / 16][4]) {
#define SKV_VALUES(BB)                                                                       \
  _Pragma("unroll") for (int u = 0; u < NSUB; ++u)                                           \
    if (u == 0 || tile0 + 16 * u < count)                                                    \
      tile_values<BB, PATH, D, R, VM>(vbase, vwords, tile0 + 16 * u, count, pb[u][0], pb[u][1], \
                                  lut, g, t, acc)
  switch (bits) {
    case 1: SKV_VALUES(1); break;
    case 2: SKV_VALUES(2); break;
    case 3: SKV_VALUES(3); break;
    case 4: SKV_VALUES(4); break;
    case 8: SKV_VALUES(8); break;
    default: SKV_VALUES(16); break;
  }
#undef SKV_VALUES
}

// Writes the final output of G heads from buf[g][:] (normalised accumulators in rotated
// coordinates, i.e. sum_i p_i s_i C[c_i]): o = sigma_V * (H acc) / D + mu_V.
template <int D>
__device__ __forceinline__ void finish_heads(float* buf, int G, const float* sigma_v,
                                             const float* mean_v, float* out, long long out_s0) {
  block_fwht<D>(buf, G);
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    int gg = idx / D, j = idx % D;
    float o = buf[gg * D + j] * sigma_v[j] * (1.0f / (float)D);
    if (mean_v) o += mean_v[j];
    out[gg * out_s0 + j] = o;
  }
}

__device__ __forceinline__ int ldg_s32(const int* p, bool vol) {
  if (!vol) return __ldg(p);
  int v;   // volatile: re-read where it is used instead of held in a register
  asm volatile("ld.global.nc.s32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ float lds_f32(const float* p, bool vol) {
  if (!vol) return *p;
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(static_cast<u32>(__cvta_generic_to_shared(p))));
  return v;
}

// 2^x: exp2f (table path) or one MUFU.EX2 (affine path: ex2.approx.ftz; 2 ulp, -inf -> 0, results below
// 2^-126 flushed to 0, which only drops weights < 2^-126 next to a running sum >= 1).
template <bool FAST>
__device__ __forceinline__ float dec_exp2(float x) {
  if constexpr (FAST) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
  } else {
    return exp2f(x);
  }
}

// The constants of one page's tier for lane (g, t): geometry (docs/format.md), and the
// per-head logit factors of heads 2t, 2t + 1. Affine path: the half step (doubled, the
// operand being u = c - 2^(B-1)) joins the scales, sum(q')/2 is added to the mma's logit sum
// (qk), and q . mu_K is left out (mu = 0, decode_page).
struct PageConsts {
  int kbits, vbits, kwords, vwords, voff, ksoff, vsoff;
  float kf0, kf1, mu0, mu1, qk0, qk1, hv;
  bool vaff;
  template <bool UNI, bool HALF, bool VOL>
  __device__ __forceinline__ void load(const int* gm, const float* kfac, const float* qmu,
                                       const float* hstep, const float* qhalf, int t) {
    kbits = ldg_s32(gm + G_KBITS, VOL); vbits = ldg_s32(gm + G_VBITS, VOL);
    kwords = ldg_s32(gm + G_KWORDS, VOL); vwords = ldg_s32(gm + G_VWORDS, VOL);
    voff = ldg_s32(gm + G_VOFF, VOL); ksoff = ldg_s32(gm + G_KSOFF, VOL);
    vsoff = ldg_s32(gm + G_VSOFF, VOL);
    const bool kaff = UNI && kbits != 16;
    vaff = HALF && vbits != 16;
    const float hk = kaff ? lds_f32(hstep + level_row(kbits), VOL) : 1.0f;
    hv = (UNI && vbits != 16) ? lds_f32(hstep + level_row(vbits), VOL) : 1.0f;
    kf0 = lds_f32(kfac + 2 * t, VOL) * hk;
    kf1 = lds_f32(kfac + 2 * t + 1, VOL) * hk;
    mu0 = VOL ? 0.0f : qmu[2 * t];
    mu1 = VOL ? 0.0f : qmu[2 * t + 1];
    qk0 = (HALF && kaff) ? lds_f32(qhalf + 2 * t, VOL) : 0.0f;
    qk1 = (HALF && kaff) ? lds_f32(qhalf + 2 * t + 1, VOL) : 0.0f;
  }
};

// One page: tiles of 16 * NSUB states, logits -> online softmax -> values (see the map
// above). NSUB = 2 (affine path): one running-maximum update, one shuffle reduction and one P'
// exchange per 32 states; each lane first reduces its own 2 * NSUB states per head.
// ps0, ps1: sum of the fp16 P' of the affine tiers, for the "+1/2" of u = c - 2^(B-1).
// The affine path differs from the table path in three places:
//   * P' goes from the C fragment of the logit mma (state rows, head columns) to the B
//     fragment of the value mma (state k, head n) by two movmatrix transposes per sub-tile:
//     no shared-memory tile, no __syncwarp;
//   * lazy maximum: the running maximum m of a head moves only when a logit exceeds it by
//     more than DEC_LAZY_MAX (log2 units), so after the first tiles a step costs one vote
//     and no shuffles. Then p = 2^(z - m) <= 2^DEC_LAZY_MAX: P' = p s_V stays in fp16 for
//     s_V * half step < 65504 / 2^DEC_LAZY_MAX (4094 at 4), far above real value norms;
//   * q . mu_K is left out of the logits: it is the same for every state of a head (every
//     warp and split), so the softmax and the output do not see it (only the internal lse).
template <int D, int PATH, int NSUB, class R, class QF>
__device__ __forceinline__ void decode_page(const R& pg, const int* gm, int count,
                                            const QF& qf, const Luts& lut,
                                            const float* kfac, const float* qmu,
                                            const float* hstep, const float* qhalf, __half* pt,
                                            int g, int t, float (&acc)[D / 16][4],
                                            float& m0, float& m1, float& l0, float& l1,
                                            float& ps0, float& ps1) {
  constexpr bool AFFINE = PATH == PATH_AFFINE;
  constexpr int TS = 16 * NSUB;        // states per tile (row stride of the P' tile)
  const float top = sqrtf((float)D);   // 16-bit tier: logit = sqrt(D) <q', y>, no scale
  PageConsts pc;
  // The table path reads the page's constants once; the affine path re-reads them (L1-resident) at every step, so
  // that they do not hold registers across the step (4 CTAs per SM at 128 registers).
  if constexpr (!AFFINE) pc.template load<AFFINE, PATH == PATH_AFFINE, false>(gm, kfac, qmu, hstep, qhalf, t);
  for (int tile0 = 0; tile0 < count; tile0 += TS) {
    if constexpr (AFFINE) pc.template load<AFFINE, PATH == PATH_AFFINE, true>(gm, kfac, qmu, hstep, qhalf, t);
    const int kbits = pc.kbits, vbits = pc.vbits, kwords = pc.kwords, vwords = pc.vwords;
    const int ksoff = pc.ksoff, vsoff = pc.vsoff;
    const float kf0 = pc.kf0, kf1 = pc.kf1, mu0 = pc.mu0, mu1 = pc.mu1, qk0 = pc.qk0, qk1 = pc.qk1;
    const float hv = pc.hv;
    const bool vaff = pc.vaff;
    const int h0 = 2 * t, h1 = 2 * t + 1;
    const R vbase = pg.at(pc.voff);
    float s[NSUB][4];
#pragma unroll
    for (int u = 0; u < NSUB; ++u) s[u][0] = s[u][1] = s[u][2] = s[u][3] = 0.0f;
    dispatch_logits<D, PATH, NSUB>(kbits, pg, kwords, tile0, count, qf, lut, g, t, s);
    float z[NSUB][4], sv[NSUB][2];
    float x0 = -SKV_INF, x1 = -SKV_INF;
#pragma unroll
    for (int u = 0; u < NSUB; ++u) {
      const int st0 = tile0 + 16 * u + g, st1 = st0 + 8;
      const bool ok0 = st0 < count, ok1 = st1 < count;
      const float sk0 = ok0 ? (ksoff >= 0 ? pg.half_at(ksoff + 2 * st0) : top) : 0.0f;
      const float sk1 = ok1 ? (ksoff >= 0 ? pg.half_at(ksoff + 2 * st1) : top) : 0.0f;
      sv[u][0] = ok0 ? (vsoff >= 0 ? pg.half_at(vsoff + 2 * st0) * hv : top) : 0.0f;
      sv[u][1] = ok1 ? (vsoff >= 0 ? pg.half_at(vsoff + 2 * st1) * hv : top) : 0.0f;
      if constexpr (PATH == PATH_AFFINE) {
        s[u][0] += qk0; s[u][1] += qk1; s[u][2] += qk0; s[u][3] += qk1;
      }
      z[u][0] = ok0 ? s[u][0] * sk0 * kf0 + mu0 : -SKV_INF;
      z[u][1] = ok0 ? s[u][1] * sk0 * kf1 + mu1 : -SKV_INF;
      z[u][2] = ok1 ? s[u][2] * sk1 * kf0 + mu0 : -SKV_INF;
      z[u][3] = ok1 ? s[u][3] * sk1 * kf1 + mu1 : -SKV_INF;
      x0 = fmaxf(x0, fmaxf(z[u][0], z[u][2]));
      x1 = fmaxf(x1, fmaxf(z[u][1], z[u][3]));
    }
    // Table path: the exact running maximum (one shuffle reduction per step), accumulators
    // rescaled when some head's maximum moved. Affine path: the same, only when a logit passed m + lazy.
    bool move;
    if constexpr (AFFINE) {
      move = __any_sync(0xffffffffu, x0 > m0 + DEC_LAZY_MAX || x1 > m1 + DEC_LAZY_MAX);
    } else {
      move = true;
    }
    if (move) {
#pragma unroll
      for (int m = 4; m <= 16; m <<= 1) {
        x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, m));
        x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, m));
      }
      const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);  // finite: the tile has a state
      // Rescale the accumulators only when some head's running maximum moved (warp-uniform).
      if (__any_sync(0xffffffffu, n0 != m0 || n1 != m1)) {
        const float al0 = dec_exp2<AFFINE>(m0 - n0), al1 = dec_exp2<AFFINE>(m1 - n1);
        l0 *= al0; l1 *= al1;
        if (PATH == PATH_AFFINE) { ps0 *= al0; ps1 *= al1; }
#pragma unroll
        for (int i = 0; i < D / 16; ++i) {
          acc[i][0] *= al0; acc[i][1] *= al1; acc[i][2] *= al0; acc[i][3] *= al1;
        }
        m0 = n0; m1 = n1;
      }
    }
    // P' = p * s_V in fp16: w[u][0] = (state g; heads h0, h1), w[u][1] = (state g + 8; h0, h1),
    // i.e. rows of the two 8x8 blocks (states x heads) of the sub-tile's C fragment.
    __half2 w[NSUB][2];
#pragma unroll
    for (int u = 0; u < NSUB; ++u) {
      const float p0 = dec_exp2<AFFINE>(z[u][0] - m0), p1 = dec_exp2<AFFINE>(z[u][1] - m1);
      const float p2 = dec_exp2<AFFINE>(z[u][2] - m0), p3 = dec_exp2<AFFINE>(z[u][3] - m1);
      l0 += p0 + p2;
      l1 += p1 + p3;
      w[u][0] = __floats2half2_rn(p0 * sv[u][0], p1 * sv[u][0]);
      w[u][1] = __floats2half2_rn(p2 * sv[u][1], p3 * sv[u][1]);
      if (PATH == PATH_AFFINE && vaff) {
        const float2 f01 = __half22float2(w[u][0]), f23 = __half22float2(w[u][1]);
        ps0 += f01.x + f23.x;
        ps1 += f01.y + f23.y;
      }
    }
    // ... to the B fragment of the value mma: pb[u][0] = (head g; states 2t, 2t + 1),
    // pb[u][1] = (head g; states 2t + 8, 2t + 9).
    u32 pb[NSUB][2];
    if constexpr (AFFINE) {   // in registers
#pragma unroll
      for (int u = 0; u < NSUB; ++u) {
        pb[u][0] = transpose8x8(h2_as_u32(w[u][0]));
        pb[u][1] = transpose8x8(h2_as_u32(w[u][1]));
      }
    } else {              // through the warp's shared tile
      __syncwarp();   // every lane has read the previous tile's P'
#pragma unroll
      for (int u = 0; u < NSUB; ++u) {
        pt[h0 * TS + 16 * u + g] = __low2half(w[u][0]);
        pt[h1 * TS + 16 * u + g] = __high2half(w[u][0]);
        pt[h0 * TS + 16 * u + g + 8] = __low2half(w[u][1]);
        pt[h1 * TS + 16 * u + g + 8] = __high2half(w[u][1]);
      }
      __syncwarp();
#pragma unroll
      for (int u = 0; u < NSUB; ++u) {
        pb[u][0] = *reinterpret_cast<const u32*>(pt + g * TS + 16 * u + 2 * t);
        pb[u][1] = *reinterpret_cast<const u32*>(pt + g * TS + 16 * u + 2 * t + 8);
      }
    }
    dispatch_values<D, PATH, NSUB, R, AFFINE ? 1 : 0>(vbits, vbase, vwords, tile0, count, pb, lut, g,
                                                  t, acc);
  }
}
// ------------------------------------------------------- affine path, 4/4 pages ----
// Fast path: a full page of the 4/4 tier (D = 128, 4096-byte pages: P = 31 states, key
// codes [31][64 B] at 0, value codes at 1984, key scales at 3968, value scales at 4030), i.e.
// one 32-state step per page with one state slot (31) not stored. No predication, addresses
// from per-lane constants, 16-byte key loads and 8-byte value loads that are conflict-free
// because the page is staged with a swizzle (f44_slot), codes to the mma in one lop3 per
// pair (f44_pair), the softmax in one MUFU per weight.
//
// Lane maps (lane = 4g + t; rows of a sub-tile u are states 16u + r):
//   logits: lane (g, t) reads 16 bytes (words 4t..4t+3, coordinates 32t..32t+31) of the key
//     codes of states 16u + g and 16u + g + 8. Word w = 4t + i feeds k16 chunk 2i + h:
//     h = 0: pairs (n0, n4) at bit 0 and (n1, n5) at bit 4 of each half; h = 1: the same of
//     w >> 8, i.e. (n2, n6) and (n3, n7). The query fragment (qfrag44) holds head g's q' of
//     those coordinates in the same order, q' scaled by 2^-POS for a field at bit POS.
//   values: lane (g, t) reads words 2g, 2g + 1 (groups 2g, 2g + 1 = vgroup<1>) of the value
//     codes of states 2t, 2t + 1, 2t + 8, 2t + 9 of each sub-tile (8 bytes each); the A
//     fragment of acc[4j + p] is coordinate 8(2g + j) + p (row g) and + 4 (row g + 8), as on
//     the generic path with VM = 1, so both paths share the accumulators.
// Codes to fp16: a 4-bit field at bit POS of both halves, masked by one
// lop3, IS the fp16 subnormal c * 2^(POS - 24) (exponent bits zero). The mma multiplies it
// exactly (fp16 subnormals are full-precision inputs to the tensor cores; products and sums
// are fp32, far from its subnormal range). So logit sums carry 2^-24 (undone in K1) and the
// value accumulators carry 2^(POS - 24) per row: they live in the "F domain" while fast
// pages are decoded and are scaled back by 2^(24 - POS) (exact) before a generic page or the
// end (f44_domain). The offset of u = c - 7.5: logits -7.5 * sum(q~) per head (K2), values
// -7.5 * sum(P') per head through ps (coefficient -15 of the final 0.5 * ps).
constexpr int TABLE_CTAS = 3;   // table kernel: resident CTAs per SM (its 72 KiB of shared memory allow 3)
constexpr int AFF_SUB = 2;      // affine kernel: 16-state sub-tiles per softmax step of decode_page
constexpr int AFF_CTAS = 4;     // affine kernel: resident CTAs per SM asked of ptxas (<= 128 registers)
constexpr int AFF_STAGES = 2;   // affine kernel: page buffers per warp (pages in flight + 1)
// At D = 256 a lane's value accumulators (D / 16 x 4 floats) and query fragments need more
// registers than 3 or 4 resident CTAs leave (168 and 128 registers spilled 232 and 184 bytes):
// both decode kernels ask for 2 CTAs per SM there (up to 255 registers; WIDE_DIM).
constexpr int TABLE_CTAS_WIDE = 2;
constexpr int AFF_CTAS_WIDE = 2;
// The D = 256 fast pages (page44w, page22w, page33w, page88w, page1616w) in the affine kernel.
// Off until a GPU run has passed their tests (tests/test_ada_decode.py, the fast-page tests at
// D = 256): their lane maps are checked on the CPU only (lab/fast_pages_d256.py). Off, every
// D = 256 page decodes on decode_page. On: -DSKV_WIDE_FAST_PAGES=1 (the run-time build adds it where
// SPHERICAL_KV_WIDE_FAST_PAGES=1 is in the environment: cupy_kernels._module.build_options).
#ifndef SKV_WIDE_FAST_PAGES
#  define SKV_WIDE_FAST_PAGES 0
#endif
constexpr bool WIDE_FAST_PAGES = SKV_WIDE_FAST_PAGES != 0;
template <bool WIDE> struct WideSmemOf { typedef DecodeSmemAffine<256> type; };
template <> struct WideSmemOf<true> { typedef DecodeSmemFast<256> type; };
template <> struct SmemOf<256, true> { typedef WideSmemOf<WIDE_FAST_PAGES>::type type; };

constexpr int F44_WORDS = 1024;   // page words of the fast path (4096-byte pages)
constexpr u32 F44_VCHUNK = 124;   // 16-byte chunk where the value codes start (1984 / 16)
constexpr u32 F44_KSOFF = 3968, F44_VSOFF = 4030;   // scale arrays (bytes)

// Slot of 16-byte chunk x of a 4/4 page in its staging buffer: the low 3 bits XOR 2*(row & 3)
// for the 128-byte rows 0..30 (codes); row 31 (scales, padding) stays in place.
__host__ __device__ constexpr u32 f44_slot(u32 x) {
  return (x >> 3) >= 31u ? x : (x ^ (((x >> 3) & 3u) << 1));
}

__host__ __device__ constexpr u32 f44_code_slot(u32 x) {   // f44_slot for x < 248 (rows 0..30)
  return x ^ (((x >> 3) & 3u) << 1);
}

template <int POS>
__device__ __forceinline__ u32 f44_pair(u32 x) {
  return x & ((0xfu << POS) * 0x10001u);
}

__device__ __forceinline__ uint4 lds128(u32 a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ uint2 lds64(u32 a) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a));
  return v;
}
__device__ __forceinline__ float4 lds128f(u32 a) {
  const uint4 v = lds128(a);
  return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z),
                     __uint_as_float(v.w));
}
__device__ __forceinline__ float lds_half(u32 a) {
  unsigned short h;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(h) : "r"(a));
  return __half2float(__ushort_as_half(h));
}
__device__ __forceinline__ void cp_async16_sh(u32 dst, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" :: "r"(dst), "l"(gmem));
}
__device__ __forceinline__ u32 word_of(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// Moves the value accumulators between the generic scale (TO_F = false) and the F domain.
template <int D>
__device__ __forceinline__ void f44_domain(float (&acc)[D / 16][4], bool to_f) {
  if (D != 128) return;
  const float even = to_f ? 0x1p-24f : 0x1p24f, odd = to_f ? 0x1p-20f : 0x1p20f;
#pragma unroll
  for (int i = 0; i < D / 16; ++i) {
    const float f = (i & 1) ? odd : even;   // acc[4j + p]: field at bit 4 (p & 1)
    acc[i][0] *= f; acc[i][1] *= f; acc[i][2] *= f; acc[i][3] *= f;
  }
}

// Per-lane byte offsets of the fast path inside a staged 4/4 page.
struct F44Lane {
  u32 koff;    // key chunk t of state g (states g + 8, 16 + g, 24 + g: + 512, 1024, 1536)
  u32 voff0;   // value words 2g, 2g + 1 of state 2t (state 2t + 8: + 512; sub-tile 1: + 1024)
  u32 voff1;   // the same of state 2t + 1
  u32 soff;    // key scale of state g (state g + 8j: + 16 j); value scale at + 62
  __device__ __forceinline__ void init(int g, int t) {
    koff = 16u * f44_code_slot(4u * g + t);
    voff0 = 16u * f44_code_slot(F44_VCHUNK + 8u * t + (g >> 1)) + 8u * (g & 1);
    voff1 = 16u * f44_code_slot(F44_VCHUNK + 8u * t + 4u + (g >> 1)) + 8u * (g & 1);
    soff = F44_KSOFF + 2u * g;
  }
};

// Copies page `src` (4096 bytes) into the staging buffer at shared address `dst` with an XOR
// swizzle of the 16-byte chunk slot by the 128-byte row: lane l copies chunks l + 32 i
// (i = 0..7); chunk l + 32 i lies in row l/8 + 4 i, so its slot is (l ^ ((l >> 2) & SW)) + 32 i,
// except in the last round for lanes >= KEEP (the scale rows, kept in place). 4/4 (f44_stage):
// SW = 6 (slot ^= 2 (row & 3)), rows 0..30 swizzled; 2/2 (page_f2): SW = 2 (slot ^= 2 (row & 1)),
// rows 0..29 swizzled; SW = 0: no swizzle.
template <int OFF>
__device__ __forceinline__ void cp_async16_off(u32 dst, const char* src) {   // both + OFF bytes
  asm volatile("cp.async.cg.shared.global [%0+%2], [%1+%2], 16;\n" :: "r"(dst), "l"(src), "n"(OFF));
}
// The eight rounds of one lane: round i (chunk lane + 32 i) to d[i & 3] + 512 i, except the last
// round's lanes >= KEEP, in place (fp_stage, f8_stage, f16_stage).
template <int KEEP>
__device__ __forceinline__ void stage_rounds(u32 dst, const u32* src_page, int lane, u32 d0,
                                             u32 d1, u32 d2, u32 d3) {
  const char* src = reinterpret_cast<const char*>(src_page) + 16 * lane;
  cp_async16_off<0>(d0, src);
  cp_async16_off<512>(d1, src);
  cp_async16_off<1024>(d2, src);
  cp_async16_off<1536>(d3, src);
  cp_async16_off<2048>(d0, src);
  cp_async16_off<2560>(d1, src);
  cp_async16_off<3072>(d2, src);
  cp_async16_off<3584>(lane >= KEEP ? dst + 16u * static_cast<u32>(lane) : d3, src);
}
template <u32 SW, int KEEP>
__device__ __forceinline__ void fp_stage(u32 dst, const u32* src_page, int lane) {
  const u32 sl = static_cast<u32>(lane) ^ ((static_cast<u32>(lane) >> 2) & SW);
  const u32 d = dst + 16u * sl;
  stage_rounds<KEEP>(dst, src_page, lane, d, d, d, d);
}
__device__ __forceinline__ void f44_stage(u32 dst, const u32* src_page, int lane) {
  fp_stage<6u, 24>(dst, src_page, lane);   // row 31 (lanes 24..31 of the last round) in place
}

// The logits of a staged fast page, in the pieces page44 and page44_pipe share: f44_keys zeroes
// both accumulators of the two sub-tiles and loads this lane's key code words; f44_logit_chunk
// adds k16 chunk (i, h) of both sub-tiles (b: the query fragment of that chunk; LSPLIT: odd
// chunks go to the second accumulator s1, two mma chains per sub-tile); f44_fold adds s1 to s.
__device__ __forceinline__ void f44_keys(u32 buf, const F44Lane& fl, float (&s)[2][4],
                                         float (&s1)[2][4], uint4 (&kw)[2][2]) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    s[u][0] = s[u][1] = s[u][2] = s[u][3] = 0.0f;
    s1[u][0] = s1[u][1] = s1[u][2] = s1[u][3] = 0.0f;
    kw[u][0] = lds128(buf + fl.koff + 1024u * u);
    kw[u][1] = lds128(buf + fl.koff + 1024u * u + 512u);
  }
}
template <bool LSPLIT>
__device__ __forceinline__ void f44_logit_chunk(float (&s)[2][4], float (&s1)[2][4],
                                                const uint4 (&kw)[2][2], int i, int h, uint2 b) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    u32 x0 = word_of(kw[u][0], i), x1 = word_of(kw[u][1], i);
    if (h) { x0 >>= 8; x1 >>= 8; }
    mma_16816((LSPLIT && h) ? s1[u] : s[u], f44_pair<0>(x0), f44_pair<0>(x1),
              f44_pair<4>(x0), f44_pair<4>(x1), b.x, b.y);
  }
}
__device__ __forceinline__ void f44_fold(float (&s)[2][4], const float (&s1)[2][4]) {
#pragma unroll
  for (int u = 0; u < 2; ++u) {
#pragma unroll
    for (int k = 0; k < 4; ++k) s[u][k] += s1[u][k];
  }
}

// Softmax of one staged fast page of NS 16-state sub-tiles holding P states (page44 and
// page44_pipe: NS = 2, P = 31; page_f2: 3/3 NS = 3, P = 40, 2/2 NS = 4, P = 60): the logits s
// (rows g, g + 8 of each sub-tile; heads 2t, 2t + 1) -> P' = p s_V in the value mma's B layout
// (pb). Row j = 2u + r of the lane is state 8j + g; its key scale at shared address sk_at + 16 j,
// its value scale at sv_at + 16 j. A row past the page's last state gets weight 0 (logit -inf,
// s_V = 0: its scale and code bytes are padding or other arrays, any bits); a row that is never
// a state (8 j >= P) is not loaded and its P' is 0. kk, hv as page44; coef: -2 times the code
// offset of the tier (the offset times the sum of P' is taken off once at the end:
// decode_cta's + 0.5 ps). The lazy running maximum, l and ps as in decode_page (acc is
// rescaled when the maximum moves).
// SCALED = false (the 16-bit tier, no scales stored): s_K = s_V = hv (sqrt(D), as decode_page's
// `top`), sk_at and sv_at unused. NA: the value accumulator blocks (D / 16).
template <int NS, int P, bool SCALED = true, int NA = 8>
__device__ __forceinline__ void fp_softmax(u32 sk_at, u32 sv_at, u32 kk, float hv, float coef,
                                           int g, const float (&s)[NS][4], float (&acc)[NA][4],
                                           u32 (&pb)[NS][2], float& m0, float& m1, float& l0,
                                           float& l1, float& ps0, float& ps1) {
  constexpr int NR = 2 * NS;
  float sk[NR], svh[NR];
  bool ok[NR];
#pragma unroll
  for (int j = 0; j < NR; ++j) {
    ok[j] = 8 * j + 7 < P || (8 * j < P && g < P - 8 * j);
    sk[j] = svh[j] = 0.0f;
    if (8 * j < P) {
      sk[j] = SCALED ? lds_half(sk_at + 16u * j) : hv;
      svh[j] = SCALED ? lds_half(sv_at + 16u * j) * hv : hv;
      if (!ok[j]) svh[j] = 0.0f;
    }
  }
  const float4 K = lds128f(kk);   // z = (s K1 + K2) sk: the logit in log2 units
  float e[NS][4];
#pragma unroll
  for (int u = 0; u < NS; ++u) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float k1 = (k & 1) ? K.z : K.x, k2 = (k & 1) ? K.w : K.y;
      e[u][k] = fmaf(fmaf(s[u][k], k1, k2), sk[2 * u + (k >> 1)], -((k & 1) ? m1 : m0));
    }
  }
#pragma unroll
  for (int j = 0; j < NR; ++j) {
    if (!ok[j]) e[j >> 1][2 * (j & 1)] = e[j >> 1][2 * (j & 1) + 1] = -SKV_INF;
  }
  float x0 = -SKV_INF, x1 = -SKV_INF;
#pragma unroll
  for (int u = 0; u < NS; ++u) {
    x0 = fmaxf(x0, fmaxf(e[u][0], e[u][2]));
    x1 = fmaxf(x1, fmaxf(e[u][1], e[u][3]));
  }
  if (__any_sync(0xffffffffu, x0 > DEC_LAZY_MAX || x1 > DEC_LAZY_MAX)) {
    // lazy maximum moves (rare after the first pages): as in decode_page, from the absolute
    // logits (m may be -inf)
    float z[NS][4];
    x0 = x1 = -SKV_INF;
#pragma unroll
    for (int u = 0; u < NS; ++u) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float k1 = (k & 1) ? K.z : K.x, k2 = (k & 1) ? K.w : K.y;
        z[u][k] = fmaf(s[u][k], k1, k2) * sk[2 * u + (k >> 1)];
      }
    }
#pragma unroll
    for (int j = 0; j < NR; ++j) {
      if (!ok[j]) z[j >> 1][2 * (j & 1)] = z[j >> 1][2 * (j & 1) + 1] = -SKV_INF;
    }
#pragma unroll
    for (int u = 0; u < NS; ++u) {
      x0 = fmaxf(x0, fmaxf(z[u][0], z[u][2]));
      x1 = fmaxf(x1, fmaxf(z[u][1], z[u][3]));
    }
#pragma unroll
    for (int m = 4; m <= 16; m <<= 1) {
      x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, m));
      x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, m));
    }
    const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);   // finite: the page has states
    const float al0 = dec_exp2<true>(m0 - n0), al1 = dec_exp2<true>(m1 - n1);
    l0 *= al0; l1 *= al1; ps0 *= al0; ps1 *= al1;
#pragma unroll
    for (int i = 0; i < NA; ++i) {
      acc[i][0] *= al0; acc[i][1] *= al1; acc[i][2] *= al0; acc[i][3] *= al1;
    }
    m0 = n0; m1 = n1;
#pragma unroll
    for (int u = 0; u < NS; ++u) {
#pragma unroll
      for (int k = 0; k < 4; ++k) e[u][k] = z[u][k] - ((k & 1) ? m1 : m0);
    }
  }
#pragma unroll
  for (int u = 0; u < NS; ++u) {
    const bool r1 = 16 * u + 8 < P;   // row g + 8 of the sub-tile can be a state
    float p[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) p[k] = (k < 2 || r1) ? dec_exp2<true>(e[u][k]) : 0.0f;
    l0 += p[0] + p[2];
    l1 += p[1] + p[3];
    const __half2 w0 = __floats2half2_rn(p[0] * svh[2 * u], p[1] * svh[2 * u]);
    const __half2 w1 = __floats2half2_rn(p[2] * svh[2 * u + 1], p[3] * svh[2 * u + 1]);
    // sum of the fp16 P' exactly as the mma sees them
    const float2 f0 = __half22float2(w0), f1 = __half22float2(w1);
    ps0 = fmaf(f0.x + f1.x, coef, ps0);
    ps1 = fmaf(f0.y + f1.y, coef, ps1);
    pb[u][0] = transpose8x8(h2_as_u32(w0));
    pb[u][1] = r1 ? transpose8x8(h2_as_u32(w1)) : 0u;
  }
}
// The 4/4 fast page's softmax (31 states; the code offset 7.5 on the F path, -0.5 on decode_page's
// u = c - 8); fl.soff: key scale of state g.
__device__ __forceinline__ void f44_softmax(u32 buf, const F44Lane& fl, u32 kk, float hv, int g,
                                            const float (&s)[2][4], float (&acc)[8][4],
                                            u32 (&pb)[2][2], float& m0, float& m1, float& l0,
                                            float& l1, float& ps0, float& ps1) {
  fp_softmax<2, 31>(buf + fl.soff, buf + fl.soff + (F44_VSOFF - F44_KSOFF), kk, hv,
                    -15.0f, g, s, acc, pb, m0, m1, l0, l1, ps0, ps1);
}

// The F44 values of one 16-state sub-tile of 4-bit codes (page44, page44w): w[k][j] = the lane's
// j-th value word (coordinates 8 vgroup(g, j) .. + 7) of state 2t, 2t + 1, 2t + 8, 2t + 9
// (k = 0..3); acc[4j + p] takes pair p of it (coordinates p, p + 4: the nibbles at bit 4 (p & 1)
// of byte p >> 1 of each half).
template <int NJ>
__device__ __forceinline__ void f44_values_w(const u32 (&w)[4][NJ], u32 pb0, u32 pb1,
                                             float (&acc)[4 * NJ][4]) {
#pragma unroll
  for (int j = 0; j < NJ; ++j) {
    u32 lo01 = __byte_perm(w[0][j], w[1][j], 0x5410u), hi01 = __byte_perm(w[0][j], w[1][j], 0x7632u);
    u32 lo23 = __byte_perm(w[2][j], w[3][j], 0x5410u), hi23 = __byte_perm(w[2][j], w[3][j], 0x7632u);
    mma_16816(acc[4 * j + 0], f44_pair<0>(lo01), f44_pair<0>(hi01), f44_pair<0>(lo23),
              f44_pair<0>(hi23), pb0, pb1);
    mma_16816(acc[4 * j + 1], f44_pair<4>(lo01), f44_pair<4>(hi01), f44_pair<4>(lo23),
              f44_pair<4>(hi23), pb0, pb1);
    lo01 >>= 8; hi01 >>= 8; lo23 >>= 8; hi23 >>= 8;
    mma_16816(acc[4 * j + 2], f44_pair<0>(lo01), f44_pair<0>(hi01), f44_pair<0>(lo23),
              f44_pair<0>(hi23), pb0, pb1);
    mma_16816(acc[4 * j + 3], f44_pair<4>(lo01), f44_pair<4>(hi01), f44_pair<4>(lo23),
              f44_pair<4>(hi23), pb0, pb1);
  }
}

// One full 4/4 page staged at shared address `buf` (swizzled). qf7: shared address of this
// lane's qfrag44[0][lane] (chunk c at + 256 c); kk: shared address of K1/K2 of heads 2t, 2t+1
// (float4 {K1[2t], K2[2t], K1[2t+1], K2[2t+1]}); hv: the value scale factor (twice the 4-bit
// half step). acc must be in the F domain. m, l, ps as in decode_page.
__device__ __forceinline__ void page44(u32 buf, u32 qf7, u32 kk, float hv, int g, int t,
                                       float (&acc)[8][4], float& m0, float& m1, float& l0,
                                       float& l1, float& ps0, float& ps1) {
  F44Lane fl;
  fl.init(g, t);
  // ---- logits: s[u] = S^T of sub-tile u (rows g, g + 8; heads 2t, 2t + 1). LSPLIT: the
  // odd chunks go to a second accumulator (two mma chains of 4 per sub-tile instead of one of 8)
  float s[2][4], s1[2][4];
  uint4 kw[2][2];
  f44_keys(buf, fl, s, s1, kw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint2 b = lds64(qf7 + 256u * (2 * i + h));
      f44_logit_chunk<true>(s, s1, kw, i, h, b);
    }
  }
  f44_fold(s, s1);
  // ---- softmax
  u32 pb[2][2];
  f44_softmax(buf, fl, kk, hv, g, s, acc, pb, m0, m1, l0, l1, ps0, ps1);
  // ---- values: acc[4j + p] += V^T(coordinates 8(2g + j) + p, + 4) . P'^T
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    const uint2 v0 = lds64(buf + fl.voff0 + 1024u * u);          // state 16u + 2t
    const uint2 v1 = lds64(buf + fl.voff1 + 1024u * u);          // 16u + 2t + 1
    const uint2 v2 = lds64(buf + fl.voff0 + 1024u * u + 512u);   // 16u + 2t + 8
    const uint2 v3 = lds64(buf + fl.voff1 + 1024u * u + 512u);   // 16u + 2t + 9
    const u32 w[4][2] = {{v0.x, v0.y}, {v1.x, v1.y}, {v2.x, v2.y}, {v3.x, v3.y}};
    f44_values_w(w, pb[u][0], pb[u][1], acc);
  }
}

// ------------------------------------------------- affine path, 3/3 and 2/2 pages ----
// Fast path for full pages of the 3/3 and 2/2 tiers (D = 128, 4096-byte pages): page_f2.
// Page layouts (docs/format.md): 3/3 holds P = 40 states, key codes [40][48 B] at 0 (per state:
// the 2-bit field array, words 0..7, coordinate m of word w at bits 2m, then the bit-2 plane,
// words 8..11, coordinate n of word 8 + w at bit n), value codes at 1920, key scales at 3840,
// value scales at 3920; 2/2 holds P = 60 states, [60][32 B] at 0 and 1920, scales at 3840 and
// 3960. A page is three (3/3; the third sub-tile holds states 32..39 only) or four (2/2; states
// 48..59) 16-state sub-tiles in one softmax step (fp_softmax), with no predication.
//
// Codes to the mma, the F2 domain: as on the 4/4 path a field masked into an otherwise zero
// fp16 is the exact subnormal c 2^(POS - 24). A 2-bit field sits at POS = 2p (p = 0..3, after
// at most one 8-bit shift of its word), so one lop3 per pair of codes (2/2). A 3-bit code
// c = lo + 4 hi becomes one field at POS = 2p: the lo field stays in place and the plane bit of
// the same coordinate is shifted to POS + 2 and merged (shift + two lop3 per pair; one mma per
// k16 chunk, as at 4/4 and 2/2). So both tiers share one query fragment (qfrag2: q~ 2^-POS in
// the same k order; only 3/3 uses the plane bits) and one accumulator domain, F2: acc[4j + p]
// carries 2^(2p - 24) (domain_move). Offsets: u = c - 3.5 (3 bits) or c - 1.5 (2 bits): logits
// through K2 per head and tier, values through ps (coefficient -7 or -3).
//
// Lane maps (lane = 4g + t), the same coordinates as the generic path (shared accumulators):
//   logits: lane (g, t) owns coordinates 32t .. 32t + 31 of every state: field words 2t, 2t + 1
//     (one 8-byte load) and, at 3 bits, plane word t (4 bytes). Word variants W[k] (k = 0..3):
//     w0, w0 >> 8, w1, w1 >> 8; field p of W[k] holds coordinates 32t + 16(k >> 1) + 4(k & 1) + p
//     (low half) and + 8 (high half). Chunk c = 2k + h takes fields 2h (b0) and 2h + 1 (b1).
//     The plane word's bytes are paired by one prmt per state and word (bytes 0, 1 or 2, 3 to
//     bytes 0 and 2), so that one shift serves both halves of a register.
//   values: lane (g, t) reads field word g (coordinates 16g .. 16g + 15) of states 2t, 2t + 1,
//     2t + 8, 2t + 9 of each sub-tile (and, at 3 bits, their plane word g >> 1, whose half g & 1
//     one prmt pairs across two states); acc[4j + p] takes field p of the pair word (j: low or
//     high halves of the two states) for row g and of the word >> 8 for row g + 8, as page44.
//     The third 3/3 sub-tile has 8 states: its values are one m16n8k8 mma per block.
// Shared-memory banks: 2/2 pages are staged with a 16-byte XOR swizzle (slot ^= 2 (row & 1),
// rows 0..29), which makes the 8-byte key loads and the 4-byte value loads conflict-free. 3/3
// pages are staged in place: the value and plane loads are conflict-free as they are (a state
// is 12 words, 12 s mod 32 takes 8 distinct multiples of 4 over 8 consecutive states), the
// 8-byte key-field loads are two-way conflicted (no 16-byte swizzle helps: 48-byte records).
//
// Error bound (docs/PERF_NOTES.md "Error budget"): every operand the mma sees
// is exact except the query fragment, q~ 2^-POS rounded to fp16: for POS <= 6 an fp16
// subnormal (|q~| < 2^-8) is off by at most 2^-25 absolute, i.e. 2^-19 |q~|max per coordinate,
// <= 2^-19 sum_j |C_j| <= 2^-15.5 |C| per logit, under 3 % of the tests' budget (2^-10 |q~| |C|).
// Products and sums are fp32; the codes are c >= 0 (no cancellation inside the mma), so the
// accumulation error is at most 2x decode_page's (|c| <= 7 against |u| <= 4 at 3 bits), as on the 4/4
// path, and the offset term is the 4/4 path's with 3.5 or 1.5 instead of 7.5.

constexpr int SKV_GEOM_PRE_ROWS = 16;   // geometry rows read at entry (the launcher pads to them)

template <int B> struct F2Geo;
template <> struct F2Geo<3> {
  static constexpr int P = 40, NS = 3;
  static constexpr u32 KREC = 48, VOFF = 1920, KSOFF = 3840, VSOFF = 3920, SW = 0;
  static constexpr float COEF = -7.0f;   // -2 x 3.5
};
template <> struct F2Geo<2> {
  static constexpr int P = 60, NS = 4;
  static constexpr u32 KREC = 32, VOFF = 1920, KSOFF = 3840, VSOFF = 3960, SW = 2;
  static constexpr float COEF = -3.0f;   // -2 x 1.5
};

// 2/2 staging swizzle at byte level (chunk bit 1 ^= row bit 0, i.e. byte bit 5 ^= bit 7) for a
// code byte offset (rows 0..29).
__host__ __device__ constexpr u32 f22_swz(u32 o) { return o ^ ((o >> 2) & 32u); }

__device__ __forceinline__ u32 lds32(u32 a) {
  u32 v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}

// D = A(16x8, row) * B(8x8, col) + C, fp16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_1688(float (&d)[4], u32 a0, u32 a1, u32 b0) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(b0));
}

// Field p (POS = 2p) of both halves of x as fp16 subnormals; B = 3: with the plane bit of the
// same coordinates from pl, which holds it SH bits below POS + 2 (SH < 0: above).
template <int B, int P, int SH>
__device__ __forceinline__ u32 f2_pair(u32 x, u32 pl) {
  const u32 lo = x & ((3u << (2 * P)) * 0x10001u);
  if constexpr (B == 2) {
    return lo;
  } else {
    const u32 sh = SH >= 0 ? pl << SH : pl >> -SH;
    return lo | (sh & ((4u << (2 * P)) * 0x10001u));
  }
}

// The logit mma's A operands of one state row for k16 chunk c of the F2 pages (page_f2,
// f2_logits_w): fields 2h, 2h + 1 (h = c & 1) of the word variant W[k] (x: the field word
// shifted by 8 (k & 1)); B = 3 merges the plane bits of pl (bytes paired at 0 and 2).
template <int B>
__device__ __forceinline__ void f2_key_ops(u32 x, u32 pl, int c, int k, u32& a0, u32& a1) {
  if (c & 1) {
    a0 = (k & 1) ? f2_pair<B, 2, 0>(x, pl) : f2_pair<B, 2, 4>(x, pl);
    a1 = (k & 1) ? f2_pair<B, 3, 1>(x, pl) : f2_pair<B, 3, 5>(x, pl);
  } else {
    a0 = (k & 1) ? f2_pair<B, 0, -2>(x, pl) : f2_pair<B, 0, 2>(x, pl);
    a1 = (k & 1) ? f2_pair<B, 1, -1>(x, pl) : f2_pair<B, 1, 3>(x, pl);
  }
}
// The value mma's A operands of field P for the pair word x and y = x >> 8 (rows g, g + 8) of the
// F2 pages (page_f2, f2_values_w): jj = 0 low halves, 1 high halves of the two states; B = 3 merges the
// plane bits of pp (the states' 16-bit plane halves side by side): the plane bit of coordinate
// 8 jj + P (row g) sits at bit 8 jj + P of pp, shifted by P + 2 - 8 jj to POS + 2; that of
// 8 jj + P + 4 (row g + 8) by P - 2 - 8 jj.
template <int B, int P>
__device__ __forceinline__ void f2_value_ops(int jj, u32 x, u32 y, u32 pp, u32& a0, u32& a1) {
  a0 = jj ? f2_pair<B, P, P - 6>(x, pp) : f2_pair<B, P, P + 2>(x, pp);
  a1 = jj ? f2_pair<B, P, P - 10>(y, pp) : f2_pair<B, P, P - 2>(y, pp);
}

// Per-lane byte offsets inside a staged 3/3 or 2/2 page (sub-tile u: + 2 STR u; state + 8:
// + STR, STR = 8 states).
template <int B>
struct F2Lane {
  static constexpr u32 STR = 8u * F2Geo<B>::KREC;
  u32 kf;     // key field words 2t, 2t + 1 of state g
  u32 kp;     // 3/3: key plane word t of state g
  u32 vf0;    // value field word g of state 2t
  u32 vf1;    // ... of state 2t + 1
  u32 soff;   // key scale of state g
  __device__ __forceinline__ void init(int g, int t) {
    const u32 ug = static_cast<u32>(g), ut = static_cast<u32>(t);
    if constexpr (B == 3) {
      kf = 48u * ug + 8u * ut;
      kp = 48u * ug + 32u + 4u * ut;
      vf0 = F2Geo<3>::VOFF + 96u * ut + 4u * ug;
      vf1 = vf0 + 48u;
    } else {
      kf = f22_swz(32u * ug + 8u * ut);
      kp = 0u;
      vf0 = f22_swz(F2Geo<2>::VOFF + 64u * ut + 4u * ug);
      vf1 = f22_swz(F2Geo<2>::VOFF + 64u * ut + 32u + 4u * ug);
    }
    soff = F2Geo<B>::KSOFF + 2u * ug;
  }
  // 3/3: value plane word g >> 1 of state 2t (+ 48: 2t + 1), relative to vf0
  static __device__ __forceinline__ u32 vplane_delta(int g) {
    return 32u + 4u * static_cast<u32>(g >> 1) - 4u * static_cast<u32>(g);
  }
};

// One full 3/3 (B = 3) or 2/2 (B = 2) page staged at shared address `buf` (2/2: swizzled).
// qf2: shared address of this lane's qfrag2[0][lane] (chunk c at + 256 c); kk: K1/K2 of heads
// 2t, 2t + 1 for this tier (as page44); hv: the tier's step (twice its half step). acc must be
// in the F2 domain. m, l, ps as in decode_page.
template <int B>
__device__ __forceinline__ void page_f2(u32 buf, u32 qf2, u32 kk, float hv, int g, int t,
                                        float (&acc)[8][4], float& m0, float& m1, float& l0,
                                        float& l1, float& ps0, float& ps1) {
  typedef F2Geo<B> G;
  constexpr int NS = G::NS;
  constexpr u32 STR = F2Lane<B>::STR;
  F2Lane<B> fl;
  fl.init(g, t);
  // ---- logits: s[u] = S^T of sub-tile u (rows g, g + 8; heads 2t, 2t + 1)
  float s[NS][4];
  uint2 kw[NS][2];
  u32 kq[NS][2][2];   // 3/3: plane bytes (0, 1) and (2, 3) of the lane's word at bytes 0, 2
#pragma unroll
  for (int u = 0; u < NS; ++u) {
    s[u][0] = s[u][1] = s[u][2] = s[u][3] = 0.0f;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      kw[u][r] = make_uint2(0u, 0u);
      kq[u][r][0] = kq[u][r][1] = 0u;
      if (16 * u + 8 * r < G::P) {   // row r can hold a state (3/3: not row g + 8 of u = 2)
        kw[u][r] = lds64(buf + fl.kf + STR * (2 * u + r));
        if constexpr (B == 3) {
          const u32 pw = lds32(buf + fl.kp + STR * (2 * u + r));
          kq[u][r][0] = __byte_perm(pw, 0u, 0x1100u);
          kq[u][r][1] = __byte_perm(pw, 0u, 0x3322u);
        }
      }
    }
  }
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const uint2 b = lds64(qf2 + 256u * c);
#pragma unroll
    for (int u = 0; u < NS; ++u) {
      u32 a[2][2];   // [row r][field 2h + f]
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int k = c >> 1;
        const u32 x = ((k >> 1) ? kw[u][r].y : kw[u][r].x) >> (8 * (k & 1));
        const u32 pl = kq[u][r][k >> 1];
        if (16 * u + 8 * r >= G::P) {
          a[r][0] = a[r][1] = 0u;
        } else {
          f2_key_ops<B>(x, pl, c, k, a[r][0], a[r][1]);
        }
      }
      mma_16816(s[u], a[0][0], a[1][0], a[0][1], a[1][1], b.x, b.y);
    }
  }
  // ---- softmax
  u32 pb[NS][2];
  fp_softmax<NS, G::P>(buf + fl.soff, buf + fl.soff + (G::VSOFF - G::KSOFF), kk, hv, G::COEF, g,
                       s, acc, pb, m0, m1, l0, l1, ps0, ps1);
  // ---- values: acc[4j + p] += V^T(coordinates 8(2g + j) + p, + 4) . P'^T
  const u32 psel = (g & 1) ? 0x7632u : 0x5410u;   // 3/3: the plane half of coordinates 16g..
  const u32 vpd = F2Lane<B>::vplane_delta(g);
#pragma unroll
  for (int u = 0; u < NS; ++u) {
    const bool k8 = 16 * u + 8 >= G::P;   // 3/3, u = 2: states 32..39 only (m16n8k8)
    const u32 base = buf + STR * (2 * u);
    u32 v[4];   // states 2t, 2t + 1, 2t + 8, 2t + 9 of the sub-tile
    v[0] = lds32(base + fl.vf0);
    v[1] = lds32(base + fl.vf1);
    v[2] = k8 ? 0u : lds32(base + STR + fl.vf0);
    v[3] = k8 ? 0u : lds32(base + STR + fl.vf1);
    u32 pp01 = 0u, pp23 = 0u;
    if constexpr (B == 3) {
      pp01 = __byte_perm(lds32(base + fl.vf0 + vpd), lds32(base + fl.vf1 + vpd), psel);
      if (!k8)
        pp23 = __byte_perm(lds32(base + STR + fl.vf0 + vpd), lds32(base + STR + fl.vf1 + vpd), psel);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const u32 sel = j ? 0x7632u : 0x5410u;
      const u32 x01 = __byte_perm(v[0], v[1], sel), y01 = x01 >> 8;
      const u32 x23 = __byte_perm(v[2], v[3], sel), y23 = x23 >> 8;
#define SKV_F2V(P_)                                                                        \
  {                                                                                        \
    u32 a0, a1, a2, a3;                                                                    \
    f2_value_ops<B, P_>(j, x01, y01, pp01, a0, a1);                                        \
    if (k8) {                                                                              \
      mma_1688(acc[4 * j + P_], a0, a1, pb[u][0]);                                         \
    } else {                                                                               \
      f2_value_ops<B, P_>(j, x23, y23, pp23, a2, a3);                                      \
      mma_16816(acc[4 * j + P_], a0, a1, a2, a3, pb[u][0], pb[u][1]);                      \
    }                                                                                      \
  }
      SKV_F2V(0) SKV_F2V(1) SKV_F2V(2) SKV_F2V(3)
#undef SKV_F2V
    }
  }
}

// ----------------------------------------------- affine path, 8/8 and 16/16 pages ----
// Fast path for full pages of the 8/8 and the 16/16 (top) tier (D = 128, 4096-byte pages),
// the tiers of the RDR mix that were left on the generic code. Page layouts (docs/format.md):
// 8/8 holds P = 15 states, key codes [15][128 B] at 0 (128-byte rows 0..14), value codes at 1920
// (rows 15..29), key scales at 3840, value scales at 3870 (row 30); 16/16 holds P = 8 states,
// keys [8][256 B] at 0 (rows 0..15, state s = rows 2s, 2s + 1), values at 2048 (rows 16..31),
// no scales (s_K = s_V = sqrt(D), as decode_page's `top`). One page is one 16-state sub-tile
// (8/8: slot 15 masked in the softmax; 16/16: rows g + 8 are never states, their operands are
// zero and the values take one m16n8k8 mma per block), one softmax step (fp_softmax), no
// predication.
//
// 8/8, the F8 domain: a byte masked into an otherwise zero fp16 is the exact subnormal c 2^-24
// (c <= 255 < 2^10). Bytes 0 and 2 of a word are one lop3 (x & 0x00ff00ff), bytes 1 and 3 one
// prmt (with zero); so the logits take one instruction per pair of codes and a query fragment
// of their own (qfrag8: chunk c of lane (g, t) holds head g's q~ of coordinates
// 32t + 4c + (0, 2) in b0 and + (1, 3) in b1, at their plain fp16 value: no rounding beyond
// decode_page's). The values pair the same byte of two states (coordinate 16g + 8j + p of states 2t,
// 2t + 1): one prmt per two pairs, then a lop3 or a prmt per pair (1.5 per pair). The
// accumulators stay in the 4/4 path's F44 domain (acc[4j + p] carries 2^(4 (p & 1) - 24)): the
// operands of the odd blocks are multiplied by 16 (one exact HMUL2 per pair of codes: c 2^-20 is
// an fp16 for c <= 255), so 4/4 and 8/8 pages, neighbours in a row ordered by tier, share the
// domain, and a third domain (a loop-carried flag: ptxas spilled at 128 registers) is not
// needed. The offset u = c - 127.5 enters as the 4/4 path's: K2 per head, coefficient -255 on
// ps.
// 16/16: the fp16 words go to the mma as they are, in the generic path's k order (qfrag, decode_page's
// fragment; one prmt per operand, as tile_logits does), the values in the generic domain (one
// prmt per operand, as tile_values): the same products and sums as decode_page.
//
// Shared-memory banks: 8/8 pages are staged with the XOR swizzle slot ^= row & 7 (rows 0..29;
// the scale rows 30, 31 in place): a key load (chunks 2t, 2t + 1 of state g) and a value load
// (chunk g of states 2t, 2t + 1, + 8, + 9) are conflict-free. 16/16 pages with
// slot ^= 4 ((row >> 1) ^ (row >> 3) & 1) | (row >> 2) & 1: the key loads (chunk t + 4i of
// state g, rows 2g, 2g + 1) and the value loads (chunks 2g, 2g + 1 of states 2t, 2t + 1) are
// conflict-free.
//
// Error bound: 8/8 operands are exact except q~ (decode_page's rounding), the accumulation is fp32 over
// c in [0, 255] times a step 16x smaller than 4/4's, so partial sums and the offset term have the
// 4/4 path's size in units of the logit (docs/PERF_NOTES.md "Error budget"). 16/16 adds
// no rounding to decode_page's.


constexpr u32 F8_VROW = 15, F8_KSOFF = 3840, F8_VSOFF = 3870;
constexpr u32 F16_VROW = 16;

// 16-byte chunk slot of chunk x (0..7) of 128-byte row `row` in a staged 8/8 page (rows 0..29).
__host__ __device__ constexpr u32 f8_slot(u32 row, u32 x) { return 8u * row + (x ^ (row & 7u)); }
// ... of a staged 16/16 page (rows 0..31).
__host__ __device__ constexpr u32 f16_swz(u32 row) {
  return ((((row >> 1) ^ (row >> 3)) & 1u) << 2) | ((row >> 2) & 1u);
}
__host__ __device__ constexpr u32 f16_slot(u32 row, u32 x) { return 8u * row + (x ^ f16_swz(row)); }

// Staging (lane l copies chunks l + 32 i, i = 0..7: row l / 8 + 4 i, in-row chunk l & 7;
// stage_rounds).
__device__ __forceinline__ void f8_stage(u32 dst, const u32* src_page, int lane) {
  const u32 l = static_cast<u32>(lane);
  const u32 d0 = dst + 16u * (l ^ (l >> 3)), d1 = dst + 16u * (l ^ (l >> 3) ^ 4u);   // i even, odd
  stage_rounds<16>(dst, src_page, lane, d0, d1, d0, d1);   // rows 30, 31 in place
}
__device__ __forceinline__ void f16_stage(u32 dst, const u32* src_page, int lane) {
  const u32 l = static_cast<u32>(lane);
  const u32 b = l ^ (((l >> 4) & 1u) << 2);   // row bit 1 = lane bit 4; bits 2, 3 = i bits 0, 1
  stage_rounds<32>(dst, src_page, lane, dst + 16u * b, dst + 16u * (b ^ 1u), dst + 16u * (b ^ 4u),
                   dst + 16u * (b ^ 5u));
}

// c 2^-24 -> c 2^-20 in both halves (c <= 255: exact, a normal or subnormal fp16; the fp16
// multiply keeps subnormals).
__device__ __forceinline__ u32 f8_x16(u32 a) {
  return h2_as_u32(__hmul2(u32_as_h2(a), __floats2half2_rn(16.0f, 16.0f)));
}

// Lane (g, t)'s key chunks 2t, 2t + 1 of rows g and g + 8 of a page staged by f8_stage (page_f8,
// page44w): kw[r][e] = chunk 2t + e of row g + 8 r.
__device__ __forceinline__ void f8_key_chunks(u32 buf, u32 ug, u32 ut, uint4 (&kw)[2][2]) {
  const u32 k0 = 16u * f8_slot(ug, 2u * ut);   // chunk 2t + 1: slot bit 0 flipped (k0 ^ 16)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    kw[r][0] = lds128(buf + k0 + 1024u * r);
    kw[r][1] = lds128(buf + (k0 ^ 16u) + 1024u * r);
  }
}
// ... and its value chunk g of states 2t, 2t + 1, 2t + 8, 2t + 9 (rows F8_VROW + state).
__device__ __forceinline__ void f8_value_chunks(u32 buf, u32 ug, u32 ut, uint4 (&v)[4]) {
  const u32 va = buf + 16u * f8_slot(F8_VROW + 2u * ut, ug);
  const u32 vb = buf + 16u * f8_slot(F8_VROW + 1u + 2u * ut, ug);
  v[0] = lds128(va);
  v[1] = lds128(vb);
  v[2] = lds128(va + 1024u);   // 8 rows on: the same swizzle
  v[3] = lds128(vb + 1024u);
}

// One full 8/8 page staged (swizzled) at shared address `buf`. qf8: shared address of this
// lane's qfrag8[0][lane] (chunk c at + 256 c); kk: K1/K2 of heads 2t, 2t + 1 for the tier (as
// page44); hv: the tier's step (twice its half step). acc must be in the F44 domain.
__device__ __forceinline__ void page_f8(u32 buf, u32 qf8, u32 kk, float hv, int g, int t,
                                        float (&acc)[8][4], float& m0, float& m1, float& l0,
                                        float& l1, float& ps0, float& ps1) {
  const u32 ug = static_cast<u32>(g), ut = static_cast<u32>(t);
  // ---- logits: rows g, g + 8 (state g + 8 = 15 is masked: its bytes are value codes); lane
  // (g, t) reads chunks 2t, 2t + 1 (words 8t .. 8t + 7, chunk c of the mma takes word 8t + c);
  // even and odd chunks on two accumulators (two mma chains of 4)
  uint4 kw[2][2];   // [row r][chunk 2t + e]
  f8_key_chunks(buf, ug, ut, kw);
  float s[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}}, s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const uint2 b = lds64(qf8 + 256u * c);
    const u32 x0 = word_of(kw[0][c >> 2], c & 3), x1 = word_of(kw[1][c >> 2], c & 3);
    mma_16816((c & 1) ? s1 : s[0], x0 & 0x00ff00ffu, x1 & 0x00ff00ffu,
              __byte_perm(x0, 0u, 0x4341u), __byte_perm(x1, 0u, 0x4341u), b.x, b.y);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) s[0][k] += s1[k];
  // ---- softmax
  u32 pb[1][2];
  fp_softmax<1, 15>(buf + F8_KSOFF + 2u * ug, buf + F8_VSOFF + 2u * ug, kk, hv, -255.0f, g, s,
                    acc, pb, m0, m1, l0, l1, ps0, ps1);
  // ---- values: acc[4j + p] += V^T(coordinates 16g + 8j + p, + 4) . P'^T; lane (g, t) reads
  // chunk g of states 2t, 2t + 1, 2t + 8, 2t + 9 (2t + 9 = 15 at t = 3: row 30, masked)
  uint4 v[4];
  f8_value_chunks(buf, ug, ut, v);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    u32 a[4][4];   // [operand: row g | g + 8 of states (2t, 2t + 1) | (2t + 8, 2t + 9)][p]
#pragma unroll
    for (int o = 0; o < 4; ++o) {
      const int w = 2 * j + (o & 1);        // word: coordinates 16g + 4w .. + 3
      const u32 xa = word_of(v[o & 2], w), xb = word_of(v[(o & 2) + 1], w);
      const u32 e = __byte_perm(xa, xb, 0x6420u), od = __byte_perm(xa, xb, 0x7531u);
      a[o][0] = e & 0x00ff00ffu;
      a[o][1] = od & 0x00ff00ffu;
      a[o][2] = __byte_perm(e, 0u, 0x4341u);
      a[o][3] = __byte_perm(od, 0u, 0x4341u);
    }
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      if (p & 1) {   // the F44 domain's odd blocks carry 2^-20: c 2^-24 x 16, exact in fp16
#pragma unroll
        for (int o = 0; o < 4; ++o) a[o][p] = f8_x16(a[o][p]);
      }
      mma_16816(acc[4 * j + p], a[0][p], a[1][p], a[2][p], a[3][p], pb[0][0], pb[0][1]);
    }
  }
}

// The values of the 8 states 2t, 2t + 1 (k of one m16n8k8 mma per block) of a 16/16 page (page_f16,
// page1616w): v[x][e] = chunk e of this lane's NV (its coordinates 8 NV g ..) of state 2t + x;
// acc[4j + p] takes coordinate 8 NV g + 8j + p (word 4j + (p >> 1), half p & 1) and + 4 (word + 2).
template <int NV>
__device__ __forceinline__ void f16_values_k8(const uint4 (&v)[2][NV], u32 pb0, float (&acc)[4 * NV][4]) {
#pragma unroll
  for (int j = 0; j < NV; ++j) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int w = 4 * j + (p >> 1);
      const u32 sel = (p & 1) ? 0x7632u : 0x5410u;
      const u32 a0 = __byte_perm(word_of(v[0][w >> 2], w & 3), word_of(v[1][w >> 2], w & 3), sel);
      const u32 a1 = __byte_perm(word_of(v[0][(w + 2) >> 2], (w + 2) & 3),
                                 word_of(v[1][(w + 2) >> 2], (w + 2) & 3), sel);
      mma_1688(acc[4 * j + p], a0, a1, pb0);
    }
  }
}

// One full 16/16 page staged (swizzled) at shared address `buf`. qf: shared address of this
// lane's qfrag[0][lane] (decode_page's fragment, chunk c at + 256 c); kk: {kfac[2t], 0, kfac[2t + 1], 0}.
// acc in the generic domain.
__device__ __forceinline__ void page_f16(u32 buf, u32 qf, u32 kk, int g, int t,
                                         float (&acc)[8][4], float& m0, float& m1, float& l0,
                                         float& l1, float& ps0, float& ps1) {
  const u32 ug = static_cast<u32>(g), ut = static_cast<u32>(t);
  // ---- logits: row g = state g (rows g + 8: zero operands); chunk (i, h) takes words
  // 4w + h, 4w + h + 2 of coordinate group w = t + 4i (chunk w of the state's 256 bytes: row
  // 2g + (i >> 1), in-row chunk t + 4 (i & 1))
  const u32 ka = 16u * f16_slot(2u * ug, ut);   // i = 0; i = 1: slot bit 2 flipped (ka ^ 64)
  uint4 kw[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) kw[i] = lds128(buf + ((i & 1) ? (ka ^ 64u) : ka) + 128u * (i >> 1));
  float s[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}}, s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const uint2 b = lds64(qf + 256u * c);
    const int i = c >> 1, h = c & 1;
    const u32 x = word_of(kw[i], h), y = word_of(kw[i], h + 2);
    mma_16816((c & 1) ? s1 : s[0], __byte_perm(x, y, 0x5410u), 0u, __byte_perm(x, y, 0x7632u),
              0u, b.x, b.y);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) s[0][k] += s1[k];
  // ---- softmax (s_K = s_V = sqrt(D); no code offset)
  u32 pb[1][2];
  fp_softmax<1, 8, false>(0u, 0u, kk, 11.313708498984761f, 0.0f, g, s, acc, pb, m0, m1, l0, l1,
                          ps0, ps1);
  // ---- values: acc[4j + p] += V^T(coordinates 16g + 8j + p, + 4) . P'^T over states 0..7
  // (m16n8k8); lane (g, t) reads chunks 2g, 2g + 1 (words 8g .. 8g + 7) of states 2t, 2t + 1
  const u32 va = 16u * f16_slot(F16_VROW + 4u * ut + (ug >> 2), (2u * ug) & 7u);
  const u32 vb = 16u * f16_slot(F16_VROW + 2u + 4u * ut + (ug >> 2), (2u * ug) & 7u);
  uint4 v[2][2];   // [state 2t | 2t + 1][chunk 2g | 2g + 1]: chunk 2g + 1 flips slot bit 0
  v[0][0] = lds128(buf + va);
  v[0][1] = lds128(buf + (va ^ 16u));
  v[1][0] = lds128(buf + vb);
  v[1][1] = lds128(buf + (vb ^ 16u));
  f16_values_k8(v, pb[0][0], acc);
}

// ------------------------------------------------------ affine path, D = 256 pages ----
// Fast paths for full pages at D = 256 (4096-byte pages): page44w (4/4), page22w (2/2),
// page33w (3/3), page88w (8/8), page1616w (16/16). They decode in the accumulator domains of
// the D = 128 fast pages (F44: 4/4 and 8/8; F2: 3/3 and 2/2; generic: 16/16) and keep
// the generic value map of D = 256: lane g holds coordinates 32g .. 32g + 31 (vgroup: groups
// 4g + j), acc[4j + p] the coordinates 32g + 8j + p (row g) and + 4 (row g + 8). Each page is
// one softmax step (fp_softmax). Two of the layouts are D = 128 layouts byte for byte, so their
// stagings carry over: 4/4 at 256 is the 8/8 page of 128 (15 states, 128-byte records, scales at
// 3840 and 3870: f8_stage) and 2/2 at 256 the 4/4 page of 128 (31 states, 64-byte records, scales
// at 3968 and 4030: f44_stage, F44Lane's offsets). 3/3 (20 states, 96-byte records: 64 bytes of
// 2-bit fields, then 32 bytes of plane bits; scales at 3840 and 3880) is staged plainly; 8/8 (7
// states, 256-byte records, scales at 3584 and 3598) with f88_swz; 16/16 (4 states, 512-byte
// records, no scales) with f1616_swz.
//
// Logit lane maps (lane = 4g + t; the k order of each tier is its own and its query fragment's,
// built in decode_cta with the same coordinates):
//   4/4: chunks 2t, 2t + 1 of state g's record (key words 8t .. 8t + 7); chunk c = 2i + h of the
//     mma takes word 8t + i, fields (2h, 2h + 4) and (2h + 1, 2h + 5) as page44 does (qfrag44).
//   2/2: chunk t (key words 4t .. 4t + 3, coordinates 64t ..); chunk c = 2k + h takes
//     W[k] = word k >> 1, shifted by 8 (k & 1), fields 2h, 2h + 1 as page_f2<2> (qfrag2).
//   3/3: the same field words and plane words 2t, 2t + 1 (coordinates 64t .. 64t + 63), the plane
//     bits merged as page_f2<3> (qfrag2).
//   8/8: chunks t, t + 4, t + 8, t + 12 (coordinates 16t + 64e + 0..15); chunk c = 4e + w takes
//     word w of chunk t + 4e, bytes (0, 2) and (1, 3) as page_f8 (qfrag8).
//   16/16: chunks t + 4i (coordinate groups t + 4i, decode_page's k order and fragment qfrag).
// Error bounds: those of the D = 128 page of the same tier (the operands are the same fp16
// values; a logit sums twice the terms, as decode_page's at D = 256).

constexpr u32 F88_VROW = 7, F88_KSOFF = 3584, F88_VSOFF = 3598;
constexpr u32 F33_VOFF = 1920, F33_KSOFF = 3840, F33_VSOFF = 3880;

// 16-byte chunk swizzle of 256-byte row `row` of a staged D = 256 8/8 page (slot = chunk ^ it):
// key rows 0..6 flip bit 2 on odd rows (the 8 lanes of a 16-byte load phase, states g, g + 1 and
// chunks t + 4e, then hit 8 distinct bank groups); value rows 7..13 take bits 0 and 2 from bits 1
// and 2 of the row (chunks 2g + e of states 2t, 2t + 1: distinct over t); rows 14, 15 (scales,
// padding) stay in place.
__host__ __device__ constexpr u32 f88_swz(u32 row) {
  return row < 7u ? 4u * (row & 1u)
       : row < 14u ? (((row >> 1) & 1u) | (((row >> 1) & 2u) << 1)) : 0u;
}
__device__ __forceinline__ void f88_stage(u32 dst, const u32* src_page, int lane) {
  const u32 l = static_cast<u32>(lane);
  const char* src = reinterpret_cast<const char*>(src_page) + 16 * lane;
#pragma unroll
  for (u32 i = 0; i < 8; ++i) {   // chunk l + 32 i: row l / 16 + 2 i, in-row chunk l % 16
    const u32 row = (l >> 4) + 2u * i;
    cp_async16_sh(dst + 16u * (16u * row + ((l & 15u) ^ f88_swz(row))), src + 512 * i);
  }
}

// One full D = 256 4/4 page staged by f8_stage at `buf`. qf7: this lane's qfrag44[0][lane]; kk,
// hv as page44. acc in the F44 domain.
__device__ __forceinline__ void page44w(u32 buf, u32 qf7, u32 kk, float hv, int g, int t,
                                        float (&acc)[16][4], float& m0, float& m1, float& l0,
                                        float& l1, float& ps0, float& ps1) {
  const u32 ug = static_cast<u32>(g), ut = static_cast<u32>(t);
  // ---- logits: rows g, g + 8 (state 15 is masked: its bytes are value codes)
  uint4 kw[2][2];   // [row r][chunk 2t + e]
  f8_key_chunks(buf, ug, ut, kw);
  float s[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}}, s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const u32 w0 = word_of(kw[0][i >> 2], i & 3), w1 = word_of(kw[1][i >> 2], i & 3);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint2 b = lds64(qf7 + 256u * (2 * i + h));
      const u32 x0 = h ? w0 >> 8 : w0, x1 = h ? w1 >> 8 : w1;
      mma_16816(h ? s1 : s[0], f44_pair<0>(x0), f44_pair<0>(x1), f44_pair<4>(x0),
                f44_pair<4>(x1), b.x, b.y);
    }
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) s[0][k] += s1[k];
  // ---- softmax
  u32 pb[1][2];
  fp_softmax<1, 15>(buf + F8_KSOFF + 2u * ug, buf + F8_VSOFF + 2u * ug, kk, hv, -15.0f, g, s, acc,
                    pb, m0, m1, l0, l1, ps0, ps1);
  // ---- values: chunk g (value words 4g .. 4g + 3) of states 2t, 2t + 1, 2t + 8, 2t + 9
  uint4 v[4];
  f8_value_chunks(buf, ug, ut, v);
  u32 w[4][4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int j = 0; j < 4; ++j) w[k][j] = word_of(v[k], j);
  }
  f44_values_w(w, pb[0][0], pb[0][1], acc);
}

// The F2 values of one D = 256 sub-tile (16 states, or with K8 the 8 states 2t, 2t + 1 of the k8
// mma; page22w, page33w): f[k] = field words 2g, 2g + 1 of state 2t, 2t + 1, 2t + 8, 2t + 9
// (k = 0..3); at 3 bits pp[fw][0 | 1] = the plane bits of field word fw of states (2t, 2t + 1) |
// (2t + 8, 2t + 9), the two states' 16-bit halves side by side. acc[4j + p] takes field p of the
// pair word of the low (j even) or high halves of field word j / 2; the operands as page_f2's
// (f2_value_ops).
template <int B, bool K8>
__device__ __forceinline__ void f2_values_w(const uint2 (&f)[4], const u32 (&pp)[2][2], u32 pb0,
                                            u32 pb1, float (&acc)[16][4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int fw = j >> 1, jj = j & 1;
    const u32 sel = jj ? 0x7632u : 0x5410u;
    const u32 x01 = __byte_perm(fw ? f[0].y : f[0].x, fw ? f[1].y : f[1].x, sel), y01 = x01 >> 8;
    const u32 x23 = __byte_perm(fw ? f[2].y : f[2].x, fw ? f[3].y : f[3].x, sel), y23 = x23 >> 8;
#define SKV_F2W(P_)                                                                          \
  {                                                                                          \
    u32 a0, a1, a2, a3;                                                                      \
    f2_value_ops<B, P_>(jj, x01, y01, pp[fw][0], a0, a1);                                    \
    if constexpr (K8) {                                                                      \
      mma_1688(acc[4 * j + P_], a0, a1, pb0);                                                \
    } else {                                                                                 \
      f2_value_ops<B, P_>(jj, x23, y23, pp[fw][1], a2, a3);                                  \
      mma_16816(acc[4 * j + P_], a0, a1, a2, a3, pb0, pb1);                                  \
    }                                                                                        \
  }
    SKV_F2W(0) SKV_F2W(1) SKV_F2W(2) SKV_F2W(3)
#undef SKV_F2W
  }
}

// The logits of one 16-state sub-tile of 2- or 3-bit codes at D = 256: kw[r] = key field words
// 4t .. 4t + 3 of row r's state, kq[r] = its plane words 2t, 2t + 1 (3 bits); row 1 (state
// rows g + 8) has zero operands unless row1. s: the sub-tile's logits (even and odd chunks on
// two mma chains, added at the end).
template <int B>
__device__ __forceinline__ void f2_logits_w(const uint4 (&kw)[2], const uint2 (&kq)[2], bool row1,
                                            u32 qf2, float (&s)[4]) {
  float s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  s[0] = s[1] = s[2] = s[3] = 0.0f;
#pragma unroll
  for (int c = 0; c < 16; ++c) {
    const uint2 b = lds64(qf2 + 256u * c);
    const int k = c >> 1, fw = k >> 1;
    u32 a[2][2];   // [row r][field 2h + f]
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const u32 x = word_of(kw[r], fw) >> (8 * (k & 1));
      // plane bits of field word fw: bytes 2 (fw & 1), + 1 of plane word fw >> 1, at bytes 0, 2
      const u32 pw = (fw >> 1) ? kq[r].y : kq[r].x;
      const u32 pl = B == 3 ? __byte_perm(pw, 0u, (fw & 1) ? 0x3322u : 0x1100u) : 0u;
      if (r == 1 && !row1) {
        a[r][0] = a[r][1] = 0u;
      } else {
        f2_key_ops<B>(x, pl, c, k, a[r][0], a[r][1]);
      }
    }
    mma_16816((c & 1) ? s1 : s, a[0][0], a[1][0], a[0][1], a[1][1], b.x, b.y);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) s[k] += s1[k];
}

// One full D = 256 2/2 page staged by f44_stage at `buf` (the D = 128 4/4 layout). qf2: this
// lane's qfrag2[0][lane]; kk: K1/K2 of the 2/2 tier (k12b[0]); hv: its step. acc in the F2
// domain.
__device__ __forceinline__ void page22w(u32 buf, u32 qf2, u32 kk, float hv, int g, int t,
                                        float (&acc)[16][4], float& m0, float& m1, float& l0,
                                        float& l1, float& ps0, float& ps1) {
  F44Lane fl;
  fl.init(g, t);
  float s[2][4];
  const uint2 nq[2] = {make_uint2(0u, 0u), make_uint2(0u, 0u)};
#pragma unroll
  for (int u = 0; u < 2; ++u) {   // states g, g + 8 (u = 0); 16 + g, 24 + g (u = 1)
    const uint4 kw[2] = {lds128(buf + fl.koff + 1024u * u), lds128(buf + fl.koff + 1024u * u + 512u)};
    f2_logits_w<2>(kw, nq, true, qf2, s[u]);
  }
  u32 pb[2][2];
  fp_softmax<2, 31>(buf + fl.soff, buf + fl.soff + (F44_VSOFF - F44_KSOFF), kk, hv,
                    F2Geo<2>::COEF, g, s, acc, pb, m0, m1, l0, l1, ps0, ps1);
  const u32 npp[2][2] = {{0u, 0u}, {0u, 0u}};
#pragma unroll
  for (int u = 0; u < 2; ++u) {   // value words 2g, 2g + 1 of states 2t, 2t + 1, + 8, + 9
    const uint2 v[4] = {lds64(buf + fl.voff0 + 1024u * u), lds64(buf + fl.voff1 + 1024u * u),
                        lds64(buf + fl.voff0 + 1024u * u + 512u),
                        lds64(buf + fl.voff1 + 1024u * u + 512u)};
    f2_values_w<2, false>(v, npp, pb[u][0], pb[u][1], acc);
  }
}

// One full D = 256 3/3 page staged plainly at `buf` (20 states: sub-tile 0 holds states 0..15,
// sub-tile 1 states 16..19, its values one m16n8k8 mma per block). qf2, kk (k12b[1]), hv as
// page22w. acc in the F2 domain.
__device__ __forceinline__ void page33w(u32 buf, u32 qf2, u32 kk, float hv, int g, int t,
                                        float (&acc)[16][4], float& m0, float& m1, float& l0,
                                        float& l1, float& ps0, float& ps1) {
  constexpr u32 REC = 96, PLANE = 64;
  const u32 ug = static_cast<u32>(g), ut = static_cast<u32>(t);
  float s[2][4];
#pragma unroll
  for (int u = 0; u < 2; ++u) {   // rows 16u + g, 16u + 8 + g (u = 1: one row of states)
    uint4 kw[2];
    uint2 kq[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      kw[r] = make_uint4(0u, 0u, 0u, 0u);
      kq[r] = make_uint2(0u, 0u);
      if (u == 0 || r == 0) {
        const u32 rec = buf + REC * (16u * u + 8u * r + ug);
        kw[r] = lds128(rec + 16u * ut);
        kq[r] = lds64(rec + PLANE + 8u * ut);
      }
    }
    f2_logits_w<3>(kw, kq, u == 0, qf2, s[u]);
  }
  u32 pb[2][2];
  fp_softmax<2, 20>(buf + F33_KSOFF + 2u * ug, buf + F33_VSOFF + 2u * ug, kk, hv, F2Geo<3>::COEF,
                    g, s, acc, pb, m0, m1, l0, l1, ps0, ps1);
  // ---- values: field words 2g, 2g + 1 and plane word g of states 2t, 2t + 1 (+ 8, + 9)
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    uint2 f[4];
    u32 pw[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f[k] = make_uint2(0u, 0u);
      pw[k] = 0u;
      if (u == 0 || (k < 2 && ut < 2)) {   // sub-tile 1: states 16..19 (2t + x < 4)
        const u32 rec = buf + F33_VOFF + REC * (16u * u + 2u * ut + (k & 1) + 8u * (k >> 1));
        f[k] = lds64(rec + 8u * ug);
        pw[k] = lds32(rec + PLANE + 4u * ug);
      }
    }
    u32 pp[2][2];   // [field word][states (2t, 2t + 1) | (2t + 8, 2t + 9)]
#pragma unroll
    for (int fw = 0; fw < 2; ++fw) {
      pp[fw][0] = __byte_perm(pw[0], pw[1], fw ? 0x7632u : 0x5410u);
      pp[fw][1] = __byte_perm(pw[2], pw[3], fw ? 0x7632u : 0x5410u);
    }
    if (u == 0) f2_values_w<3, false>(f, pp, pb[u][0], pb[u][1], acc);
    else f2_values_w<3, true>(f, pp, pb[u][0], pb[u][1], acc);
  }
}

// One full D = 256 8/8 page staged by f88_stage at `buf` (7 states: rows g; rows g + 8 are never
// states, their operands are zero and the values take one m16n8k8 mma per block). qf8: this
// lane's qfrag8[0][lane]; kk: K1/K2 of the 8/8 tier (k12c[0]); hv: its step. acc in the F44
// domain.
__device__ __forceinline__ void page88w(u32 buf, u32 qf8, u32 kk, float hv, int g, int t,
                                        float (&acc)[16][4], float& m0, float& m1, float& l0,
                                        float& l1, float& ps0, float& ps1) {
  const u32 ug = static_cast<u32>(g), ut = static_cast<u32>(t);
  // ---- logits: row g (state 7 masked: its bytes are value codes); chunks t + 4e of its record
  const u32 krow = buf + 256u * ug, ksw = f88_swz(ug);
  uint4 kw[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) kw[e] = lds128(krow + 16u * ((ut + 4u * e) ^ ksw));
  float s[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}}, s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int c = 0; c < 16; ++c) {
    const uint2 b = lds64(qf8 + 256u * c);
    const u32 x = word_of(kw[c >> 2], c & 3);
    mma_16816((c & 1) ? s1 : s[0], x & 0x00ff00ffu, 0u, __byte_perm(x, 0u, 0x4341u), 0u, b.x, b.y);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) s[0][k] += s1[k];
  // ---- softmax
  u32 pb[1][2];
  fp_softmax<1, 7>(buf + F88_KSOFF + 2u * ug, buf + F88_VSOFF + 2u * ug, kk, hv, -255.0f, g, s,
                   acc, pb, m0, m1, l0, l1, ps0, ps1);
  // ---- values: chunks 2g, 2g + 1 (coordinates 32g ..) of states 2t, 2t + 1; state 7 (P' = 0)
  // reads state 0's row, whose swizzle completes the others' (row 14, unswizzled, would not)
  uint4 v[2][2];   // [state 2t + x][chunk 2g + e]
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const u32 row = (x && ut == 3u) ? F88_VROW : F88_VROW + 2u * ut + static_cast<u32>(x);
#pragma unroll
    for (int e = 0; e < 2; ++e) v[x][e] = lds128(buf + 16u * (16u * row + ((2u * ug + e) ^ f88_swz(row))));
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    u32 a[2][4];   // [operand: row g (word 2j) | g + 8 (word 2j + 1)][p]
#pragma unroll
    for (int o = 0; o < 2; ++o) {
      const int w = 2 * j + o;   // word w of the lane's 8: coordinates 32g + 4w .. + 3
      const u32 xa = word_of(v[0][w >> 2], w & 3), xb = word_of(v[1][w >> 2], w & 3);
      const u32 e = __byte_perm(xa, xb, 0x6420u), od = __byte_perm(xa, xb, 0x7531u);
      a[o][0] = e & 0x00ff00ffu;
      a[o][1] = od & 0x00ff00ffu;
      a[o][2] = __byte_perm(e, 0u, 0x4341u);
      a[o][3] = __byte_perm(od, 0u, 0x4341u);
    }
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      if (p & 1) { a[0][p] = f8_x16(a[0][p]); a[1][p] = f8_x16(a[1][p]); }   // F44 odd blocks
      mma_1688(acc[4 * j + p], a[0][p], a[1][p], pb[0][0]);
    }
  }
}

// 16-byte chunk swizzle of 128-byte row `row` of a staged D = 256 16/16 page (slot = chunk ^ it):
// key rows 0..15 (state row >> 2) flip bit 2 for odd states (a key load phase, states g, g + 1 and
// chunks t + 4i, then hits 8 bank groups), value rows 16..31 (state (row >> 2) - 4) bit 1 for
// states 2, 3 (chunk 4g + e of states 2t + x: distinct over t). Row r's swizzle is a constant of
// the staging round r / 4 (f1616_stage).
__host__ __device__ constexpr u32 f1616_swz(u32 row) {
  return row < 16u ? 4u * ((row >> 2) & 1u) : 2u * ((row >> 3) & 1u);
}
__device__ __forceinline__ void f1616_stage(u32 dst, const u32* src_page, int lane) {
  const u32 l = static_cast<u32>(lane);
  const char* src = reinterpret_cast<const char*>(src_page) + 16 * lane;
  const u32 d0 = dst + 16u * l, d4 = dst + 16u * (l ^ 4u), d2 = dst + 16u * (l ^ 2u);
  // round i: rows 4i .. 4i + 3 (chunk l + 32 i: row l / 8 + 4 i), swizzle f1616_swz(4 i)
  cp_async16_off<0>(d0, src);
  cp_async16_off<512>(d4, src);
  cp_async16_off<1024>(d0, src);
  cp_async16_off<1536>(d4, src);
  cp_async16_off<2048>(d0, src);
  cp_async16_off<2560>(d0, src);
  cp_async16_off<3072>(d2, src);
  cp_async16_off<3584>(d2, src);
}

// One full D = 256 16/16 page staged by f1616_stage at `buf` (4 states, no scales: s_K = s_V =
// sqrt(D)). Logits: row g = state g (rows g >= 4 and g + 8 hold no state; the latter's operands
// are zero), chunks t + 4i of its key record (coordinate group t + 4i), decode_page's fragment
// (qf: this lane's qfrag[0][lane]) and k order, as page_f16; kk: {kfac[2t], 0, kfac[2t + 1], 0}.
// Values: chunks 4g .. 4g + 3 (coordinates 32g ..) of states 2t, 2t + 1 (t < 2), one m16n8k8
// mma per block. acc in the generic domain.
__device__ __forceinline__ void page1616w(u32 buf, u32 qf, u32 kk, int g, int t,
                                          float (&acc)[16][4], float& m0, float& m1, float& l0,
                                          float& l1, float& ps0, float& ps1) {
  const u32 ug = static_cast<u32>(g), ut = static_cast<u32>(t);
  float s[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}}, s1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const u32 kswz = 4u * (ug & 1u);   // f1616_swz of state g's key rows
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const u32 x = ut + 4u * i;   // chunk of the 512-byte record: row 4g + x / 8, in-row chunk x % 8
    const uint4 kw = lds128(buf + 16u * (32u * ug + (x & ~7u) + ((x & 7u) ^ kswz)));
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint2 b = lds64(qf + 256u * (2 * i + h));
      const u32 w0 = word_of(kw, h), w2 = word_of(kw, h + 2);
      mma_16816(h ? s1 : s[0], __byte_perm(w0, w2, 0x5410u), 0u, __byte_perm(w0, w2, 0x7632u), 0u,
                b.x, b.y);
    }
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) s[0][k] += s1[k];
  u32 pb[1][2];
  fp_softmax<1, 4, false>(0u, 0u, kk, 16.0f, 0.0f, g, s, acc, pb, m0, m1, l0, l1, ps0, ps1);
  // ---- values: v[x][e] = chunk 4g + e of state 2t + x (states 4.. do not exist: zero, P' = 0)
  uint4 v[2][4];
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    const u32 st = 2u * ut + static_cast<u32>(x), row0 = F16_VROW + 4u * st + (ug >> 1);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      v[x][e] = make_uint4(0u, 0u, 0u, 0u);
      if (ut < 2u) v[x][e] = lds128(buf + 16u * (8u * row0 + ((4u * (ug & 1u) + e) ^ f1616_swz(row0))));
    }
  }
  f16_values_k8(v, pb[0][0], acc);
}

// Moves the value accumulators between domains: 0 = generic scale, 1 = F44 (page44: acc[i]
// carries 2^(4 (i & 1) - 24); 2 = F2 (page_f2: 2^(2 (i & 3) - 24)).
// Exact power-of-two multiplies.
__host__ __device__ constexpr int f7_dom_exp(int dom, int i) {
  return dom == 0 ? 0 : dom == 1 ? 4 * (i & 1) - 24 : 2 * (i & 3) - 24;
}
template <int D, int FROM, int TO>
__device__ __forceinline__ void domain_scale(float (&acc)[D / 16][4]) {
  if constexpr (D >= 128) {   // the fast pages' domains (D = 128, 256)
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      const float f = __int_as_float((127 + f7_dom_exp(TO, i) - f7_dom_exp(FROM, i)) << 23);
      acc[i][0] *= f; acc[i][1] *= f; acc[i][2] *= f; acc[i][3] *= f;
    }
  }
}
// The page loop's domain state: d44 (F44), d2 (F2), neither: generic. To the domain of the
// next page (w44, w2), in one pass.
template <int D>
__device__ __forceinline__ void domain_move(float (&acc)[D / 16][4], bool& d44, bool& d2, bool w44,
                                        bool w2) {
  if (d44 == w44 && d2 == w2) return;
  if (d44) {
    if (w2) domain_scale<D, 1, 2>(acc); else domain_scale<D, 1, 0>(acc);
  } else if (d2) {
    if (w44) domain_scale<D, 2, 1>(acc); else domain_scale<D, 2, 0>(acc);
  } else {
    if (w44) domain_scale<D, 0, 1>(acc); else domain_scale<D, 0, 2>(acc);
  }
  d44 = w44;
  d2 = w2;
}


// A page of kind 0 or 1 on decode_page inside the affine page loop (c: its packed header; a partial
// page re-reads its id from `indices`, a full one is staged at shared address bsh).
template <int D, int PATH, int NSUB, class SM, class QF>
__device__ __forceinline__ void decode_generic(const u32* __restrict__ pages, int page_words,
                                               const int* __restrict__ indices,
                                               const int* __restrict__ geom, u32 prange, int pi,
                                               u32 c, u32 bsh, SM& sm, const QF& qsrc,
                                               const Luts& lut, __half* pt, int g, int t,
                                               float (&acc)[D / 16][4], float& m0, float& m1,
                                               float& l0, float& l1, float& ps0, float& ps1) {
  const int count = static_cast<int>(c & 0xffffu);
  const int* gm = geom + static_cast<int>((c >> 16) & 0xfffu) * SKV_GEOM_STRIDE;
  if ((c >> 28) == 1) {
    SharedRow r;
    r.a = bsh;
    decode_page<D, PATH, NSUB>(r, gm, count, qsrc, lut, sm.kfac, sm.qmu, sm.hstep,
                                           sm.qhalf, pt, g, t, acc, m0, m1, l0, l1, ps0, ps1);
  } else {
    GlobalRow r;
    r.p = pages + (size_t)indices[lds_s32(prange) + pi] * page_words;
    decode_page<D, PATH, NSUB>(r, gm, count, qsrc, lut, sm.kfac, sm.qmu, sm.hstep,
                                           sm.qhalf, pt, g, t, acc, m0, m1, l0, l1, ps0, ps1);
  }
}

// Page kind of a page header (affine_pages): 0 = partial page; 1 = other full page; 2 = full
// 4/4 page (f44ok: D = 128 or 256 and 4096-byte pages); with fast pages at FD (128 or 256; 0:
// none), 3 = full 3/3 page, 4 = full 2/2 page, 5 = full 8/8 page, 6 = full 16/16 page
// (D = 128: page_f2, page_f8, page_f16; D = 256: page33w, page22w, page88w, page1616w).
template <int FD>
__device__ __forceinline__ int page_kind(int count, const int4& gq, bool f44ok) {
  constexpr bool F2 = FD != 0;
  if (count != gq.z) return 0;
  if (!f44ok || gq.x != gq.y) return 1;
  return gq.x == 4 ? 2 : (F2 && gq.x == 3) ? 3 : (F2 && gq.x == 2) ? 4
       : (F2 && gq.x == 8) ? 5
       : (F2 && gq.x == 16) ? 6 : 1;
}
// The CTA's page range as header_refill reads it: beg() = start of the row's list in
// `indices`, end() = end of the CTA's pages. In the page loop from shared memory (sm.prange: a
// register held across the loop would spill); at kernel entry from registers, as
// no barrier has published sm.prange yet.
struct RangeSmem {
  u32 a;
  __device__ __forceinline__ int beg() const { return lds_s32(a); }
  __device__ __forceinline__ int end() const { return lds_s32(a + 4); }
};
struct RangeRegs {
  int b, e;
  __device__ __forceinline__ int beg() const { return b; }
  __device__ __forceinline__ int end() const { return e; }
};
// A page's packed header entry (header_refill): hp = page id, hc = count | tier << 16 |
// kind << 28 (gq: the tier's geometry row).
template <int FD>
__device__ __forceinline__ void header_pack(int page, int tier, int count, int4 gq, bool f44ok,
                                            u32& hp, u32& hc) {
  hp = static_cast<u32>(page);
  hc = static_cast<u32>(count) | (static_cast<u32>(tier) << 16) |
       (static_cast<u32>(page_kind<FD>(count, gq, f44ok)) << 28);
}
// Loads the header block of the warp's pages first, first + stride, ..., first + 31 stride
// (lane l: page first + l stride; stride 4, or 4 S on interleaved splits) into the warp's
// 512-byte P' tile (unused on the affine path) at shared address hsh: lane l's entry
// {page id, count | tier << 16 | kind << 28} at 8 l. Kept in shared memory, a
// page's header costs one 8-byte load and no registers across the page loop (in shuffle
// registers ptxas spilled at 128 registers). Warp-uniform; the previous block was read before
// the __syncwarp at the end of the last step.
// PRE (the first block at kernel entry): the geometry rows come from gpre, row
// l in lane l (the launcher pads the table to SKV_GEOM_PRE_ROWS rows), by shuffles: one
// dependent global load fewer in the chain before the first page copy.
template <int FD, class RG, bool PRE = false>
__device__ __forceinline__ void header_refill(u32 hsh, int first, int lane, const RG& range,
                                              const int* __restrict__ indices,
                                              const int* __restrict__ page_tier,
                                              const int* __restrict__ page_count,
                                              const int* __restrict__ geom, bool f44ok,
                                              int stride = DEC_WARPS, int4 gpre = {}) {
  const int idx = first + stride * lane;
  u32 hp = 0, hc = 0;
  if constexpr (PRE) {
    const bool ok = idx < range.end();
    int page = 0, tier = 0, count = 0;
    if (ok) {
      page = indices[range.beg() + idx];
      tier = page_tier[page];
      count = page_count[page];
    }
    const int src = tier & (SKV_GEOM_PRE_ROWS - 1);
    int4 gq = make_int4(__shfl_sync(0xffffffffu, gpre.x, src), __shfl_sync(0xffffffffu, gpre.y, src),
                        __shfl_sync(0xffffffffu, gpre.z, src), 0);
    if (tier >= SKV_GEOM_PRE_ROWS)   // a ladder of more tiers than lanes hold: from the table
      gq = __ldg(reinterpret_cast<const int4*>(geom + tier * SKV_GEOM_STRIDE));
    if (ok) header_pack<FD>(page, tier, count, gq, f44ok, hp, hc);
  } else if (idx < range.end()) {
    const int page = indices[range.beg() + idx];
    const int tier = page_tier[page], count = page_count[page];
    const int4 gq = __ldg(reinterpret_cast<const int4*>(geom + tier * SKV_GEOM_STRIDE));
    header_pack<FD>(page, tier, count, gq, f44ok, hp, hc);
  }
  asm volatile("st.shared.v2.u32 [%0], {%1, %2};" :: "r"(hsh + 8u * lane), "r"(hp), "r"(hc));
  __syncwarp();
}
// Starts the copy of a full page into the staging buffer at shared address dst, laid out as
// its kind's decoder reads it (partial pages are not staged). At FD = 256 the 4/4 page has the
// D = 128 8/8 layout and the 2/2 page the D = 128 4/4 one.
template <int FD>
__device__ __forceinline__ void stage_page(const u32* src, u32 c, u32 dst, int page_words, int lane) {
  constexpr bool F2 = FD != 0;
  const u32 kind = c >> 28;
  if (kind == 2) {
    if (FD == 256) f8_stage(dst, src, lane); else f44_stage(dst, src, lane);
  } else if (F2 && kind == 4) {
    if (FD == 256) f44_stage(dst, src, lane);
    else fp_stage<F2Geo<2>::SW, 16>(dst, src, lane);   // rows 30, 31 (scales) in place
  } else if (F2 && kind == 5) {
    if (FD == 256) f88_stage(dst, src, lane); else f8_stage(dst, src, lane);
  } else if (FD == 256 && kind == 6) {
    f1616_stage(dst, src, lane);
  } else if (FD == 128 && kind == 6) {
    f16_stage(dst, src, lane);
  } else if (kind == 1 || kind == 3) {
    for (int i = lane; i < page_words / 4; i += 32)
      cp_async16_sh(dst + 16u * i, reinterpret_cast<const char*>(src) + 16 * i);
  }
}

// Starts the copy of the jb-th page of the warp's header block (at shared address hsh) into the
// staging buffer at dst; returns the page's packed header (count | tier << 16 | kind << 28).
template <int FD>
__device__ __forceinline__ u32 stage_from_block(const u32* __restrict__ pages, int page_words,
                                                u32 hsh, int jb, u32 dst, int lane) {
  const uint2 v = lds64(hsh + 8u * jb);
  stage_page<FD>(pages + (size_t)v.x * page_words, v.y, dst, page_words, lane);
  return v.y;
}
// The start of a warp's affine page stream: the header block of pages pi0, pi0 + stride, ... and
// the copy of the first page into buffer 0 (one cp.async group). decode_cta calls it at kernel
// entry, with the range in registers, so the dependent header loads and the first copy overlap
// the query prologue. cur_c: the packed header of page pi0 (0: none).
template <int FD, class RG, bool PRE = false>
__device__ __forceinline__ void affine_pages_start(const u32* __restrict__ pages, int page_words,
                                             const int* __restrict__ page_tier,
                                             const int* __restrict__ page_count,
                                             const int* __restrict__ indices,
                                             const int* __restrict__ geom, int pi0,
                                             const RG& range, int stride, u32 bufs_sh, u32 hsh,
                                             int lane, bool f44ok, u32& cur_c,
                                             int4 gpre = {}) {
  cur_c = 0;
  if (pi0 < range.end()) {
    header_refill<FD, RG, PRE>(hsh, pi0, lane, range, indices, page_tier, page_count, geom, f44ok,
                               stride, gpre);
    cur_c = stage_from_block<FD>(pages, page_words, hsh, 0, bufs_sh, lane);
  }
  cp_async_commit();
}


// Affine page loop of one warp: pages pi0, pi0 + 4, ... of the CTA's range (end re-read from
// shared memory at `prange` + 4, start of the row's list at `prange`). Page headers
// come in blocks of 32 (header_refill: one dependent chain of global loads per 32 pages instead
// of one per page), a page's header stays packed (count | tier << 16 | kind << 28) across the
// loop and a partial page re-reads its id from `indices`. Each page is one of seven kinds
// (page_kind): 2 = full 4/4 page (F44 only), staged with the 4/4 swizzle and decoded by page44;
// 3 = full 3/3 page (F2 only), staged plainly, page_f2<3>; 4 = full 2/2 page (F2 only), staged
// with the 2/2 swizzle, page_f2<2>; 5 = full 8/8 page (F2 only), staged with its swizzle,
// page_f8; 6 = full 16/16 page (F2 only), staged with its swizzle, page_f16; 1 = other full
// page, staged plainly, decode_page on shared memory; 0 = partial page, read in place
// (decode_page on global memory, no byte past its states). The next page streams into the
// other buffer while this one is decoded. The accumulators stay in one domain (generic: kinds
// 0, 1, 6; F44: 2, 5; F2: 3, 4) while pages of that domain follow each other and change domain
// (32 exact multiplies, domain_move) only between them. At D = 256 (FD = 256) kinds 2..6 go to
// page44w, page33w, page22w, page88w and page1616w, in the same domains, staged as stage_page
// says. ILV: the warp's pages are pi0, pi0 + 4S, ...
// (interleaved splits, decode_cta), else pi0, pi0 + 4, ... affine_pages_start has run at
// kernel entry with the first page: cur_c is its header.
template <int D, int PATH, int NSUB, bool F44, bool F2, bool ILV, class SM, class QF>
__device__ __forceinline__ void affine_pages(
    const u32* __restrict__ pages, int page_words, const int* __restrict__ page_tier,
    const int* __restrict__ page_count, const int* __restrict__ indices,
    const int* __restrict__ geom, int pi0, u32 prange, u32* bufs, SM& sm, const QF& qsrc,
    const Luts& lut, __half* pt, int lane, float (&acc)[D / 16][4], float& m0, float& m1,
    float& l0, float& l1, float& ps0, float& ps1, u32 cur_c) {
  const int g = lane >> 2, t = lane & 3;
  constexpr int FD = F2 ? D : 0;   // the fast pages' head dim (page_kind)
  const bool f44ok = F44 && page_words == F44_WORDS;
  const u32 bufs_sh = static_cast<u32>(__cvta_generic_to_shared(bufs));
  const u32 hsh = static_cast<u32>(__cvta_generic_to_shared(pt));
  // the warp's page stride: 4, or 4 S with interleaved splits (re-read from shared memory: a
  // register held across the page loop would spill at 128 registers)
  auto stride = [&]() { return ILV ? lds_s32(pstride_at(sm)) : DEC_WARPS; };
  auto refill = [&](int first) {
    header_refill<FD>(hsh, first, lane, RangeSmem{prange}, indices, page_tier, page_count, geom,
                      f44ok, stride());
  };
  auto stage = [&](int jb, u32& c, int which) {   // the jb-th page of the block: header, copy
    c = stage_from_block<FD>(pages, page_words, hsh, jb, bufs_sh + 4u * which * page_words, lane);
  };
  constexpr int NST = AFF_STAGES;   // page buffers; pages pi + 4, ..., pi + 4 (NST - 1) in flight
  static_assert(NST == 2, "AFF_STAGES: the page loop keeps one page in flight");
  bool d44 = false, d2 = false;   // domain of the accumulators (domain_move): generic at first
  // cur_c: the header of page pi
  // One page: pi in buffer buf; page pi + stride (NST - 1) is staged now into buffer nbuf, at
  // place jb of its header block.
  auto step = [&](int pi, int jb, int buf, int nbuf) {
    u32 nxt_c = 0;
    const int npi = pi + stride() * (NST - 1);
    if (npi < lds_s32(prange + 4)) {
      if (jb == 0) refill(npi);
      stage(jb, nxt_c, nbuf);
    }
    cp_async_commit();
    cp_async_wait1();   // this lane's copies of
    __syncwarp();       // the current page are done, ... and every other lane's
    const u32 bsh = bufs_sh + 4u * buf * page_words;
    const int cur_kind = static_cast<int>(cur_c >> 28);
    domain_move<D>(acc, d44, d2, F44 && (cur_kind == 2 || cur_kind == 5), F2 && (cur_kind == 3 || cur_kind == 4));
    if (FD == 256 && cur_kind >= 2) {
      if constexpr (FD == 256) {
        const u32 qf2 = static_cast<u32>(__cvta_generic_to_shared(&sm.qfrag2[0][lane]));
        if (cur_kind == 2) {
          page44w(bsh, static_cast<u32>(__cvta_generic_to_shared(&sm.qfrag44[0][lane])),
                  static_cast<u32>(__cvta_generic_to_shared(&sm.k12[2 * t][0])),
                  lds_f32(sm.hstep + level_row(4), true), g, t, acc, m0, m1, l0, l1, ps0, ps1);
        } else if (cur_kind == 3) {
          page33w(bsh, qf2, static_cast<u32>(__cvta_generic_to_shared(&sm.k12b[1][2 * t][0])),
                  lds_f32(sm.hstep + level_row(3), true), g, t, acc, m0, m1, l0, l1, ps0, ps1);
        } else if (cur_kind == 4) {
          page22w(bsh, qf2, static_cast<u32>(__cvta_generic_to_shared(&sm.k12b[0][2 * t][0])),
                  lds_f32(sm.hstep + level_row(2), true), g, t, acc, m0, m1, l0, l1, ps0, ps1);
        } else if (cur_kind == 6) {
          page1616w(bsh, static_cast<u32>(__cvta_generic_to_shared(&sm.qfrag[0][lane])),
                    static_cast<u32>(__cvta_generic_to_shared(&sm.k12c[1][2 * t][0])), g, t, acc,
                    m0, m1, l0, l1, ps0, ps1);
        } else {
          page88w(bsh, static_cast<u32>(__cvta_generic_to_shared(&sm.qfrag8[0][lane])),
                  static_cast<u32>(__cvta_generic_to_shared(&sm.k12c[0][2 * t][0])),
                  lds_f32(sm.hstep + level_row(8), true), g, t, acc, m0, m1, l0, l1, ps0, ps1);
        }
      }
    } else if (F2 && cur_kind >= 5) {
      if constexpr (FD == 128) {
        if (cur_kind == 5) {
          page_f8(bsh, static_cast<u32>(__cvta_generic_to_shared(&sm.qfrag8[0][lane])),
                  static_cast<u32>(__cvta_generic_to_shared(&sm.k12c[0][2 * t][0])),
                  lds_f32(sm.hstep + level_row(8), true), g, t, acc, m0, m1, l0, l1, ps0, ps1);
        } else {
          page_f16(bsh, static_cast<u32>(__cvta_generic_to_shared(&sm.qfrag[0][lane])),
                   static_cast<u32>(__cvta_generic_to_shared(&sm.k12c[1][2 * t][0])), g, t, acc,
                   m0, m1, l0, l1, ps0, ps1);
        }
      }
    } else if (F2 && cur_kind >= 3) {
      if constexpr (FD == 128) {
        const u32 qf2 = static_cast<u32>(__cvta_generic_to_shared(&sm.qfrag2[0][lane]));
        if (cur_kind == 3) {
          page_f2<3>(bsh, qf2, static_cast<u32>(__cvta_generic_to_shared(&sm.k12b[1][2 * t][0])),
                     lds_f32(sm.hstep + level_row(3), true), g, t, acc, m0, m1, l0, l1, ps0, ps1);
        } else {
          page_f2<2>(bsh, qf2, static_cast<u32>(__cvta_generic_to_shared(&sm.k12b[0][2 * t][0])),
                     lds_f32(sm.hstep + level_row(2), true), g, t, acc, m0, m1, l0, l1, ps0, ps1);
        }
      }
    } else if (F44 && cur_kind == 2) {
      if constexpr (FD == 128) {
        page44(bsh, static_cast<u32>(__cvta_generic_to_shared(&sm.qfrag44[0][lane])),
               static_cast<u32>(__cvta_generic_to_shared(&sm.k12[2 * t][0])),
               lds_f32(sm.hstep + level_row(4), true), g, t, acc, m0, m1, l0, l1, ps0, ps1);
      }
    } else {
      decode_generic<D, PATH, NSUB>(pages, page_words, indices, geom, prange, pi, cur_c, bsh, sm,
                                    qsrc, lut, pt, g, t, acc, m0, m1, l0, l1, ps0, ps1);
    }
    __syncwarp();   // every lane is done with this buffer before it is refilled
    cur_c = nxt_c;
  };
  // k: the warp's pages so far. Page pi = pi0 + k stride sits in buffer k % NST, page
  // pi + stride (NST - 1) goes to place (k + NST - 1) & 31 of its header block. One counter
  // instead of a page index, a buffer and a block place (ILV: pi0 = 4 s + w re-read from the
  // special registers): with the early prologue's values those spill at 128 registers.
  for (int k = 0;; ++k) {
    const int pi = (ILV ? DEC_WARPS * ctaid_x() + (tid_x() >> 5) : pi0) + k * stride();
    if (pi >= lds_s32(prange + 4)) break;
    step(pi, (k + NST - 1) & 31, k % NST, (k + NST - 1) % NST);
  }
  cp_async_wait0();
  domain_move<D>(acc, d44, d2, false, false);
}


#define SKV_DECODE_PARAMS                                                                   \
  const float* __restrict__ q, long long q_sb, long long q_sh, const u32* __restrict__ pages,     \
      int page_words, const int* __restrict__ page_tier, const int* __restrict__ page_count,    \
      const int* __restrict__ indptr, const int* __restrict__ indices,                          \
      const int* __restrict__ geom, const float* __restrict__ levels,                           \
      const float* __restrict__ sigma_k, const float* __restrict__ sigma_v,                     \
      const float* __restrict__ mean_k, const float* __restrict__ mean_v, int num_kv_heads,     \
      int G, float scale_log2, int num_splits, float* __restrict__ out,                         \
      float* __restrict__ part_o, float* __restrict__ part_lse
#define SKV_DECODE_ARGS                                                                      \
  q, q_sb, q_sh, pages, page_words, page_tier, page_count, indptr, indices, geom, levels,       \
      sigma_k, sigma_v, mean_k, mean_v, num_kv_heads, G, scale_log2, num_splits, out, part_o,   \
      part_lse

// Which of the row's pages the CTA takes: the row's list starts at indices[rbeg]; the table
// path and the affine path at D = 64: a contiguous range [pbeg, pend) of ceil(n / S) pages, warp w its pages
// pbeg + w, + 4, ... ILV (affine path at D = 128): interleaved, warp w of split s takes pages
// 4 s + w + 4 S k, so every split holds about 1/S of each tier's pages (a row's pages come
// ordered by tier, and a contiguous range would give the slow tiers to a few splits, which
// then set the kernel's time).
struct CtaPages { int rbeg, pbeg, pend; };
template <bool ILV>
__device__ __forceinline__ CtaPages cta_pages(const int* __restrict__ indptr, int row, int split,
                                              int num_splits) {
  const int rbeg = indptr[row], n = indptr[row + 1] - rbeg;
  const int per = (n + num_splits - 1) / num_splits;
  const int pbeg = ILV ? split * DEC_WARPS : split * per, pend = ILV ? n : min(n, pbeg + per);
  return {rbeg, pbeg, pend};
}

// Where the prologue keeps coordinate j of head h of the rotated query (float index into qs).
// PAD (the affine path): rows of D + D/32 floats, one float of padding after
// every 32 coordinates, so that the fragment builders' loads (lane (g, t): head g, coordinates
// 32 t + c) fall on 32 distinct banks (4 g + t + c mod 32) instead of one (32-way conflicts,
// with 12 such warps per SM at once: ~3 us of the prologue); the rotation's stores stay
// conflict-free. Else rows of D floats, as block_fwht needs them.
// Coordinate 32 blk + off (off < 32) of head h.
template <int D, bool PAD>
__device__ __forceinline__ int qs_at(int h, int blk, int off) {
  return PAD ? h * (D + D / 32) + 33 * blk + off : h * D + 32 * blk + off;
}
// ... of coordinate (D / 4) t + off of head h (a fast page's query fragment: lane t's quarter of
// the coordinates; off is a compile-time constant, and the elements read with it stay in its
// 32-coordinate block).
template <int D, bool PAD>
__device__ __forceinline__ int qs_lane(int h, int t, int off) {
  return D == 128 ? qs_at<D, PAD>(h, t, off) : qs_at<D, PAD>(h, (D / 128) * t + (off >> 5), off & 31);
}

// Rotated query of the warp's heads warp, warp + 4 (the affine path's early prologue): q' = H(sigma_K * q), lane l
// holding coordinates V l, ..., V l + V - 1 (V = D / 32) of head warp + 4 k in y[k] (loaded by
// warp_query_load before the page stream starts, so both chains of global loads are in flight
// at once), the butterflies below V in registers and the rest through shuffles. Every sum and
// difference is the one block_fwht forms (the lower coordinate's value first), so q' is
// bit-identical to it, without its 2 log2 D barriers. Writes q' to qs[head][D] and
// max|q'| / D (qfac, kfac) as decode_cta's prologue.
constexpr int DEC_WHEADS = DEC_HEADS / DEC_WARPS;   // heads per warp
static_assert(DEC_HEADS % DEC_WARPS == 0, "warp_query_load: whole heads per warp");
template <int D>
__device__ __forceinline__ void warp_query_load(float (&y)[DEC_WHEADS][D / 32], const float* qrow,
                                                long long q_sh, const float* sk, int G, int warp,
                                                int lane) {
  constexpr int V = D / 32;
#pragma unroll
  for (int k = 0; k < DEC_WHEADS; ++k) {
    const int gg = warp + DEC_WARPS * k;
#pragma unroll
    for (int v = 0; v < V; ++v)
      y[k][v] = gg < G ? qrow[gg * q_sh + V * lane + v] * sk[V * lane + v] : 0.0f;
  }
}
template <int D, bool PAD>
__device__ __forceinline__ void warp_query_rotate(float (&yq)[DEC_WHEADS][D / 32], float* qs,
                                                  int warp, int lane, float scale_log2,
                                                  float* qfac, float* kfac) {
  constexpr int V = D / 32;
#pragma unroll
  for (int k = 0; k < DEC_WHEADS; ++k) {
    const int gg = warp + DEC_WARPS * k;
    float (&y)[V] = yq[k];
#pragma unroll
    for (int h = 1; h < V; h <<= 1) {
#pragma unroll
      for (int v = 0; v < V; ++v) {
        if (v & h) continue;
        const float a = y[v], b = y[v + h];
        y[v] = a + b;
        y[v + h] = a - b;
      }
    }
#pragma unroll
    for (int h = 1; h < 32; h <<= 1) {   // coordinate bit V h = lane bit h
      const bool upper = lane & h;
#pragma unroll
      for (int v = 0; v < V; ++v) {
        const float o = __shfl_xor_sync(0xffffffffu, y[v], h);
        y[v] = upper ? o - y[v] : y[v] + o;
      }
    }
    float mx = 0.0f;
#pragma unroll
    for (int v = 0; v < V; ++v) {
      mx = fmaxf(mx, fabsf(y[v]));
      qs[qs_at<D, PAD>(gg, (V * lane) >> 5, (V * lane + v) & 31)] = y[v];
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, m));
    if (lane == 0) { qfac[gg] = mx / (float)D; kfac[gg] = mx / (float)D * scale_log2; }
  }
}

// The body of the decode kernels. PATH_TABLE: any codebook (`levels` is the (5, 256) float32
// level table). PATH_AFFINE: uniform codebook (`levels` holds the 5 half steps hs_b of
// b = 1, 2, 3, 4, 8 bits; no tables in shared memory). NSUB: 16-state sub-tiles per softmax
// step (table path 1, affine path AFF_SUB = 2); the affine path's differences: see decode_page;
// at D = 128 its full 4/4, 3/3, 2/2, 8/8 and 16/16 pages take their fast paths, the rest
// decode_page with the affine value map (affine_pages). Every affine CTA lets the merge kernel launch (programmatic dependent launch: when
// the launcher starts the merge with that attribute, its CTAs are scheduled once every decode
// CTA has allowed it, on the SMs the decode's early CTAs leave, and wait in griddepcontrol.wait
// for the whole decode grid; launched plainly, the instruction does nothing): 1 at the CTA's
// ... after its pages (before the cross-warp merge).
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// Blocks until every grid this one depends on programmatically has completed and its writes
// are visible (returns at once after a plain launch).
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

template <int D, int PATH>
__device__ __forceinline__ void decode_cta(SKV_DECODE_PARAMS) {
  constexpr bool AFFINE = PATH == PATH_AFFINE;
  constexpr int NSUB = AFFINE ? AFF_SUB : 1;   // 16-state sub-tiles per softmax step
  // the fast pages exist for D = 128 and (WIDE_FAST_PAGES) 256
  constexpr bool F44 = AFFINE && (D == 128 || (D == 256 && WIDE_FAST_PAGES));
  constexpr bool F2 = F44;   // ... the 4/4 one and the 3/3, 2/2, 8/8, 16/16 ones
  constexpr bool ILV = F2 && D == 128;       // interleaved splits (cta_pages)
  // EARLY (affine): the page stream starts at kernel entry, the query is staged past the page buffers
  constexpr bool EARLY = AFFINE;
  constexpr bool QPAD = EARLY;               // the rotated query's layout (qs_at)
  __shared__ typename SmemOf<D, AFFINE>::type sm;
  extern __shared__ __align__(16) unsigned char dyn[];
  float* region = reinterpret_cast<float*>(dyn + (AFFINE ? 0 : LUT_BYTES));   // queries, pages, merge
  const int split = blockIdx.x, row = blockIdx.y;
  const int b = row / num_kv_heads, kvh = row % num_kv_heads;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  __half* pt = &sm.ptile[warp][0][0];
  u32* bufs = reinterpret_cast<u32*>(region) +
              (size_t)warp * (AFFINE ? AFF_STAGES : 2) * page_words;
  const float* qrow = q + (long long)b * q_sb + (long long)(kvh * G) * q_sh;
  const float* sk = sigma_k + (size_t)kvh * D;
  u32 cur_c = 0;   // EARLY: the header of the warp's first page (affine_pages_start)
  float qv[DEC_WHEADS][D / 32];   // EARLY: sigma_K * q of the warp's heads (warp_query_load)
  if constexpr (EARLY) {
    warp_query_load<D>(qv, qrow, q_sh, sk, G, warp, lane);
    // nothing in shared memory is needed before the first barrier: the range in registers,
    // the header block in the warp's own P' tile, the copies into its own buffers
    // lane l holds geometry row l (kbits, vbits, P), loaded with indptr
    const int4 gpre = (lane < SKV_GEOM_PRE_ROWS)
                          ? __ldg(reinterpret_cast<const int4*>(geom + lane * SKV_GEOM_STRIDE))
                          : make_int4(0, 0, 0, 0);
    const CtaPages cp = cta_pages<ILV>(indptr, row, split, num_splits);
    affine_pages_start<F2 ? D : 0, RangeRegs, true>(pages, page_words, page_tier, page_count,
                     indices, geom, cp.pbeg + warp,
                     RangeRegs{cp.rbeg, cp.pend}, ILV ? DEC_WARPS * num_splits : DEC_WARPS,
                     static_cast<u32>(__cvta_generic_to_shared(bufs)),
                     static_cast<u32>(__cvta_generic_to_shared(pt)), lane,
                     F44 && page_words == F44_WORDS, cur_c, gpre);
  }

  Luts lut = {};
  if constexpr (AFFINE) {
    // the affine path feeds u = c - 2^(B-1) = (2c - (2^B - 1) - 1) / 2: twice the half step per unit
    if (threadIdx.x < 5) sm.hstep[threadIdx.x] = levels[threadIdx.x] * (PATH == PATH_AFFINE ? 2.0f : 1.0f);
  } else {
    lut = build_luts(dyn, levels, threadIdx.x, blockDim.x);
  }

  // ---- rotated query, once per head: q' = H(sigma_K * q) / D, kept as q'/max|q'| in fp16
  // (EARLY: staged past the page buffers, which are filling already; the launcher's
  // decode_smem_bytes adds the room)
  float* qs = EARLY ? region + DEC_WARPS * AFF_STAGES * page_words : region;
  if constexpr (EARLY) {
    warp_query_rotate<D, QPAD>(qv, qs, warp, lane, scale_log2, sm.qfac, sm.kfac);
  } else {
  for (int idx = threadIdx.x; idx < DEC_HEADS * D; idx += blockDim.x) {
    int gg = idx / D, j = idx % D;
    qs[idx] = gg < G ? qrow[gg * q_sh + j] * sk[j] : 0.0f;
  }
  if (!AFFINE && threadIdx.x < DEC_HEADS) {   // the affine path leaves q . mu_K out (decode_page)
    float mu = 0.0f;
    if (mean_k && threadIdx.x < G) {
      const float* mk = mean_k + (size_t)row * D;
      for (int j = 0; j < D; ++j) mu += qrow[threadIdx.x * q_sh + j] * mk[j];
    }
    sm.qmu[threadIdx.x] = mu * scale_log2;
  }
  block_fwht<D>(qs, DEC_HEADS);
  if (warp == 0) {
    for (int gg = 0; gg < DEC_HEADS; ++gg) {
      float mx = 0.0f;
      for (int j = lane; j < D; j += 32) mx = fmaxf(mx, fabsf(qs[gg * D + j]));
#pragma unroll
      for (int m = 16; m >= 1; m >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, m));
      if (lane == 0) { sm.qfac[gg] = mx / (float)D; sm.kfac[gg] = mx / (float)D * scale_log2; }
    }
  }
  }
  __syncthreads();
  // Q fragment: lane (g, t) holds head g of group 8*(t+4i); k16 chunk (i, h) takes the
  // group's pairs 2h and 2h+1, i.e. coordinates 4h + (0, 1 | 2, 3) on the table path and
  // 2h + (0, 4 | 1, 5) on the affine path (AffineFields pairs coordinates p and p + 4). The affine path keeps
  // it in shared memory (qfrag), built by one warp: warp 0, or (EARLY) warp 3, which builds
  // none of the fast pages' fragments below.
  constexpr int QW = EARLY ? DEC_WARPS - 1 : 0;
  QRegs<D> qr;
  u32 (&qf)[D / 16][2] = qr.v;
  if (!EARLY || warp == QW) {
  {
    float inv = sm.qfac[g] > 0.0f ? 1.0f / (sm.qfac[g] * (float)D) : 0.0f;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float* src = qs + qs_at<D, QPAD>(g, i, 8 * t);
        if constexpr (AFFINE) {
          src += 2 * h;
          qf[2 * i + h][0] = h2_as_u32(__floats2half2_rn(src[0] * inv, src[4] * inv));
          qf[2 * i + h][1] = h2_as_u32(__floats2half2_rn(src[1] * inv, src[5] * inv));
        } else {
          src += 4 * h;
          qf[2 * i + h][0] = h2_as_u32(__floats2half2_rn(src[0] * inv, src[1] * inv));
          qf[2 * i + h][1] = h2_as_u32(__floats2half2_rn(src[2] * inv, src[3] * inv));
        }
      }
    }
  }
  if constexpr (PATH == PATH_AFFINE) {
    // sum of the fp16 q' of head g exactly as the mma sees them, halved (the "+1/2" of u)
    float qsum = 0.0f;
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      const float2 a = __half22float2(u32_as_h2(qf[i][0])), b2 = __half22float2(u32_as_h2(qf[i][1]));
      qsum += (a.x + a.y) + (b2.x + b2.y);
    }
    qsum += __shfl_xor_sync(0xffffffffu, qsum, 1);
    qsum += __shfl_xor_sync(0xffffffffu, qsum, 2);
    if (warp == QW && t == 0) sm.qhalf[g] = 0.5f * qsum;
  }
  if (AFFINE && warp == QW) {
#pragma unroll
    for (int i = 0; i < D / 16; ++i) sm.qfrag[i][lane] = make_uint2(qf[i][0], qf[i][1]);
  }
  }
  if constexpr (F44) {
    // 4/4 fast path: chunk c = 2i + h of lane (g, t) holds head g's coordinates 8w + 2h, + 4
    // (b0) and 8w + 2h + 1, + 5 (b1) of word w = (D / 32) t + i, the latter (fields at bit 4) scaled
    // by 2^-4 (exact: a power of two; below 2^-10 the fp16 subnormal rounds
    // by at most 2^-25 absolute). K1/K2 fold the scales and the code offset (page44).
    if (warp == 0) {
      const float inv = sm.qfac[g] > 0.0f ? 1.0f / (sm.qfac[g] * (float)D) : 0.0f;
      constexpr float s4 = 0.0625f;
      float asum = 0.0f;   // sum of head g's q' as the mma sees them (times 2^POS)
#pragma unroll
      for (int c = 0; c < D / 16; ++c) {
        const float* src = qs + qs_lane<D, QPAD>(g, t, 8 * (c >> 1) + 2 * (c & 1));
        const __half2 b0 = __floats2half2_rn(src[0] * inv, src[4] * inv);
        const __half2 a1 = __floats2half2_rn(src[1] * inv, src[5] * inv);
        const float2 f1 = __half22float2(a1);
        const __half2 b1 = __floats2half2_rn(f1.x * s4, f1.y * s4);
        const float2 f0 = __half22float2(b0), g1 = __half22float2(b1);
        asum += (f0.x + f0.y) + (g1.x + g1.y) * (1.0f / s4);
        sm.qfrag44[c][lane] = make_uint2(h2_as_u32(b0), h2_as_u32(b1));
      }
      asum += __shfl_xor_sync(0xffffffffu, asum, 1);
      asum += __shfl_xor_sync(0xffffffffu, asum, 2);
      if (t == 0) {
        const float kf = sm.kfac[g] * sm.hstep[level_row(4)];   // 2 hs_4 on PATH_AFFINE
        sm.k12[g][0] = kf * 0x1p24f;
        sm.k12[g][1] = kf * -7.5f * asum;
      }
    }
  }
  if constexpr (F2) {
    // 3/3 and 2/2 fast pages (page_f2, page33w, page22w): chunk c = 2k + h of lane (g, t) holds
    // head g's coordinates m = (D / 4) t + 16(k >> 1) + 4(k & 1) + f and m + 8 for field f = 2h (b0) and
    // 2h + 1 (b1), scaled by 2^-2f (the field's POS; exact unless the fp16 is subnormal).
    if (warp == 1) {
      const float inv = sm.qfac[g] > 0.0f ? 1.0f / (sm.qfac[g] * (float)D) : 0.0f;
      float asum = 0.0f;   // sum of head g's q' as the mma sees them (times 2^POS)
#pragma unroll
      for (int c = 0; c < D / 16; ++c) {
        const int k = c >> 1;
        const float* src = qs + qs_lane<D, QPAD>(g, t, 16 * (k >> 1) + 4 * (k & 1) + 2 * (c & 1));
        u32 b[2];
#pragma unroll
        for (int f = 0; f < 2; ++f) {
          const float sc = (c & 1) ? (f ? 0x1p-6f : 0x1p-4f) : (f ? 0x1p-2f : 1.0f);
          const float2 q = __half22float2(__floats2half2_rn(src[f] * inv, src[f + 8] * inv));
          const __half2 h = __floats2half2_rn(q.x * sc, q.y * sc);
          const float2 hf = __half22float2(h);
          asum += (hf.x + hf.y) * (1.0f / sc);
          b[f] = h2_as_u32(h);
        }
        sm.qfrag2[c][lane] = make_uint2(b[0], b[1]);
      }
      asum += __shfl_xor_sync(0xffffffffu, asum, 1);
      asum += __shfl_xor_sync(0xffffffffu, asum, 2);
      if (t == 0) {
#pragma unroll
        for (int b2 = 0; b2 < 2; ++b2) {   // the 2/2 and 3/3 tiers: u = c - 1.5, c - 3.5
          const float kf = sm.kfac[g] * sm.hstep[level_row(2 + b2)];
          sm.k12b[b2][g][0] = kf * 0x1p24f;
          sm.k12b[b2][g][1] = kf * (b2 ? -3.5f : -1.5f) * asum;
        }
      }
    }
    // 8/8 pages (page_f8): chunk c of lane (g, t) holds head g's q~ of coordinates 32t + 4c
    // + (0, 2) (b0) and + (1, 3) (b1), the bytes one lop3 or prmt pairs (no scaling: the
    // codes sit at bit 0); at D = 256 (page88w) of 16t + 64(c >> 2) + 4(c & 3) + (0, 2), (1, 3).
    // 16/16 pages (page_f16) use qfrag and K1 = kfac, K2 = 0.
    if (warp == 2) {
      const float inv = sm.qfac[g] > 0.0f ? 1.0f / (sm.qfac[g] * (float)D) : 0.0f;
      float asum = 0.0f;   // sum of head g's q~ as the mma sees them
#pragma unroll
      for (int c = 0; c < D / 16; ++c) {
        const float* src = qs + (D == 256 ? qs_at<D, QPAD>(g, 2 * (c >> 2) + (t >> 1), 16 * (t & 1) + 4 * (c & 3))
                                         : qs_lane<D, QPAD>(g, t, 4 * c));
        const __half2 b0 = __floats2half2_rn(src[0] * inv, src[2] * inv);
        const __half2 b1 = __floats2half2_rn(src[1] * inv, src[3] * inv);
        const float2 f0 = __half22float2(b0), f1 = __half22float2(b1);
        asum += (f0.x + f0.y) + (f1.x + f1.y);
        sm.qfrag8[c][lane] = make_uint2(h2_as_u32(b0), h2_as_u32(b1));
      }
      asum += __shfl_xor_sync(0xffffffffu, asum, 1);
      asum += __shfl_xor_sync(0xffffffffu, asum, 2);
      if (t == 0) {   // u = c - 127.5
        const float kf = sm.kfac[g] * sm.hstep[level_row(8)];
        sm.k12c[0][g][0] = kf * 0x1p24f;
        sm.k12c[0][g][1] = kf * -127.5f * asum;
        sm.k12c[1][g][0] = sm.kfac[g];
        sm.k12c[1][g][1] = 0.0f;
      }
    }
  }
  QShared qsh;
  qsh.a = static_cast<u32>(__cvta_generic_to_shared(&sm.qfrag[0][lane]));
  const auto& qsrc = QSource<AFFINE>::of(qsh, qr);
  const int h0 = 2 * t, h1 = 2 * t + 1;
  const CtaPages cp = cta_pages<ILV>(indptr, row, split, num_splits);
  const int rbeg = cp.rbeg, pbeg = cp.pbeg, pend = cp.pend;
  // The affine path re-reads the CTA's page range from shared memory at each page: held in registers
  // across the page loop, ptxas spills it to local memory at the 128-register cap.
  if (AFFINE && threadIdx.x == 0) { sm.prange[0] = rbeg; sm.prange[1] = pend; }
  if constexpr (ILV) {
    if (threadIdx.x == 0) sm.pstride = DEC_WARPS * num_splits;
  }
  const u32 prange = static_cast<u32>(__cvta_generic_to_shared(&sm.prange[0]));
  // the query fragments and the page range are written (and, without EARLY, the query staging
  // area becomes page buffers)
  __syncthreads();

  float acc[D / 16][4];
#pragma unroll
  for (int i = 0; i < D / 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  float m0 = -SKV_INF, m1 = -SKV_INF, l0 = 0.0f, l1 = 0.0f, ps0 = 0.0f, ps1 = 0.0f;

  if constexpr (AFFINE) {
    affine_pages<D, PATH, NSUB, F44, F2, ILV>(pages, page_words, page_tier, page_count,
                                      indices, geom, pbeg + warp, prange, bufs, sm, qsrc, lut, pt,
                                      lane, acc, m0, m1, l0, l1, ps0, ps1, cur_c);
  } else {
  // Page header of the warp's first page; a full page starts streaming at once.
  int pi = pbeg + warp;
  int cur_page = 0, cur_tier = 0, cur_count = 0;
  bool cur_full = false;
  if (pi < pend) {
    cur_page = indices[rbeg + pi];
    cur_tier = page_tier[cur_page];
    cur_count = page_count[cur_page];
    cur_full = cur_count == __ldg(geom + cur_tier * SKV_GEOM_STRIDE + G_P);
    if (cur_full) {
      const char* src = reinterpret_cast<const char*>(pages + (size_t)cur_page * page_words);
      char* dst = reinterpret_cast<char*>(bufs);
      for (int c = lane; c < page_words / 4; c += 32) cp_async16(dst + 16 * c, src + 16 * c);
    }
  }
  cp_async_commit();
  int buf = 0;
  for (; pi < pend; pi += DEC_WARPS) {
    // header of the next page, and its copy into the other buffer
    const int ni = pi + DEC_WARPS;
    int nxt_page = 0, nxt_tier = 0, nxt_count = 0;
    bool nxt_full = false;
    if (ni < pend) {
      nxt_page = indices[rbeg + ni];
      nxt_tier = page_tier[nxt_page];
      nxt_count = page_count[nxt_page];
      nxt_full = nxt_count == __ldg(geom + nxt_tier * SKV_GEOM_STRIDE + G_P);
      if (nxt_full) {
        const char* src = reinterpret_cast<const char*>(pages + (size_t)nxt_page * page_words);
        char* dst = reinterpret_cast<char*>(bufs + (buf ^ 1) * page_words);
        for (int c = lane; c < page_words / 4; c += 32) cp_async16(dst + 16 * c, src + 16 * c);
      }
    }
    cp_async_commit();
    cp_async_wait1();   // this lane's copies of the current page are done
    __syncwarp();       // ... and every other lane's

    if (cur_full) {
      SharedRow r;
      r.a = static_cast<u32>(__cvta_generic_to_shared(bufs + buf * page_words));
      decode_page<D, PATH, NSUB>(r, geom + cur_tier * SKV_GEOM_STRIDE, cur_count, qsrc, lut,
                                     sm.kfac, sm.qmu, sm.hstep, sm.qhalf, pt, g, t, acc, m0, m1,
                                     l0, l1, ps0, ps1);
    } else {
      GlobalRow r;
      r.p = pages + (size_t)cur_page * page_words;
      decode_page<D, PATH, NSUB>(r, geom + cur_tier * SKV_GEOM_STRIDE, cur_count, qsrc, lut,
                                     sm.kfac, sm.qmu, sm.hstep, sm.qhalf, pt, g, t, acc, m0, m1,
                                     l0, l1, ps0, ps1);
    }
    __syncwarp();   // every lane is done with this buffer before it is refilled
    buf ^= 1;
    cur_page = nxt_page; cur_tier = nxt_tier; cur_count = nxt_count; cur_full = nxt_full;
  }
  cp_async_wait0();
  }

  // ---- merge the warps: l over the 8 lanes sharing t; then (m, l, O) through shared memory
#pragma unroll
  for (int m = 4; m <= 16; m <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, m);
    l1 += __shfl_xor_sync(0xffffffffu, l1, m);
    if (PATH == PATH_AFFINE) {
      ps0 += __shfl_xor_sync(0xffffffffu, ps0, m);
      ps1 += __shfl_xor_sync(0xffffffffu, ps1, m);
    }
  }
  if constexpr (PATH == PATH_AFFINE) {   // the "+1/2" of every affine state's u, once
#pragma unroll
    for (int i = 0; i < D / 16; ++i) {
      acc[i][0] += 0.5f * ps0; acc[i][1] += 0.5f * ps1;
      acc[i][2] += 0.5f * ps0; acc[i][3] += 0.5f * ps1;
    }
  }
  __syncthreads();   // all warps are done with their page buffers (the merge reuses them)
  if (AFFINE) pdl_launch_dependents();   // the merge may start (ada_merge_per_head_kernel)
  float* obuf = region;   // [DEC_WARPS][DEC_HEADS][D]
  if (g == 0) {
    sm.m[warp][h0] = m0; sm.m[warp][h1] = m1;
    sm.l[warp][h0] = l0; sm.l[warp][h1] = l1;
  }
  // acc[4j+p] = rows (coordinate c, c2) x heads (h0, h1): c = 8(g+8j)+2p, c2 = c+1 on the
  // table path; c = 8(g+8j)+p, c2 = c+4 on the affine path (pairs p, p+4)
#pragma unroll
  for (int j = 0; j < D / 64; ++j) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int c = 8 * vgroup<AFFINE ? 1 : 0, D>(g, j) + (AFFINE ? p : 2 * p), c2 = c + (AFFINE ? 4 : 1);
      float* o = obuf + (size_t)warp * DEC_HEADS * D;
      o[h0 * D + c] = acc[4 * j + p][0];
      o[h1 * D + c] = acc[4 * j + p][1];
      o[h0 * D + c2] = acc[4 * j + p][2];
      o[h1 * D + c2] = acc[4 * j + p][3];
    }
  }
  __syncthreads();
  // Combined result (normalised) into obuf[0][gg][:], lse into sm.lse[gg]. Each thread keeps
  // its values in registers until every warp's partial O has been read.
  constexpr int PER = DEC_HEADS * D / (DEC_WARPS * 32);
  float val[PER];
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int idx = threadIdx.x + k * DEC_WARPS * 32;
    const int gg = idx / D, j = idx % D;
    val[k] = 0.0f;
    if (gg < G) {
      float M = -SKV_INF;
#pragma unroll
      for (int w = 0; w < DEC_WARPS; ++w) M = fmaxf(M, sm.m[w][gg]);
      float L = 0.0f, O = 0.0f;
      if (M != -SKV_INF) {
#pragma unroll
        for (int w = 0; w < DEC_WARPS; ++w) {
          const float wt = exp2f(sm.m[w][gg] - M);
          L += sm.l[w][gg] * wt;
          O += obuf[((size_t)w * DEC_HEADS + gg) * D + j] * wt;
        }
      }
      val[k] = L > 0.0f ? O / L : 0.0f;
      if (j == 0) sm.lse[gg] = L > 0.0f ? M + log2f(L) : -SKV_INF;
    }
  }
  if (EARLY && num_splits > 1) {
    // the partials straight from registers: no round trip through obuf, two barriers fewer
    // (the same values and layout as below; split and row re-read, as tid below)
    const size_t base = ((size_t)ctaid_x() * gridDim.y + ctaid_y()) * G;
#pragma unroll
    for (int k = 0; k < PER; ++k) {
      const int idx = tid_x() + k * DEC_WARPS * 32;
      if (idx < G * D) part_o[base * D + idx] = val[k];
      if (idx < G * D && idx % D == 0) part_lse[base + idx / D] = sm.lse[idx / D];
    }
    return;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < PER; ++k) obuf[threadIdx.x + k * DEC_WARPS * 32] = val[k];
  __syncthreads();
  if (num_splits == 1) {
    // affine path: the kv-head re-derived from the block index (held across the page loop, ptxas
    // keeps it in local memory at 128 registers)
    const int kvh_o = AFFINE ? ctaid_y() % num_kv_heads : kvh;
    finish_heads<D>(obuf, G, sigma_v + (size_t)kvh_o * D, mean_v ? mean_v + (size_t)row * D : nullptr,
                    out + (long long)row * G * D, D);
  } else {
    const size_t base = ((size_t)split * gridDim.y + row) * G;
    for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) part_o[base * D + idx] = obuf[idx];
    const int tid = tid_x();   // re-read: held across the page loop it would cost a register
    if (tid < G) part_lse[base + tid] = sm.lse[tid];
  }
}

// Table path (Lloyd–Max or any codebook): 37 KiB of replicated look-up tables in shared
// memory, 16-state softmax steps, the query fragment in registers; TABLE_CTAS per SM.
template <int D>
__global__ void __launch_bounds__(DEC_WARPS * 32, D >= WIDE_DIM ? TABLE_CTAS_WIDE : TABLE_CTAS)
    ada_decode_table_kernel(SKV_DECODE_PARAMS) {
  decode_cta<D, PATH_TABLE>(SKV_DECODE_ARGS);
}

// Affine path (uniform codebook): no tables; at D = 128 full pages of the 4/4, 3/3, 2/2, 8/8
// and 16/16 tiers on their fast paths (page44, page_f2, page_f8, page_f16), every other page
// on decode_page; splits take a row's pages interleaved; AFF_CTAS per SM (<= 128 registers).
template <int D>
__global__ void __launch_bounds__(DEC_WARPS * 32, D >= WIDE_DIM ? AFF_CTAS_WIDE : AFF_CTAS)
    ada_decode_affine_kernel(SKV_DECODE_PARAMS) {
  decode_cta<D, PATH_AFFINE>(SKV_DECODE_ARGS);
}

// The merged log-sum-exp of one (row, head), natural log, for callers that merge this
// attention with another (lse_out, optional): the splits' base-2 lse (M + log2 W, in the
// kernel's units: scaled logits times log2 e) plus scale * q . mu_K, the shift every logit of
// the row shares, which the affine path leaves out (the launcher passes mean_k only then).
// One thread, once per (row, head); -inf for a row without states.
template <int D>
__device__ __forceinline__ void merged_lse(float M, float W, const float* __restrict__ q,
                                           long long q_sb, long long q_sh,
                                           const float* __restrict__ mean_k, float scale, int row,
                                           int num_kv_heads, int G, int gg,
                                           float* __restrict__ lse_out) {
  const int b = row / num_kv_heads, head = (row % num_kv_heads) * G + gg;
  float dot = 0.0f;
  if (mean_k) {
    const float* qh = q + b * q_sb + head * q_sh;
    const float* mk = mean_k + (size_t)row * D;
    for (int c = 0; c < D; ++c) dot = fmaf(qh[c], mk[c], dot);
  }
  lse_out[(size_t)row * G + gg] = (M == -SKV_INF || !(W > 0.0f))
                                      ? -SKV_INF
                                      : (M + log2f(W)) * 0.69314718056f + scale * dot;
}

#define SKV_MERGE_LSE_PARAMS                                                                  \
  const float* __restrict__ q, long long q_sb, long long q_sh, const float* __restrict__ mean_k, \
      float scale, float* __restrict__ lse_out

// Split-K merge: one CTA per row, D threads; o = sum_s w_s O_s / sum_s w_s, w_s = 2^(lse_s - M),
// then Pi_V^T and mu_V as in the single-split path (and, with lse_out, merged_lse).
template <int D>
__global__ void __launch_bounds__(D)
ada_merge_kernel(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                 int num_splits, int rows, int num_kv_heads, int G,
                 const float* __restrict__ sigma_v, const float* __restrict__ mean_v,
                 float* __restrict__ out, SKV_MERGE_LSE_PARAMS) {
  __shared__ float buf[DEC_HEADS * D];
  const int row = blockIdx.x, kvh = row % num_kv_heads, j = threadIdx.x;
  for (int gg = 0; gg < G; ++gg) {
    float M = -SKV_INF;
    for (int s = 0; s < num_splits; ++s)
      M = fmaxf(M, part_lse[((size_t)s * rows + row) * G + gg]);
    float W = 0.0f, O = 0.0f;
    if (M != -SKV_INF) {
      for (int s = 0; s < num_splits; ++s) {
        size_t k = ((size_t)s * rows + row) * G + gg;
        float w = exp2f(part_lse[k] - M);
        W += w;
        O += w * part_o[k * D + j];
      }
    }
    buf[gg * D + j] = W > 0.0f ? O / W : 0.0f;
    if (lse_out && j == 0)
      merged_lse<D>(M, W, q, q_sb, q_sh, mean_k, scale, row, num_kv_heads, G, gg, lse_out);
  }
  finish_heads<D>(buf, G, sigma_v + (size_t)kvh * D, mean_v ? mean_v + (size_t)row * D : nullptr,
                  out + (long long)row * G * D, D);
}

// Per-head split-K merge (the affine path's): one CTA per (head, row), 4 x D threads: the split weights w_s = 2^(lse_s - M)
// in shared memory (warp 0), each quarter of the CTA sums a quarter of the splits (independent
// loads, coalesced over the D coordinates), then Pi_V^T and mu_V of the one head. The per-row merge
// (ada_merge_kernel: one CTA per row, D threads, splits in sequence) is latency-bound when there are many splits
// per row (1 x 128K: 66-132). num_splits <= MERGE_HEAD_MAX_SPLITS (the launcher checks).
// The kernel is a short chain of dependent steps after the decode's last CTA, so warp 0 loads
// the sigma_V and mu_V rows at entry (before pdl_wait: with a programmatic launch, while the
// decode's last CTAs run), and each thread its first MERGE_HEAD_PRE partial values in parallel
// with the weights' loads; the inverse rotation runs in warp 0's registers (D/32
// coordinates per lane, in-lane and shuffle butterflies in block_fwht's stage order, so
// finish_heads' sums, bit for bit) instead of block_fwht's seven CTA barriers
// (docs/PERF_NOTES.md). Eight thread groups instead of four at 33 and 66 splits: no faster.
constexpr int MERGE_HEAD_MAX_SPLITS = 256;
constexpr int MERGE_HEAD_PRE = 4;   // partial values per thread loaded at entry (splits part + 4 i)
template <int D>
__global__ void __launch_bounds__(4 * D, 1024 / (4 * D))   // <= 64 registers, no spill
ada_merge_per_head_kernel(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                    int num_splits, int rows, int num_kv_heads, int G,
                    const float* __restrict__ sigma_v, const float* __restrict__ mean_v,
                    float* __restrict__ out, SKV_MERGE_LSE_PARAMS) {
  __shared__ float wsh[MERGE_HEAD_MAX_SPLITS];
  __shared__ float red[4][D];
  __shared__ float wsum, wmax;
  const int gg = blockIdx.x, row = blockIdx.y, kvh = row % num_kv_heads;
  const int tid = threadIdx.x, j = tid % D, part = tid / D;
  const size_t hstride = (size_t)rows * G, base = (size_t)row * G + gg;   // in heads
  constexpr int V = D / 32;   // coordinates per lane of warp 0 in the rotation
  float sg[V], mu[V];   // inputs of the step, not the decode's outputs: read before the wait
  if (tid < 32) {
#pragma unroll
    for (int e = 0; e < V; ++e) {
      sg[e] = sigma_v[(size_t)kvh * D + V * tid + e];
      mu[e] = mean_v ? mean_v[(size_t)row * D + V * tid + e] : 0.0f;
    }
  }
  pdl_wait();   // the partials are the decode kernel's (a programmatic launch: see pdl_launch_dependents)
  float pre[MERGE_HEAD_PRE];
#pragma unroll
  for (int i = 0; i < MERGE_HEAD_PRE; ++i) {
    const int s = part + 4 * i;
    pre[i] = s < num_splits ? part_o[(s * hstride + base) * D + j] : 0.0f;
  }
  if (tid < 32) {
    float M = -SKV_INF;
    for (int s = tid; s < num_splits; s += 32) {
      const float v = part_lse[s * hstride + base];
      wsh[s] = v;
      M = fmaxf(M, v);
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, m));
    float W = 0.0f;
    for (int s = tid; s < num_splits; s += 32) {
      const float w = M == -SKV_INF ? 0.0f : exp2f(wsh[s] - M);
      wsh[s] = w;
      W += w;
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) W += __shfl_xor_sync(0xffffffffu, W, m);
    if (tid == 0) {
      wsum = W;
      wmax = M;
    }
  }
  __syncthreads();
  float o = 0.0f;
#pragma unroll
  for (int i = 0; i < MERGE_HEAD_PRE; ++i)
    if (part + 4 * i < num_splits) o += wsh[part + 4 * i] * pre[i];
#pragma unroll 4
  for (int s = part + 4 * MERGE_HEAD_PRE; s < num_splits; s += 4) o += wsh[s] * part_o[(s * hstride + base) * D + j];
  red[part][j] = o;
  __syncthreads();
  if (tid < 32) {
    float y[V];
    const float ws = wsum;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const int c = V * tid + e;
      const float O = (red[0][c] + red[1][c]) + (red[2][c] + red[3][c]);
      y[e] = ws > 0.0f ? O / ws : 0.0f;
    }
    warp_fwht<D>(y, tid);
    float* dst = out + ((long long)row * G + gg) * D + V * tid;
#pragma unroll
    for (int e = 0; e < V; ++e) {
      float v = y[e] * sg[e] * (1.0f / (float)D);
      if (mean_v) v += mu[e];
      dst[e] = v;
    }
  }
  if (lse_out && tid == 0)   // after the outputs: nothing else is live (<= 64 registers)
    merged_lse<D>(wmax, wsum, q, q_sb, q_sh, mean_k, scale, row, num_kv_heads, G, gg, lse_out);
}

}  // namespace skv
