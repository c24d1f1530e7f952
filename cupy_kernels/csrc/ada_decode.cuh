// ADA paged decode: attention logits and values straight from spherical codes (DESIGN §6).
//
// Thread -> data map
//   grid (num_splits, rows): one CTA per (sequence, kv-head) row and split of its page list;
//   the split takes pages [s*ceil(n/S), (s+1)*ceil(n/S)) of the row's n pages.
//   block = 4 warps; warp w walks the split's pages w, w+4, w+8, ... and, in each page, tiles
//   of 16 * NSUB states (v4: 16; v5: 32 = two independent m16 sub-tiles per softmax step;
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
#pragma once
#include "spherical_common.cuh"

namespace skv {

constexpr int DEC_WARPS = 4;
constexpr int DEC_HEADS = 8;   // n of the mma tile: GQA groups up to 8 query heads
#ifndef DEC_TABLE_SUB
#define DEC_TABLE_SUB 2         // 16-state sub-tiles per softmax step on the table path (v5)
#endif
#ifndef DEC_UNI_SUB
#define DEC_UNI_SUB 2           // the same on the affine path (v5)
#endif
#ifndef DEC_UNI_CTAS
#define DEC_UNI_CTAS 4          // residency asked of ptxas for the v4 affine kernel (128 regs)
#endif
#ifndef DEC_UNI5_CTAS
#define DEC_UNI5_CTAS 3         // v5 affine kernel: 168 registers (at 128 it spills ~20 B)
#endif
#ifndef DEC_UNI6_CTAS
#define DEC_UNI6_CTAS 4         // v6 affine kernel: <= 128 registers
#endif
#ifndef DEC_TABLE6_CTAS
#define DEC_TABLE6_CTAS 3       // v6 table kernel (72 KiB of shared memory allow 3 anyway)
#endif
#ifndef DEC_UNI6_SUB
#define DEC_UNI6_SUB 2          // v6 affine kernel: 16-state sub-tiles per softmax step (see below)
#endif
#ifndef DEC_LAZY_MAX
#define DEC_LAZY_MAX 4.0f       // v6: log2 slack of the running maximum (see decode_page)
#endif

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
  float qhalf[DEC_HEADS];  // affine v5/v6: sum of the fp16 q' per head / 2
  uint2 qfrag[D / 16][32];  // v6: the query's B fragments, [chunk][lane]
  int prange[2];            // v6: the CTA's pages [prange[0] + pbeg, prange[0] + prange[1])
};

// Dynamic shared memory: [LUT_BYTES tables][region], region = max(2 page buffers per warp,
// the per-warp output tiles of the final merge, which reuse it).
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

// Where the logit mma reads its B operand (the rotated query, fp16): v4/v5 hold the whole
// fragment in registers (QRegs, 16 registers at D = 128); v6 re-reads chunk c from shared
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
__device__ __forceinline__ int lds_s32(u32 a) {   // not hoisted out of a loop (volatile)
  int v;
  asm volatile("ld.shared.s32 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}

// The query fragment source of a version: shared memory on v6, registers before.
template <bool V6> struct QSource {
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
  // (2 and 4 words), and every group on the v5 affine path (two sub-tiles), are loaded per
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
// group: v4 2c - 15 (shift, and, or, hadd2), v5 c - 8 (lop3, fma; a shift per two pairs).
template <int PATH>
__device__ __forceinline__ u32 nib_pair(u32 x, int p) {
  if constexpr (PATH == PATH_AFFINE) {
    switch (p) {
      case 0: return dq_pair<0, 4>(x);
      case 1: return dq_pair<4, 4>(x);
      case 2: return dq_pair<0, 4>(x >> 8);
      default: return dq_pair<4, 4>(x >> 8);
    }
  } else {
    return h2_as_u32(affine_pair<4>(to_bit1(x, 4 * p), 0x001e001eu));
  }
}

// Value phase for one sub-tile of 16 states from tile0: acc[mb] += V^T block mb . P'^T.
template <int B, int PATH, int D, class R>
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
      for (int j = 0; j < NG; ++j) w[k][j] = st[k] < count ? row.w(g + 8 * j) : 0u;
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
          wl[k] = st[k] < count ? row.w(4 * (g + 8 * j) + e) : 0u;
          wh[k] = st[k] < count ? row.w(4 * (g + 8 * j) + 2 + e) : 0u;
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
        if (st[k] < count) v[k][j].load(row, g + 8 * j, D / 16); else v[k][j].zero();
      }
    }
  }
