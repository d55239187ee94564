"""Paged attention kernel source: one body, rendered for Metal or CUDA through a small prelude.

The attention algorithm lives once, in ``MAIN_BODY`` and ``REDUCE_BODY``. A
dialect supplies only what the two languages spell differently: thread and
group indices, the barrier, shared/threadgroup memory, lane shuffles, a few
math intrinsics and a vector load helper. Whatever runs correctly on the GPU
we can reach (CUDA) is therefore the same algorithm a Mac runs (Metal).

Work split (``MAIN_BODY``, grid ``[num_qblocks * P * H_kv * NS]``, 128 threads):

- Each thread group owns one *q-block* (up to ``RT // G`` query tokens of one
  request, all ``G`` query heads sharing one KV head) and one of ``P`` KV
  partitions. It finds its request by binary search over ``cu_seqlens_q``:
  request ``b`` owns q-blocks ``[cu[b] // BQ + b, ...)``, a monotone layout
  that needs no host-side work list.
- Decode rows (a request with one new token) take the *row path*: lanes split
  the head dim, warps split the tokens of the group's KV partition, and the
  ``GH`` query heads of a group (all ``G`` of a KV head, or ``G / NS`` when
  that many would not fit in registers) share every K/V load. Per sub-chunk
  of keys: scores from K into shared memory, one softmax, then ``P @ V``.
  With ``P > 1`` each partition writes an unnormalised partial
  (``acc, max, sum``) and ``REDUCE_BODY`` merges them.
- Longer query chunks take the *tile path*: a ``RT x BN`` score tile in
  registers from Q and K staged in shared memory, online softmax per row,
  then ``P @ V`` into register accumulators. Only partition 0 does tile work.

Decode rows and prefill chunks of one step therefore run in one launch
(``gpu.py`` sends long half-precision chunks to MLX's fused SDPA instead, fed
by ``GATHER_BODY``'s copy of their paged context).
The CUDA rendering is checked against the reference on an H200; the Metal
rendering shares every line of the algorithm but has not yet been compiled
on a Mac.

Over 400 lines because ``MAIN_BODY`` is one kernel of some 330 lines of source and the preludes
beside it define every name it uses: apart, the template and its two dialects would drift.
"""

from __future__ import annotations

import mlx.core as mx

NUM_THREADS = 128  # four 32-wide SIMD groups / warps per thread group

# MLX's names of the dtypes in the CUDA source it generates (a kernel whose dtype is written into its own source).
CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16"}

METAL_HEADER = r"""
#define TG threadgroup
#define BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define SHFL_XOR(v, o) simd_shuffle_xor((v), (ushort)(o))
#define EXP2(x) metal::exp2(x)
#define TANH(x) metal::precise::tanh(x)
#define FMAX(a, b) metal::max((a), (b))
#define LOAD_F4(p) (*((threadgroup float4*)(p)))
#define UNROLL _Pragma("clang loop unroll(full)")

template <int N, typename V>
inline void load_vec(const device V* p, thread float* o) {
  for (int i = 0; i < N; ++i) o[i] = static_cast<float>(p[i]);
}

// N elements of one K/V row held as loaded; converted to float at use.
template <int N, typename V>
struct RawVec {
  V r[N];
  inline void load(const device V* p) {
    for (int i = 0; i < N; ++i) r[i] = p[i];
  }
  inline float get(int i) const { return static_cast<float>(r[i]); }
};

// Copies 16 bytes (paged K/V gather).
#define COPY16(dst, src) (*((device uint4*)(dst)) = *((const device uint4*)(src)))
"""

METAL_PROLOGUE = r"""
  const int tid = int(thread_index_in_threadgroup);
  const int gx = int(threadgroup_position_in_grid.x);
  const int gy = int(threadgroup_position_in_grid.y);
  const int lane = int(thread_index_in_simdgroup);
  const int warp = int(simdgroup_index_in_threadgroup);
"""

METAL_SHARED = r"""
  threadgroup float smem[SMEM_F];
  threadgroup int ismem[SMEM_I];
"""

CUDA_HEADER = r"""
#define TG
#define BARRIER() __syncthreads()
#define SHFL_XOR(v, o) __shfl_xor_sync(0xffffffffu, (v), (o))
#define EXP2(x) exp2f(x)
#define TANH(x) tanhf(x)
#define FMAX(a, b) fmaxf((a), (b))
#define LOAD_F4(p) (*reinterpret_cast<const float4*>(p))
#define UNROLL _Pragma("unroll")

// 16-byte rows load as one vector (the common bf16/fp16 case with 8 elements).
template <int N, typename V>
__device__ inline void load_vec(const V* p, float* o) {
  if constexpr (N * sizeof(V) == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const V* e = reinterpret_cast<const V*>(&raw);
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] = static_cast<float>(e[i]);
  } else if constexpr (N * sizeof(V) == 32) {
    const uint4 r0 = *reinterpret_cast<const uint4*>(p);
    const uint4 r1 = *(reinterpret_cast<const uint4*>(p) + 1);
    const V* e0 = reinterpret_cast<const V*>(&r0);
    const V* e1 = reinterpret_cast<const V*>(&r1);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
      o[i] = static_cast<float>(e0[i]);
      o[N / 2 + i] = static_cast<float>(e1[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) o[i] = static_cast<float>(p[i]);
  }
}

// N elements of one K/V row held as loaded (16-byte vectors where the row allows): half the
// registers of floats, so more loads stay in flight; converted to float at use.
template <int N, typename V, bool VEC = (N * sizeof(V)) % 16 == 0>
struct RawVec;
template <int N, typename V>
struct RawVec<N, V, true> {
  uint4 r[N * sizeof(V) / 16];
  __device__ inline void load(const V* p) {
#pragma unroll
    for (int i = 0; i < int(N * sizeof(V) / 16); ++i) r[i] = reinterpret_cast<const uint4*>(p)[i];
  }
  __device__ inline float get(int i) const { return static_cast<float>(reinterpret_cast<const V*>(r)[i]); }
};
template <int N, typename V>
struct RawVec<N, V, false> {
  V r[N];
  __device__ inline void load(const V* p) {
#pragma unroll
    for (int i = 0; i < N; ++i) r[i] = p[i];
  }
  __device__ inline float get(int i) const { return static_cast<float>(r[i]); }
};

// Copies 16 bytes (paged K/V gather).
#define COPY16(dst, src) (*reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src))
"""

CUDA_PROLOGUE = r"""
  const int tid = threadIdx.x;
  const int gx = blockIdx.x;
  const int gy = blockIdx.y;
  const int lane = tid & 31;
  const int warp = tid >> 5;
"""

# Sized at launch (``shared_memory``), so one source serves every tile shape.
CUDA_SHARED = r"""
  extern __shared__ float smem[];
  int* ismem = reinterpret_cast<int*>(smem + SMEM_F);
"""

COMMON = r"""
#define IMIN(a, b) ((a) < (b) ? (a) : (b))
#define IMAX(a, b) ((a) > (b) ? (a) : (b))
#define NEG_BIG (-1.0e30f)
#define LOG2E 1.4426950408889634f
"""