#pragma unroll
  for (int j = 0; j < NG; ++j) {
    if (!EAGER) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const R row = vbase.at(st[k] * vwords);
        if (st[k] < count) v[k][j].load(row, g + 8 * j, D / 16); else v[k][j].zero();
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
template <int D, int PATH, int NSUB, class R>
__device__ __forceinline__ void dispatch_values(int bits, const R& vbase, int vwords, int tile0,
                                                int count, const u32 (&pb)[NSUB][2],
                                                const Luts& lut, int g, int t,
                                                float (&acc)[D / 16][4]) {
#define SKV_VALUES(BB)                                                                       \
  _Pragma("unroll") for (int u = 0; u < NSUB; ++u)                                           \
    if (u == 0 || tile0 + 16 * u < count)                                                    \
      tile_values<BB, PATH, D, R>(vbase, vwords, tile0 + 16 * u, count, pb[u][0], pb[u][1],  \
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

// The constants of one page's tier for lane (g, t): geometry (docs/format.md), and the
// per-head logit factors of heads 2t, 2t + 1. Affine paths: the half step (doubled on
// v5/v6, where the operand is u = c - 2^(B-1)) joins the scales; v5/v6 add sum(q')/2 to the
// mma's logit sum (qk). v6 leaves q . mu_K out (mu = 0, decode_page).
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
// above). NSUB = 2 (v5, v6): one running-maximum update, one shuffle reduction and one P'
// exchange per 32 states; each lane first reduces its own 2 * NSUB states per head.
// ps0, ps1: sum of the fp16 P' of the affine (v5, v6) tiers, for the "+1/2" of u = c - 2^(B-1).
// V6 differs in three places:
//   * P' goes from the C fragment of the logit mma (state rows, head columns) to the B
//     fragment of the value mma (state k, head n) by two movmatrix transposes per sub-tile:
//     no shared-memory tile, no __syncwarp;
//   * lazy maximum: the running maximum m of a head moves only when a logit exceeds it by
//     more than DEC_LAZY_MAX (log2 units), so after the first tiles a step costs one vote
//     and no shuffles. Then p = 2^(z - m) <= 2^DEC_LAZY_MAX: P' = p s_V stays in fp16 for
//     s_V * half step < 65504 / 2^DEC_LAZY_MAX (4094 at 4), far above real value norms;
//   * q . mu_K is left out of the logits: it is the same for every state of a head (every
//     warp and split), so the softmax and the output do not see it (only the internal lse).
template <int D, int PATH, int NSUB, bool V6, class R, class QF>
__device__ __forceinline__ void decode_page(const R& pg, const int* gm, int count,
                                            const QF& qf, const Luts& lut,
                                            const float* kfac, const float* qmu,
                                            const float* hstep, const float* qhalf, __half* pt,
                                            int g, int t, float (&acc)[D / 16][4],
                                            float& m0, float& m1, float& l0, float& l1,
                                            float& ps0, float& ps1) {
  constexpr bool UNI = PATH != PATH_TABLE;
  constexpr int TS = 16 * NSUB;        // states per tile (row stride of the P' tile)
  const float top = sqrtf((float)D);   // 16-bit tier: logit = sqrt(D) <q', y>, no scale
  PageConsts pc;
  // v4/v5 read the page's constants once; v6 re-reads them (L1-resident) at every step, so
  // that they do not hold registers across the step (4 CTAs per SM at 128 registers).
  if constexpr (!V6) pc.template load<UNI, PATH == PATH_AFFINE, false>(gm, kfac, qmu, hstep, qhalf, t);
  for (int tile0 = 0; tile0 < count; tile0 += TS) {
    if constexpr (V6) pc.template load<UNI, PATH == PATH_AFFINE, true>(gm, kfac, qmu, hstep, qhalf, t);
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
    // v4/v5: the exact running maximum (one shuffle reduction per step), accumulators
    // rescaled when some head's maximum moved. v6: the same, only when a logit passed m + lazy.
    bool move;
    if constexpr (V6) {
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
        const float al0 = exp2f(m0 - n0), al1 = exp2f(m1 - n1);
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
      const float p0 = exp2f(z[u][0] - m0), p1 = exp2f(z[u][1] - m1);
      const float p2 = exp2f(z[u][2] - m0), p3 = exp2f(z[u][3] - m1);
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
    if constexpr (V6) {   // in registers
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
    dispatch_values<D, PATH, NSUB>(vbits, vbase, vwords, tile0, count, pb, lut, g, t, acc);
  }
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

// The body of the decode kernels. PATH_TABLE: any codebook (`levels` is the (5, 256) float32
// level table). PATH_AFFINE(_V4): uniform codebook (`levels` holds the 5 half steps hs_b of
// b = 1, 2, 3, 4, 8 bits; no tables in shared memory). NSUB: 16-state sub-tiles per softmax
// step (v4: 1, v5 and v6: 2). V6: see decode_page.
template <int D, int PATH, int NSUB, bool V6>
__device__ __forceinline__ void decode_cta(SKV_DECODE_PARAMS) {
  constexpr bool UNI = PATH != PATH_TABLE;
  __shared__ DecodeSmem<D> sm;
  extern __shared__ __align__(16) unsigned char dyn[];
  float* region = reinterpret_cast<float*>(dyn + (UNI ? 0 : LUT_BYTES));   // queries, pages, merge
  const int split = blockIdx.x, row = blockIdx.y;
  const int b = row / num_kv_heads, kvh = row % num_kv_heads;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;

  Luts lut = {};
  if constexpr (UNI) {
    // v5 feeds u = c - 2^(B-1) = (2c - (2^B - 1) - 1) / 2: twice the half step per unit
    if (threadIdx.x < 5) sm.hstep[threadIdx.x] = levels[threadIdx.x] * (PATH == PATH_AFFINE ? 2.0f : 1.0f);
  } else {
    lut = build_luts(dyn, levels, threadIdx.x, blockDim.x);
  }

  // ---- rotated query, once per head: q' = H(sigma_K * q) / D, kept as q'/max|q'| in fp16
  float* qs = region;
  const float* qrow = q + (long long)b * q_sb + (long long)(kvh * G) * q_sh;
  const float* sk = sigma_k + (size_t)kvh * D;
  for (int idx = threadIdx.x; idx < DEC_HEADS * D; idx += blockDim.x) {
    int gg = idx / D, j = idx % D;
    qs[idx] = gg < G ? qrow[gg * q_sh + j] * sk[j] : 0.0f;
  }
  if (!V6 && threadIdx.x < DEC_HEADS) {   // v6 leaves q . mu_K out (decode_page)
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
  __syncthreads();
  // Q fragment: lane (g, t) holds head g of group 8*(t+4i); k16 chunk (i, h) takes the
  // group's pairs 2h and 2h+1, i.e. coordinates 4h + (0, 1 | 2, 3) on the table path and
  // 2h + (0, 4 | 1, 5) on the affine path (UGroup pairs coordinates p and p + 4).
  QRegs<D> qr;
  u32 (&qf)[D / 16][2] = qr.v;
  {
    float inv = sm.qfac[g] > 0.0f ? 1.0f / (sm.qfac[g] * (float)D) : 0.0f;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float* src = qs + g * D + 8 * (t + 4 * i);
        if constexpr (UNI) {
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
    if (warp == 0 && t == 0) sm.qhalf[g] = 0.5f * qsum;
  }
  if (V6 && warp == 0) {
#pragma unroll
    for (int i = 0; i < D / 16; ++i) sm.qfrag[i][lane] = make_uint2(qf[i][0], qf[i][1]);
  }
  QShared qsh;
  qsh.a = static_cast<u32>(__cvta_generic_to_shared(&sm.qfrag[0][lane]));
  const auto& qsrc = QSource<V6>::of(qsh, qr);
  const int h0 = 2 * t, h1 = 2 * t + 1;
  const int rbeg = indptr[row], n = indptr[row + 1] - rbeg;
  const int per = (n + num_splits - 1) / num_splits;
  const int pbeg = split * per, pend = min(n, pbeg + per);
  // v6 re-reads the CTA's page range from shared memory at each page: held in registers
  // across the page loop, ptxas spills it to local memory at the 128-register cap.
  if (V6 && threadIdx.x == 0) { sm.prange[0] = rbeg; sm.prange[1] = pend; }
  const u32 prange = static_cast<u32>(__cvta_generic_to_shared(&sm.prange[0]));
  __syncthreads();  // the query staging area becomes page buffers

  float acc[D / 16][4];
#pragma unroll
  for (int i = 0; i < D / 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
  float m0 = -SKV_INF, m1 = -SKV_INF, l0 = 0.0f, l1 = 0.0f, ps0 = 0.0f, ps1 = 0.0f;

  __half* pt = &sm.ptile[warp][0][0];
  u32* bufs = reinterpret_cast<u32*>(region) + (size_t)warp * 2 * page_words;
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
  for (; pi < (V6 ? lds_s32(prange + 4) : pend); pi += DEC_WARPS) {
    // header of the next page, and its copy into the other buffer
    const int ni = pi + DEC_WARPS;
    int nxt_page = 0, nxt_tier = 0, nxt_count = 0;
    bool nxt_full = false;
    if (ni < (V6 ? lds_s32(prange + 4) : pend)) {
      nxt_page = indices[(V6 ? lds_s32(prange) : rbeg) + ni];
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
      decode_page<D, PATH, NSUB, V6>(r, geom + cur_tier * SKV_GEOM_STRIDE, cur_count, qsrc, lut,
                                     sm.kfac, sm.qmu, sm.hstep, sm.qhalf, pt, g, t, acc, m0, m1,
                                     l0, l1, ps0, ps1);
    } else {
      GlobalRow r;
      r.p = pages + (size_t)cur_page * page_words;
      decode_page<D, PATH, NSUB, V6>(r, geom + cur_tier * SKV_GEOM_STRIDE, cur_count, qsrc, lut,
                                     sm.kfac, sm.qmu, sm.hstep, sm.qhalf, pt, g, t, acc, m0, m1,
                                     l0, l1, ps0, ps1);
    }
    __syncwarp();   // every lane is done with this buffer before it is refilled
    buf ^= 1;
    cur_page = nxt_page; cur_tier = nxt_tier; cur_count = nxt_count; cur_full = nxt_full;
  }
  cp_async_wait0();

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
      const int c = 8 * (g + 8 * j) + (UNI ? p : 2 * p), c2 = c + (UNI ? 4 : 1);
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
  __syncthreads();
#pragma unroll
  for (int k = 0; k < PER; ++k) obuf[threadIdx.x + k * DEC_WARPS * 32] = val[k];
  __syncthreads();
  if (num_splits == 1) {
    finish_heads<D>(obuf, G, sigma_v + (size_t)kvh * D, mean_v ? mean_v + (size_t)row * D : nullptr,
                    out + (long long)row * G * D, D);
  } else {
    const size_t base = ((size_t)split * gridDim.y + row) * G;
    for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) part_o[base * D + idx] = obuf[idx];
    const int tid = tid_x();   // re-read: held across the page loop it would cost a register
    if (tid < G) part_lse[base + tid] = sm.lse[tid];
  }
}

// Table path (Lloyd–Max or any codebook): 37 KiB of replicated tables, 3 CTAs per SM.
template <int D>
__global__ void __launch_bounds__(DEC_WARPS * 32, 3) ada_decode_kernel(SKV_DECODE_PARAMS) {
  decode_cta<D, PATH_TABLE, DEC_TABLE_SUB, false>(SKV_DECODE_ARGS);
}

// Affine path (uniform codebook), v5: lop3 + fma per pair, 32-state softmax steps; no
// tables, so more CTAs fit per SM.
template <int D>
__global__ void __launch_bounds__(DEC_WARPS * 32, DEC_UNI5_CTAS)
ada_decode_uniform_kernel(SKV_DECODE_PARAMS) {
  decode_cta<D, PATH_AFFINE, DEC_UNI_SUB, false>(SKV_DECODE_ARGS);
}

// The v4 kernels (16-state softmax steps; affine pairs by shift, and, or, hadd2), kept for
// the side-by-side benchmark and as a fallback (ada_decode(version=4)).
template <int D>
__global__ void __launch_bounds__(DEC_WARPS * 32, 3) ada_decode_v4_kernel(SKV_DECODE_PARAMS) {
  decode_cta<D, PATH_TABLE, 1, false>(SKV_DECODE_ARGS);
}
template <int D>
__global__ void __launch_bounds__(DEC_WARPS * 32, DEC_UNI_CTAS)
ada_decode_uniform_v4_kernel(SKV_DECODE_PARAMS) {
  decode_cta<D, PATH_AFFINE_V4, 1, false>(SKV_DECODE_ARGS);
}

// v6 (decode_page): P' transposed in registers, lazy running maximum, the query fragment
// re-read from shared memory; the affine kernel fits 128 registers (4 CTAs per SM) with two
// sub-tiles per step, at the price of one page-loop variable in 4 bytes of local memory
// (stored and loaded in the page header, never inside a step). With DEC_UNI6_SUB=1 it needs
// no local memory but was measured 4-12 % slower on uniform tiers (docs/PERF_NOTES.md v6).
template <int D>
__global__ void __launch_bounds__(DEC_WARPS * 32, DEC_TABLE6_CTAS) ada_decode_v6_kernel(SKV_DECODE_PARAMS) {
  decode_cta<D, PATH_TABLE, DEC_TABLE_SUB, true>(SKV_DECODE_ARGS);
}
template <int D>
__global__ void __launch_bounds__(DEC_WARPS * 32, DEC_UNI6_CTAS)
ada_decode_uniform_v6_kernel(SKV_DECODE_PARAMS) {
  decode_cta<D, PATH_AFFINE, DEC_UNI6_SUB, true>(SKV_DECODE_ARGS);
}

// Split-K merge: one CTA per row, D threads; o = sum_s w_s O_s / sum_s w_s, w_s = 2^(lse_s - M),
// then Pi_V^T and mu_V as in the single-split path.
template <int D>
__global__ void __launch_bounds__(D)
ada_merge_kernel(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                 int num_splits, int rows, int num_kv_heads, int G,
                 const float* __restrict__ sigma_v, const float* __restrict__ mean_v,
                 float* __restrict__ out) {
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
  }
  finish_heads<D>(buf, G, sigma_v + (size_t)kvh * D, mean_v ? mean_v + (size_t)row * D : nullptr,
                  out + (long long)row * G * D, D);
}

}  // namespace skv