# Inputs: q [T,H,D], k_cache/v_cache [NB,BS,HKV,D], cu_seqlens_q [B+1], seq_lens [B],
# block_tables [B,MAXB], iparams [B, MAXB, P, PS, SKIP], fparams [scale, softcap, window].
# Outputs: out [T,H,D], part_o [B,H,P,D] f32, part_ml [B,H,P,2] f32 (used when P > 1).
# Grid [num_qblocks * P * HKV * NS]. Template: T (q dtype), D, G, HKV, BS, RT, BN, LPT (lanes
# per decode token), U (decode loads per lane in flight), GH (query heads per row group),
# NS = G / GH, SC (keys per decode sub-chunk), AS (decode accumulators wait in shared memory), SMEM_F, SMEM_I, and ROWS/TILES: whether the
# batch has decode rows / chunks for the tile path. A path the batch does not need is
# compiled out, so it costs no registers. Chunks of SKIP or more rows are left alone.
MAIN_BODY = r"""
  constexpr int NT = 128;
  constexpr int NW = NT / 32;
  constexpr int H = HKV * G;
  constexpr int BQ = RT / G;  // query tokens per q-block
  const int B = iparams[0];
  const int MAXB = iparams[1];
  const int P = iparams[2];
  const int PS = iparams[3];
  const float scale = fparams[0];
  const float cap = fparams[1];
  const int WIN = int(fparams[2]);
  // The grid is one dimension with the KV head fastest: every head's work of a q-block is
  // scheduled together. NS groups split the G query heads of a KV head (GH each) on the row path.
  constexpr int NY = HKV * NS;
  const int hy = gx % NY;
  const int kvh = hy / NS;
  const int hs = hy - kvh * NS;
  const int gq = gx / NY;
  const int SKIP = iparams[4];  // chunks this long are left to another route (their rows untouched)
  // Grid order runs backwards over q-blocks: prefill chunks usually follow the decode rows
  // in a packed batch, and their longer-running tiles should start first, with the short
  // decode groups filling in around them rather than queueing ahead of them.
  const int qb = (cu_seqlens_q[B] / BQ + B - 1) - gq / P;
  const int part = gq % P;

  // The request owning q-block qb: the last b with cu[b] / BQ + b <= qb.
  int b = 0;
  {
    int n = B;
    while (n > 1) {
      const int hn = n >> 1;
      const int mid = b + hn;
      if (cu_seqlens_q[mid] / BQ + mid <= qb) b = mid;
      n -= hn;
    }
  }
  const int q0 = cu_seqlens_q[b];
  const int qlen = cu_seqlens_q[b + 1] - q0;
  const int q_start = (qb - (q0 / BQ + b)) * BQ;
  const int slen = seq_lens[b];
  const int ctx0 = slen - qlen;  // absolute position of the request's first new token
  // Without a softcap the log2(e) of exp2 folds into the query scale.
  const float qscale = cap > 0.0f ? scale : scale * LOG2E;

  // Partitions past a decode row's context have nothing to do (and must not touch out).
  if (ROWS && q_start < qlen && qlen == 1 && part * PS < slen) {
    // ---------------- row path: one query token, split over KV partitions ----------------
    // Two phases per sub-chunk of SC keys: scores (K only) into shared memory, one softmax
    // over them, then P @ V (V only). Each phase keeps just one operand's raw loads in
    // registers, so a lane has U loads in flight with few registers and many groups fit.
    constexpr int TPW = 32 / LPT;   // tokens a warp covers per load
    constexpr int EL = D / LPT;     // head-dim elements per lane
    constexpr int NTOK = NW * TPW;  // tokens the group covers per load
    constexpr int STEP = U * NTOK;
    const int h0 = kvh * G + hs * GH;  // first of this group's GH query heads
    const int pos = slen - 1;
    int lo = WIN > 0 ? IMAX(0, pos - WIN + 1) : 0;
    int hi = slen;
    lo = IMAX(lo, part * PS);
    hi = IMIN(hi, (part + 1) * PS);
    const int blk0 = (part * PS) / BS;

    TG float* m_s = smem;           // [GH] running max (log2 domain)
    TG float* l_s = m_s + GH;       // [GH] running sum
    TG float* a_s = l_s + GH;       // [GH] rescale of the accumulators for this sub-chunk
    TG float* sc = a_s + 2 * GH;    // [GH][SC] scores, then probabilities
    TG float* red = sc;             // [NW][GH][D] after the last sub-chunk (sized for both)
    TG float* acc_s = sc + IMAX(GH * SC, NW * GH * D);  // [GH * EL][NT] accumulators between sub-chunks (AS)
    // Stage this partition's slice of the block table: one dependent global load fewer per token.
    TG int* tbl = ismem;
    for (int i = tid; i < PS / BS && blk0 + i < MAXB; i += NT) {
      tbl[i] = block_tables[b * MAXB + blk0 + i];
    }
    if (tid < GH) {
      m_s[tid] = NEG_BIG;
      l_s[tid] = 0.0f;
    }
    BARRIER();

    const int slot = lane / LPT;
    const int li = lane % LPT;
    const int tok = warp * TPW + slot;
    // With AS the accumulators wait in shared memory while the scores phase runs, and q is
    // reloaded per sub-chunk, so neither holds registers through the other phase.
    float acc[GH][EL];
    UNROLL for (int g = 0; g < GH; ++g) {
      UNROLL for (int e = 0; e < EL; ++e) {
        acc[g][e] = 0.0f;
        if (AS) acc_s[(g * EL + e) * NT + tid] = 0.0f;
      }
    }
#define ROW_ADDR(TK) (((long)(tbl[(TK) / BS - blk0] * BS + (TK) % BS) * HKV + kvh) * D + li * EL)

    for (int c0 = lo; c0 < hi; c0 += SC) {
      const int c1 = IMIN(c0 + SC, hi);
      float qr[GH][EL];
      UNROLL for (int g = 0; g < GH; ++g) {
        load_vec<EL>(q + ((long)q0 * H + h0 + g) * D + li * EL, qr[g]);
        UNROLL for (int e = 0; e < EL; ++e) qr[g][e] *= qscale;
      }
      // Phase 1: scores. Loads past c1 read a valid row (c1 - 1) and are not stored.
      for (int base = c0; base < c1; base += STEP) {
        RawVec<EL, T> kr[U];
        UNROLL for (int u = 0; u < U; ++u) kr[u].load(k_cache + ROW_ADDR(IMIN(base + u * NTOK + tok, c1 - 1)));
        UNROLL for (int u = 0; u < U; ++u) {
          const int tk = base + u * NTOK + tok;
          UNROLL for (int g = 0; g < GH; ++g) {
            float sv = 0.0f;
            UNROLL for (int e = 0; e < EL; ++e) sv += qr[g][e] * kr[u].get(e);
            UNROLL for (int o = LPT / 2; o > 0; o >>= 1) sv += SHFL_XOR(sv, o);
            if (cap > 0.0f) sv = cap * TANH(sv / cap) * LOG2E;
            if (li == 0 && tk < c1) sc[g * SC + tk - c0] = sv;
          }
        }
      }
      BARRIER();
      // Softmax over the sub-chunk, one warp per head; the running max and sum carry over.
      for (int g = warp; g < GH; g += NW) {
        float mx_ = NEG_BIG;
        for (int i = lane; i < c1 - c0; i += 32) mx_ = FMAX(mx_, sc[g * SC + i]);
        UNROLL for (int o = 16; o > 0; o >>= 1) mx_ = FMAX(mx_, SHFL_XOR(mx_, o));
        const float mo = m_s[g];
        const float mn = FMAX(mo, mx_);
        float sum = 0.0f;
        for (int i = lane; i < c1 - c0; i += 32) {
          const float p = EXP2(sc[g * SC + i] - mn);
          sc[g * SC + i] = p;
          sum += p;
        }
        UNROLL for (int o = 16; o > 0; o >>= 1) sum += SHFL_XOR(sum, o);
        if (lane == 0) {
          const float al = EXP2(mo - mn);
          a_s[g] = al;
          l_s[g] = l_s[g] * al + sum;
          m_s[g] = mn;
        }
      }
      BARRIER();
      UNROLL for (int g = 0; g < GH; ++g) {
        const float al = a_s[g];
        UNROLL for (int e = 0; e < EL; ++e) acc[g][e] = (AS ? acc_s[(g * EL + e) * NT + tid] : acc[g][e]) * al;
      }
      // Phase 2: P @ V.
      for (int base = c0; base < c1; base += STEP) {
        RawVec<EL, T> vr[U];
        UNROLL for (int u = 0; u < U; ++u) vr[u].load(v_cache + ROW_ADDR(IMIN(base + u * NTOK + tok, c1 - 1)));
        UNROLL for (int u = 0; u < U; ++u) {
          const int tk = base + u * NTOK + tok;
          const bool ok = tk < c1;
          const int ti = ok ? tk - c0 : 0;
          UNROLL for (int g = 0; g < GH; ++g) {
            const float p = ok ? sc[g * SC + ti] : 0.0f;
            UNROLL for (int e = 0; e < EL; ++e) acc[g][e] += p * vr[u].get(e);
          }
        }
      }
      if (AS) {
        UNROLL for (int g = 0; g < GH; ++g) {
          UNROLL for (int e = 0; e < EL; ++e) acc_s[(g * EL + e) * NT + tid] = acc[g][e];
        }
      }
      BARRIER();  // the next sub-chunk (or the merge below) overwrites sc
    }
#undef ROW_ADDR

    // Every lane's accumulators share the group's max: the merge is a plain sum, first over
    // the token slots of a warp, then over the warps through shared memory.
    UNROLL for (int o = LPT; o < 32; o <<= 1) {
      UNROLL for (int g = 0; g < GH; ++g) {
        UNROLL for (int e = 0; e < EL; ++e) acc[g][e] += SHFL_XOR(acc[g][e], o);
      }
    }
    if (slot == 0) {
      UNROLL for (int g = 0; g < GH; ++g) {
        UNROLL for (int e = 0; e < EL; ++e) red[(warp * GH + g) * D + li * EL + e] = acc[g][e];
      }
    }
    BARRIER();
    for (int i = tid; i < GH * D; i += NT) {
      const int g = i / D;
      const int d = i - g * D;
      float o = 0.0f;
      UNROLL for (int w = 0; w < NW; ++w) o += red[(w * GH + g) * D + d];
      const float lsum = l_s[g];
      const int h = h0 + g;
      if (slen <= PS) {  // a single partition: the merge pass copies this row as it is
        out[((long)q0 * H + h) * D + d] = static_cast<T>(lsum > 0.0f ? o / lsum : 0.0f);
      } else {
        const long pi = ((long)b * H + h) * P + part;
        part_o[pi * D + d] = o;
        if (d == 0) {
          part_ml[pi * 2] = m_s[g];
          part_ml[pi * 2 + 1] = lsum;
        }
      }
    }
  } else if (TILES && q_start < qlen && qlen > 1 && qlen < SKIP && part == 0 && hs == 0) {
    // ---------------- tile path: a chunk of query tokens, causal within the chunk ----------------
    constexpr int SR = RT * BN / NT;  // score rows per thread (one key column each)
    constexpr int QS = RT + 4;        // qT row stride: float4-aligned
    constexpr int KS = BN + 1;        // kT row stride: conflict-free transposed stores
    constexpr int PST = BN + 1;
    constexpr int DL = 16;            // lanes across the head dim in P @ V
    constexpr int OR = RT * DL / NT;  // output rows per thread
    constexpr int OD = D / DL;        // output columns per thread
    TG float* qT = smem;              // [D][QS]  scaled Q, transposed
    TG float* kv = qT + D * QS;       // [D][KS] K transposed, then [BN][D] V
    TG float* pm = kv + D * KS;       // [RT][PST] probabilities
    TG float* alpha_s = pm + RT * PST;
    TG float* l_s = alpha_s + RT;
    TG int* tok_row = ismem;          // [BN] cache row (block * BS + offset) of each key

    const int m_rows = IMIN(BQ, qlen - q_start);
    const int nrows = m_rows * G;
    const int qpos0 = ctx0 + q_start;
    const long qrow0 = (long)q0 + q_start;
    for (int i = tid; i < RT * D; i += NT) {
      const int r = i / D;
      const int d = i - r * D;
      float v = 0.0f;
      if (r < nrows) v = static_cast<float>(q[((qrow0 + r / G) * H + kvh * G + r % G) * D + d]) * qscale;
      qT[d * QS + r] = v;
    }
    const int hi = qpos0 + m_rows;
    const int lo = WIN > 0 ? IMAX(0, qpos0 - WIN + 1) : 0;

    const int c = tid % BN;
    const int r0 = (tid / BN) * SR;
    float mrow[SR];
    float lrow[SR];
    UNROLL for (int i = 0; i < SR; ++i) {
      mrow[i] = NEG_BIG;
      lrow[i] = 0.0f;
    }
    const int dl = tid % DL;
    const int ro = (tid / DL) * OR;
    float acc[OR][OD];
    UNROLL for (int i = 0; i < OR; ++i)
      UNROLL for (int j = 0; j < OD; ++j) acc[i][j] = 0.0f;

    for (int kt = lo; kt < hi; kt += BN) {
      BARRIER();  // the previous tile's readers of kv/pm are done (and qT is written)
      if (tid < BN) {
        const int tok = IMIN(kt + tid, hi - 1);
        tok_row[tid] = block_tables[b * MAXB + tok / BS] * BS + tok % BS;
      }
      BARRIER();
      for (int i = tid; i < BN * D; i += NT) {
        const int cc = i / D;
        const int d = i - cc * D;
        kv[d * KS + cc] = static_cast<float>(k_cache[((long)tok_row[cc] * HKV + kvh) * D + d]);
      }
      BARRIER();
      float s[SR];
      UNROLL for (int i = 0; i < SR; ++i) s[i] = 0.0f;
      for (int d = 0; d < D; ++d) {
        const float kd = kv[d * KS + c];
        if (SR % 4 == 0) {
          UNROLL for (int i = 0; i < SR; i += 4) {
            const float4 qv = LOAD_F4(qT + d * QS + r0 + i);
            s[i] += qv.x * kd;
            s[i + 1] += qv.y * kd;
            s[i + 2] += qv.z * kd;
            s[i + 3] += qv.w * kd;
          }
        } else {
          UNROLL for (int i = 0; i < SR; ++i) s[i] += qT[d * QS + r0 + i] * kd;
        }
      }
      const int kp = kt + c;
      UNROLL for (int i = 0; i < SR; ++i) {
        const int r = r0 + i;
        const int qp = qpos0 + r / G;
        bool ok = r < nrows && kp <= qp;
        if (WIN > 0) ok = ok && kp > qp - WIN;
        float x = s[i];
        if (cap > 0.0f) x = cap * TANH(x / cap) * LOG2E;
        x = ok ? x : NEG_BIG;
        float tmax = x;
        UNROLL for (int o = BN / 2; o > 0; o >>= 1) tmax = FMAX(tmax, SHFL_XOR(tmax, o));
        const float mn = FMAX(mrow[i], tmax);
        const float al = EXP2(mrow[i] - mn);
        const float p = ok ? EXP2(x - mn) : 0.0f;
        float psum = p;
        UNROLL for (int o = BN / 2; o > 0; o >>= 1) psum += SHFL_XOR(psum, o);
        lrow[i] = lrow[i] * al + psum;
        mrow[i] = mn;
        pm[r * PST + c] = p;
        if (c == 0) alpha_s[r] = al;
      }
      BARRIER();  // scores are read out of kv; pm and alpha_s are complete
      for (int i = tid; i < BN * D; i += NT) {
        const int cc = i / D;
        const int d = i - cc * D;
        kv[cc * D + d] = static_cast<float>(v_cache[((long)tok_row[cc] * HKV + kvh) * D + d]);
      }
      BARRIER();
      UNROLL for (int i = 0; i < OR; ++i) {
        const float a = alpha_s[ro + i];
        UNROLL for (int j = 0; j < OD; ++j) acc[i][j] *= a;
      }
      for (int cc = 0; cc < BN; ++cc) {
        float vv[OD];
        UNROLL for (int j = 0; j < OD; ++j) vv[j] = kv[cc * D + dl + j * DL];
        UNROLL for (int i = 0; i < OR; ++i) {
          const float p = pm[(ro + i) * PST + cc];
          UNROLL for (int j = 0; j < OD; ++j) acc[i][j] += p * vv[j];
        }
      }
    }
    BARRIER();
    if (c == 0) {
      UNROLL for (int i = 0; i < SR; ++i) l_s[r0 + i] = lrow[i];
    }
    BARRIER();
    UNROLL for (int i = 0; i < OR; ++i) {
      const int r = ro + i;
      if (r < nrows) {
        const float inv = l_s[r] > 0.0f ? 1.0f / l_s[r] : 0.0f;
        const long orow = ((qrow0 + r / G) * H + kvh * G + r % G) * D;
        UNROLL for (int j = 0; j < OD; ++j) out[orow + dl + j * DL] = static_cast<T>(acc[i][j] * inv);
      }
    }
  }
"""

# Inputs: full [T,H,D] (the attention pass output), part_o, part_ml, cu_seqlens_q, seq_lens, iparams.
# Output: out [T,H,D]. Template: T, D, H. Grid [T, H]: one thread group per (token, head)
# merges a split decode row or copies the row as it is.
REDUCE_BODY = r"""
  constexpr int NT = 128;
  const int B = iparams[0];
  const int P = iparams[2];
  const int PS = iparams[3];
  const int t = gx;
  const int h = gy;
  int b = 0;
  {
    int n = B;
    while (n > 1) {
      const int hn = n >> 1;
      const int mid = b + hn;
      if (cu_seqlens_q[mid] <= t) b = mid;
      n -= hn;
    }
  }
  const int qlen = cu_seqlens_q[b + 1] - cu_seqlens_q[b];
  const int np = (seq_lens[b] + PS - 1) / PS;
  const long row = ((long)t * H + h) * D;
  if (qlen == 1 && np > 1) {
    const long base = ((long)b * H + h) * P;
    float mx_ = NEG_BIG;
    for (int p = 0; p < np; ++p) mx_ = FMAX(mx_, part_ml[(base + p) * 2]);
    float lsum = 0.0f;
    for (int p = 0; p < np; ++p) lsum += part_ml[(base + p) * 2 + 1] * EXP2(part_ml[(base + p) * 2] - mx_);
    const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f;
    for (int d = tid; d < D; d += NT) {
      float o = 0.0f;
      for (int p = 0; p < np; ++p) o += part_o[(base + p) * D + d] * EXP2(part_ml[(base + p) * 2] - mx_);
      out[row + d] = static_cast<T>(o * inv);
    }
  } else {
    for (int d = tid; d < D; d += NT) out[row + d] = full[row + d];
  }
"""

# The context of every long chunk of a step, in one launch, for fused SDPA.
# Inputs: k_cache/v_cache [NB,BS,HKV,D]; block_tables [B,MAXB]; work [2 * groups]: (request, logical
# block) per thread group; dst [2 * B]: (first output row, context length L) per request; iparams [MAXB].
# Outputs: k_ctx/v_ctx [rows, D]: request c's first L positions land head-major at rows
# dst[c] + h * L + t, so a run of equal chunks is one contiguous [n, HKV, L, D] region, the layout
# fused SDPA reads fastest (token-major K/V cost it 2-20 % on the H200).
# Template: T, D, HKV, BS, W (elements per 16 bytes). Each group copies one physical block, which is
# contiguous in the cache: reads are whole blocks, writes BS-row runs per head.
GATHER_BODY = r"""
  constexpr int NT = 128;
  constexpr int VPR = D / W;          // 16-byte vectors per row of one head
  constexpr int PB = BS * HKV * VPR;  // 16-byte vectors in one physical block
  const int c = work[2 * gx];
  const int j = work[2 * gx + 1];
  const long base = dst[3 * c];
  const int S = dst[3 * c + 1];       // rows per head (the context padded)
  const int L = dst[3 * c + 2];       // rows written: the context itself
  const long src0 = (long)block_tables[c * iparams[0] + j] * PB;
  for (int r = tid; r < PB; r += NT) {
    const int t = j * BS + r / (HKV * VPR);
    if (t >= L) break;
    const long o = (base + (long)((r / VPR) % HKV) * S + t) * VPR + r % VPR;
    COPY16(k_ctx + o * W, k_cache + (src0 + r) * W);
    COPY16(v_ctx + o * W, v_cache + (src0 + r) * W);
  }
"""

MAIN_INPUTS = ["q", "k_cache", "v_cache", "cu_seqlens_q", "seq_lens", "block_tables", "iparams", "fparams"]
MAIN_OUTPUTS = ["out", "part_o", "part_ml"]
REDUCE_INPUTS = ["full", "part_o", "part_ml", "cu_seqlens_q", "seq_lens", "iparams"]
REDUCE_OUTPUTS = ["out"]
GATHER_INPUTS = ["k_cache", "v_cache", "block_tables", "work", "dst", "iparams"]
GATHER_OUTPUTS = ["k_ctx", "v_ctx"]

DIALECTS = ("metal", "cuda")
_PRELUDES = {
    "metal": (METAL_HEADER, METAL_PROLOGUE, METAL_SHARED),
    "cuda": (CUDA_HEADER, CUDA_PROLOGUE, CUDA_SHARED),
}


def render_main(dialect: str, min_groups: int = 0) -> tuple[str, str]:
    """(header, source) of the attention pass for ``dialect`` ("metal" or "cuda").

    ``min_groups > 0`` (CUDA) asks the compiler to fit that many 128-thread groups on a
    multiprocessor (``__launch_bounds__``); mx.fast.cuda_kernel writes the kernel's signature
    itself, so the bound rides on the ``__global__`` macro the header redefines.
    """
    header, prologue, shared = _PRELUDES[dialect]
    if dialect == "cuda" and min_groups > 0:
        header = header + (f"#undef __global__\n#define __global__ __location__(global) "
                           f"__launch_bounds__({NUM_THREADS}, {min_groups})\n")
    return header + COMMON, prologue + shared + MAIN_BODY


def render_reduce(dialect: str) -> tuple[str, str]:
    """(header, source) of the split-KV merge pass; it needs no shared memory."""
    header, prologue, _ = _PRELUDES[dialect]
    return header + COMMON, prologue + REDUCE_BODY


def render_gather(dialect: str) -> tuple[str, str]:
    """(header, source) of the paged -> contiguous context copy that feeds dense attention."""
    header, prologue, _ = _PRELUDES[dialect]
    return header + COMMON, prologue + GATHER_BODY
