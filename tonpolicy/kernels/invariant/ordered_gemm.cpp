// Contract v2's GEMM ("owned order"): every output element is an fp32 FMA chain in the order written
// here, so its bits depend on IEEE arithmetic alone (not on batch, row position, tile, threads or CPU).
// See tonpolicy/kernels/invariant/ordered_gemm.py for the definition; this file implements it, with no torch headers.
//
// One source, one shared library per instruction-set path, selected by a macro:
//   ORDERED_ISA_AVX512BF16  the pair chain on vdpbf16ps, the fp32 chain on vfmadd231ps (16 lanes)
//   ORDERED_ISA_AVX512      AVX-512F: the pair chain as two FMAs, odd element first (16 lanes)
//   ORDERED_ISA_AVX2        AVX2 + FMA: the same emulation on 8 lanes (a 16-lane panel is two vectors)
//   ORDERED_ISA_PORTABLE    tests only: the AVX-512 paths' 16-lane blocking on plain C++ lanes, each FMA
//                           the scalar reference's (hand flushed); runs on any x86-64. With
//                           ORDERED_PORTABLE_DP the pair chain takes the avx512bf16 path's code (A packed
//                           in pairs, one pair step per lane as vdpbf16ps's definition reads)
// Every path also exports the scalar reference (ordered_reference, ordered_bmm_reference): plain loops,
// std::fma with the flushes done by hand, MXCSR at its IEEE default while it runs.
//
// Vectorised across output columns only: each lane is one output column, each accumulator register one
// independent chain over k, ascending, never split (a K-block's accumulators go through the fp32 output
// and come back unchanged). The vector paths run with MXCSR = FTZ|DAZ (set in every OpenMP thread), which
// flushes the emulated pair chain as vdpbf16ps does always.
#include <xmmintrin.h>
#if defined(ORDERED_ISA_AVX2) || defined(ORDERED_ISA_AVX512) || defined(ORDERED_ISA_AVX512BF16)
#include <immintrin.h>
#endif
#include <omp.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// Full unrolling of the loops over rows and vectors, so the accumulator arrays live in registers (not for
// the portable build's array lanes: a build of minutes).
#if defined(ORDERED_ISA_PORTABLE)
#define UNROLL
#else
#define UNROLL _Pragma("GCC unroll 32")
#endif

namespace {

constexpr int PANEL = 16;             // lanes of a packed weight panel (every path)
constexpr unsigned MXCSR_FTZ_DAZ = 0x9FC0;  // all exceptions masked, round to nearest even, FTZ, DAZ
constexpr unsigned MXCSR_IEEE = 0x1F80;     // all exceptions masked, round to nearest even, no flushing

struct Mxcsr {  // set for the scope, the caller's restored after
  unsigned old;
  explicit Mxcsr(unsigned mode) : old(_mm_getcsr()) { _mm_setcsr(mode); }
  ~Mxcsr() { _mm_setcsr(old); }
};

inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float bf16_to_f32(uint16_t h) { return bits_to_f32((uint32_t)h << 16); }

// ---------------------------------------------------------------------------------------------------
// The scalar definition of one FMA step: DAZ on the inputs, FTZ on the result, round to nearest even.
// FTZ as x86 applies it: a result is flushed when it is tiny after rounding to fp32's precision with an
// unbounded exponent (measured on vfmadd231ps: an exact value in (2^-126 - 2^-150, 2^-126 - 2^-151)
// flushes, though gradual underflow would round it up to 2^-126).
inline float daz(float x) { return std::fabs(x) < FLT_MIN ? std::copysign(0.0f, x) : x; }

// |r| == 2^-126 (r = fma(a, b, c) under gradual underflow): not tiny iff the exact a*b + c rounds (24 bits,
// unbounded exponent) to 2^-126, i.e. |exact| >= 2^-126 - 2^-151 (that midpoint rounds to the even 2^-126).
// a*b is exact in fp64, and s + e (TwoSum) is the exact sum.
__attribute__((noinline)) float ref_edge(float a, float b, float c, float r) {
  const double p = (double)a * (double)b;
  double s = p + (double)c;
  const double bb = s - p;
  double e = (p - (s - bb)) + ((double)c - bb);
  if (s < 0) {
    s = -s;
    e = -e;
  }
  const double edge = (double)FLT_MIN - 0x1p-151;
  return (s > edge || (s == edge && e >= 0)) ? r : std::copysign(0.0f, r);
}

inline float ref_fma(float a, float b, float c) {
  a = daz(a);
  b = daz(b);
  c = daz(c);
  const float r = std::fma(a, b, c);  // IEEE, gradual underflow (MXCSR_IEEE while this runs)
  const float ar = std::fabs(r);
  if (!(ar <= FLT_MIN)) return r;  // normal above the edge, inf or NaN
  if (ar < FLT_MIN) return std::copysign(0.0f, r);
  return ref_edge(a, b, c, r);
}

template <class TX>
inline float to_f32(TX v);
template <>
inline float to_f32<float>(float v) {
  return v;
}
template <>
inline float to_f32<uint16_t>(uint16_t v) {
  return bf16_to_f32(v);
}

// ---------------------------------------------------------------------------------------------------
// Vector traits: W lanes; load/store (unaligned), broadcast, fma(a, b, c) = a*b + c, and split: W lanes
// of bf16 pairs (2W uint16, element 2i in the low half) as the even and the odd elements in fp32.
#if defined(ORDERED_ISA_AVX2)
struct Vec {
  typedef __m256 v;
  static constexpr int W = 8;
  static v zero() { return _mm256_setzero_ps(); }
  static v load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, v x) { _mm256_storeu_ps(p, x); }
  static v bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static v set1(float f) { return _mm256_set1_ps(f); }
  static v fma(v a, v b, v c) { return _mm256_fmadd_ps(a, b, c); }
  static void split(const uint16_t* p, v& even, v& odd) {
    const __m256i x = _mm256_loadu_si256((const __m256i*)p);
    even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)));
  }
  static v load_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128((const __m128i*)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};
constexpr unsigned MXCSR_RUN = MXCSR_FTZ_DAZ;
#elif defined(ORDERED_ISA_AVX512) || defined(ORDERED_ISA_AVX512BF16)
struct Vec {
  typedef __m512 v;
  static constexpr int W = 16;
  static v zero() { return _mm512_setzero_ps(); }
  static v load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, v x) { _mm512_storeu_ps(p, x); }
  static v bcast(const float* p) { return _mm512_set1_ps(*p); }
  static v set1(float f) { return _mm512_set1_ps(f); }
  static v fma(v a, v b, v c) { return _mm512_fmadd_ps(a, b, c); }
  static void split(const uint16_t* p, v& even, v& odd) {
    const __m512i x = _mm512_loadu_si512((const void*)p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
  }
  static v load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256((const __m256i*)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
#if defined(ORDERED_ISA_AVX512BF16)
  // The pair chain's step on vdpbf16ps: W lanes of bf16 pairs (element 2i low), A's pair broadcast.
  typedef __m512i pairs;
  static pairs load_pairs(const uint16_t* p) { return _mm512_loadu_si512((const void*)p); }
  static pairs bcast_pair(uint32_t a) { return _mm512_set1_epi32((int)a); }
  static v dp(v acc, pairs w, pairs a) { return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)a); }
#endif
};
constexpr unsigned MXCSR_RUN = MXCSR_FTZ_DAZ;
#elif defined(ORDERED_ISA_PORTABLE)
struct Vec {
  struct v {
    float x[16];
  };
  static constexpr int W = 16;
  static v zero() { return set1(0.0f); }
  static v load(const float* p) {
    v r;
    std::memcpy(r.x, p, sizeof r.x);
    return r;
  }
  static void store(float* p, v x) { std::memcpy(p, x.x, sizeof x.x); }
  static v bcast(const float* p) { return set1(*p); }
  static v set1(float f) {
    v r;
    UNROLL
    for (int i = 0; i < W; i++) r.x[i] = f;
    return r;
  }
  __attribute__((noinline)) static v fma(v a, v b, v c) {  // out of line: a build of seconds, not minutes
    v r;
    for (int i = 0; i < W; i++) r.x[i] = ref_fma(a.x[i], b.x[i], c.x[i]);
    return r;
  }
  static void split(const uint16_t* p, v& even, v& odd) {
    UNROLL
    for (int i = 0; i < W; i++) {
      even.x[i] = bf16_to_f32(p[2 * i]);
      odd.x[i] = bf16_to_f32(p[2 * i + 1]);
    }
  }
  static v load_bf16(const uint16_t* p) {
    v r;
    UNROLL
    for (int i = 0; i < W; i++) r.x[i] = bf16_to_f32(p[i]);
    return r;
  }
#if defined(ORDERED_PORTABLE_DP)
  // vdpbf16ps as its definition reads (odd element first), so the native pair path's packing and
  // blocking run here too.
  struct pairs {
    uint32_t x[16];
  };
  static pairs load_pairs(const uint16_t* p) {
    pairs r;
    std::memcpy(r.x, p, sizeof r.x);
    return r;
  }
  static pairs bcast_pair(uint32_t a) {
    pairs r;
    for (int i = 0; i < W; i++) r.x[i] = a;
    return r;
  }
  __attribute__((noinline)) static v dp(v acc, pairs w, pairs a) {
    for (int i = 0; i < W; i++) {
      acc.x[i] = ref_fma(bf16_to_f32(a.x[i] >> 16), bf16_to_f32(w.x[i] >> 16), acc.x[i]);
      acc.x[i] = ref_fma(bf16_to_f32(a.x[i] & 0xFFFF), bf16_to_f32(w.x[i] & 0xFFFF), acc.x[i]);
    }
    return acc;
  }
#endif
};
constexpr unsigned MXCSR_RUN = MXCSR_IEEE;  // the hand-flushed reference FMA needs IEEE underneath
#else
#error "define one of ORDERED_ISA_AVX512BF16, ORDERED_ISA_AVX512, ORDERED_ISA_AVX2, ORDERED_ISA_PORTABLE"
#endif

typedef Vec::v V;
// Vector registers the micro-kernels may plan on.
#if defined(ORDERED_ISA_AVX2)
constexpr int VREGS = 16;
#elif defined(ORDERED_ISA_PORTABLE)
constexpr int VREGS = 1 << 20;
#else
constexpr int VREGS = 32;
#endif
// The compiler forgets what it knew of p (so loads through it are not merged with earlier ones).
template <class T>
inline void opaque(T*& p) {
  __asm__("" : "+r"(p));
}
constexpr int VW = Vec::W;
constexpr int VP = PANEL / VW;  // vectors per panel

// Register blocking: rows x panels of accumulators. Large M: RB_* rows (the packed A micro-panel) x NPB
// panels; M <= RB_*: M rows x small_panels(M) panels.
#if defined(ORDERED_ISA_AVX2)
constexpr int RB_F32 = 6;    // fp32 weights: 6 x 2 vectors = 12 chains (16 ymm registers)
constexpr int RB_PAIRS = 4;  // bf16 weights: 4 x 2 = 8 chains, with both halves of both vectors live
constexpr int NPB = 1;
constexpr int SMALL_F32 = 6, SMALL_PAIRS = 5;  // most rows of the small-M path (R x NV chains in registers)
constexpr int small_panels(int r) { return r == 1 ? 4 : r <= 3 ? 2 : 1; }
constexpr int small_panels_pairs(int r) { return r == 1 ? 4 : r == 2 ? 2 : 1; }
#else
constexpr int RB_F32 = 8;
constexpr int RB_PAIRS = 8;
constexpr int NPB = 2;  // 8 x 2 = 16 chains of 32 zmm registers
constexpr int SMALL_F32 = 8, SMALL_PAIRS = 8;
constexpr int small_panels(int r) { return r <= 2 ? 4 : r <= 4 ? 2 : r <= 6 ? 3 : 2; }
constexpr int small_panels_pairs(int r) { return small_panels(r); }
#endif
// K-blocks of the large-M path, in steps (k for fp32, pairs for bf16 weights): the weight's slice of a
// panel (16 KiB) stays in L1 while every row micro-panel of an M-block (A's slice, <= ~200 KiB) streams.
#ifndef ORDERED_KC_F32  // (tuning knobs: nothing about the bits depends on them)
#define ORDERED_KC_F32 256
#endif
#ifndef ORDERED_KC_PAIR
#define ORDERED_KC_PAIR 256
#endif
#ifndef ORDERED_MC_BLOCKS
#define ORDERED_MC_BLOCKS 24
#endif
constexpr int64_t KC_F32 = ORDERED_KC_F32;
constexpr int64_t KC_PAIR = ORDERED_KC_PAIR;
constexpr int64_t MC_BLOCKS = ORDERED_MC_BLOCKS;  // micro-panels per M-block

enum Chain { F32W = 0, F32B = 1, PAIR = 2 };  // fp32 chain on fp32 / bf16 weights; the bf16 pair chain

// Accumulator tile in/out of C (fp32 [rows][ldc]); partial tiles (rows < R or columns < NV*W) through a
// stack buffer.
template <int R, int NV>
inline void tile_load(V (&acc)[R][NV], const float* c, int64_t ldc, int mrows, int ncols, bool from_c) {
  if (!from_c) {
    UNROLL
    for (int r = 0; r < R; r++)
      UNROLL
      for (int j = 0; j < NV; j++) acc[r][j] = Vec::zero();
    return;
  }
  if (mrows == R && ncols == NV * VW) {
    UNROLL
    for (int r = 0; r < R; r++)
      UNROLL
      for (int j = 0; j < NV; j++) acc[r][j] = Vec::load(c + r * ldc + j * VW);
    return;
  }
  alignas(64) float t[R][NV * VW];
  std::memset(t, 0, sizeof t);
  for (int r = 0; r < mrows; r++) std::memcpy(t[r], c + r * ldc, sizeof(float) * ncols);
  UNROLL
  for (int r = 0; r < R; r++)
    UNROLL
    for (int j = 0; j < NV; j++) acc[r][j] = Vec::load(t[r] + j * VW);
}

template <int R, int NV>
inline void tile_store(V (&acc)[R][NV], float* c, int64_t ldc, int mrows, int ncols) {
  if (mrows == R && ncols == NV * VW) {
    UNROLL
    for (int r = 0; r < R; r++)
      UNROLL
      for (int j = 0; j < NV; j++) Vec::store(c + r * ldc + j * VW, acc[r][j]);
    return;
  }
  alignas(64) float t[R][NV * VW];
  UNROLL
  for (int r = 0; r < R; r++)
    UNROLL
    for (int j = 0; j < NV; j++) Vec::store(t[r] + j * VW, acc[r][j]);
  for (int r = 0; r < mrows; r++) std::memcpy(c + r * ldc, t[r], sizeof(float) * ncols);
}

// ---------------------------------------------------------------------------------------------------
// Micro-kernels: R rows x NP panels over `steps` steps from a K-block's start.
// a: packed A micro-panel, fp32 [k][R] (or for the native pair chain uint32 pairs [pair][R]).
// w: the first panel at the block's start; panel p at w + p * ps (elements of the packed weight).

// fp32 chain, fp32 weight panels [K][16]. A packed [k][R], or (lda > 0) fp32 rows lda apart read in place
// (rows past mrows read row 0 and are not stored).
template <int R, int NP>
void mk_f32w(const float* a, int64_t lda, const float* w, int64_t ps, int64_t steps, float* c, int64_t ldc,
             int mrows, int ncols, bool from_c) {
  constexpr int NV = NP * VP;
  V acc[R][NV];
  tile_load<R, NV>(acc, c, ldc, mrows, ncols, from_c);
  if (lda > 0) {
    const float* rows[R];
    UNROLL
    for (int r = 0; r < R; r++) rows[r] = a + (r < mrows ? r : 0) * lda;
    for (int64_t k = 0; k < steps; k++) {
      V wv[NV];
      UNROLL
      for (int p = 0; p < NP; p++)
        UNROLL
        for (int h = 0; h < VP; h++) wv[p * VP + h] = Vec::load(w + p * ps + k * PANEL + h * VW);
      UNROLL
      for (int r = 0; r < R; r++) {
        const V av = Vec::bcast(rows[r] + k);
        UNROLL
        for (int j = 0; j < NV; j++) acc[r][j] = Vec::fma(av, wv[j], acc[r][j]);
      }
    }
    tile_store<R, NV>(acc, c, ldc, mrows, ncols);
    return;
  }
  for (int64_t k = 0; k < steps; k++) {
    V wv[NV];
    UNROLL
    for (int p = 0; p < NP; p++)
      UNROLL
      for (int h = 0; h < VP; h++) wv[p * VP + h] = Vec::load(w + p * ps + k * PANEL + h * VW);
    UNROLL
    for (int r = 0; r < R; r++) {
      const V av = Vec::bcast(a + k * R + r);
      UNROLL
      for (int j = 0; j < NV; j++) acc[r][j] = Vec::fma(av, wv[j], acc[r][j]);
    }
  }
  tile_store<R, NV>(acc, c, ldc, mrows, ncols);
}

// bf16 weight panels of pairs [K/2][16][2], fp32 A [k][R] (k padded to even). ODD_FIRST: the pair chain
// (odd element, then even); otherwise the fp32 chain (even, then odd; `half_last`: the block's last pair
// holds one element, the even one, and its odd step is not taken).
template <int R, int NP, bool ODD_FIRST>
void mk_pairs(const float* a, const uint16_t* w, int64_t ps, int64_t steps, float* c, int64_t ldc, int mrows,
              int ncols, bool from_c, bool half_last) {
  constexpr int NV = NP * VP;
  // Row-major (each row's two broadcasts feed every vector; all vectors' halves live) when the registers
  // allow, else vector by vector with the broadcasts loaded again per vector (an opaque pointer keeps the
  // compiler from hoisting them into registers it does not have).
  constexpr bool ROW_MAJOR = R * NV + 2 * NV + 2 <= VREGS;
  V acc[R][NV];
  tile_load<R, NV>(acc, c, ldc, mrows, ncols, from_c);
  const int64_t full = (!ODD_FIRST && half_last) ? steps - 1 : steps;
  for (int64_t i = 0; i < full; i++) {
    const float* ae = a + 2 * i * R;
    if (ROW_MAJOR) {
      V we[NV], wo[NV];
      UNROLL
      for (int j = 0; j < NV; j++) Vec::split(w + (j / VP) * ps + i * 2 * PANEL + (j % VP) * 2 * VW, we[j], wo[j]);
      UNROLL
      for (int r = 0; r < R; r++) {
        const V be = Vec::bcast(ae + r), bo = Vec::bcast(ae + R + r);
        UNROLL
        for (int j = 0; j < NV; j++) acc[r][j] = Vec::fma(ODD_FIRST ? bo : be, ODD_FIRST ? wo[j] : we[j], acc[r][j]);
        UNROLL
        for (int j = 0; j < NV; j++) acc[r][j] = Vec::fma(ODD_FIRST ? be : bo, ODD_FIRST ? we[j] : wo[j], acc[r][j]);
      }
    } else {
      UNROLL
      for (int j = 0; j < NV; j++) {
        const float* ap = ae;
        opaque(ap);
        V we, wo;
        Vec::split(w + (j / VP) * ps + i * 2 * PANEL + (j % VP) * 2 * VW, we, wo);
        UNROLL
        for (int r = 0; r < R; r++) {
          V& s = acc[r][j];
          if (ODD_FIRST) {
            s = Vec::fma(Vec::bcast(ap + R + r), wo, s);
            s = Vec::fma(Vec::bcast(ap + r), we, s);
          } else {
            s = Vec::fma(Vec::bcast(ap + r), we, s);
            s = Vec::fma(Vec::bcast(ap + R + r), wo, s);
          }
        }
      }
    }
  }
  if (full < steps) {  // the even element alone
    const float* ae = a + 2 * full * R;
    UNROLL
    for (int j = 0; j < NV; j++) {
      V we, wo;
      Vec::split(w + (j / VP) * ps + full * 2 * PANEL + (j % VP) * 2 * VW, we, wo);
      UNROLL
      for (int r = 0; r < R; r++) acc[r][j] = Vec::fma(Vec::bcast(ae + r), we, acc[r][j]);
    }
  }
  tile_store<R, NV>(acc, c, ldc, mrows, ncols);
}

#if defined(ORDERED_ISA_AVX512BF16) || defined(ORDERED_PORTABLE_DP)
// The pair chain on the pair instruction: A as bf16 pairs (uint32, element 2i low) [pair][R].
template <int R, int NP>
void mk_dp(const uint32_t* a, const uint16_t* w, int64_t ps, int64_t steps, float* c, int64_t ldc, int mrows,
           int ncols, bool from_c) {
  V acc[R][NP];
  tile_load<R, NP>(acc, c, ldc, mrows, ncols, from_c);
  for (int64_t i = 0; i < steps; i++) {
    Vec::pairs wv[NP];
    UNROLL
    for (int p = 0; p < NP; p++) wv[p] = Vec::load_pairs(w + p * ps + i * 2 * PANEL);
    UNROLL
    for (int r = 0; r < R; r++) {
      const Vec::pairs av = Vec::bcast_pair(a[i * R + r]);
      UNROLL
      for (int p = 0; p < NP; p++) acc[r][p] = Vec::dp(acc[r][p], wv[p], av);
    }
  }
  tile_store<R, NP>(acc, c, ldc, mrows, ncols);
}
constexpr bool NATIVE_PAIRS = true;
#else
constexpr bool NATIVE_PAIRS = false;
#endif

// One call's geometry (see ordered_linear).
struct Gemm {
  int chain;
  bool native, w_bf16;
  bool small;   // the few-rows path (one micro-panel of all rows)
  bool direct;  // fp32 x on fp32 weights: A read in place, not packed
  int R;       // rows of a micro-panel
  int64_t m, n, k, shards, ks, kp, np, steps_all, wstep, shard_stride, ps, nblk, ablk;
  const void* x;
  int x_bf16;
  int64_t lda;
  const void* wpack;
  uint32_t* apack;
  float* out;
};

// Row micro-panels [b0, b1) of shard c against panels [panel, panel + NP), steps [s0, s0 + steps) of
// the shard's chain (from C when s0 > 0).
template <int R, int NP>
void rows_of_panels(const Gemm& g, int64_t c, int64_t panel, int64_t b0, int64_t b1, int64_t s0, int64_t steps) {
  const int ncols = (int)std::min<int64_t>(NP * PANEL, g.n - panel * PANEL);
  const int64_t w_off = c * g.shard_stride + panel * g.ps + s0 * g.wstep;
  const bool from_c = s0 > 0;
  const bool half_last = g.chain == F32B && (g.ks & 1) && s0 + steps == g.steps_all;
  const int64_t a_off = g.native ? s0 * R : s0 * (g.w_bf16 ? 2 : 1) * R;  // 32-bit words
  for (int64_t b = b0; b < b1; b++) {
    const uint32_t* a = g.apack + (c * g.nblk + b) * g.ablk + a_off;
    float* cp = g.out + (c * g.m + b * R) * g.n + panel * PANEL;
    const int mrows = (int)std::min<int64_t>(R, g.m - b * R);
    if (g.chain == F32W) {
      const float* wp = (const float*)g.wpack + w_off;
      if (g.direct)
        mk_f32w<R, NP>((const float*)g.x + b * R * g.lda + c * g.ks + s0, g.lda, wp, g.ps, steps, cp, g.n, mrows,
                       ncols, from_c);
      else
        mk_f32w<R, NP>((const float*)a, 0, wp, g.ps, steps, cp, g.n, mrows, ncols, from_c);
    } else if (g.chain == F32B) {
      mk_pairs<R, NP, false>((const float*)a, (const uint16_t*)g.wpack + w_off, g.ps, steps, cp, g.n, mrows, ncols,
                             from_c, half_last);
    } else {
#if defined(ORDERED_ISA_AVX512BF16) || defined(ORDERED_PORTABLE_DP)
      mk_dp<R, NP>(a, (const uint16_t*)g.wpack + w_off, g.ps, steps, cp, g.n, mrows, ncols, from_c);
#else
      mk_pairs<R, NP, true>((const float*)a, (const uint16_t*)g.wpack + w_off, g.ps, steps, cp, g.n, mrows, ncols,
                            from_c, false);
#endif
    }
  }
}

typedef void (*RowsFn)(const Gemm&, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t);

// The small-M path's functions for R rows: `panels` of them (small_panels or small_panels_pairs of R) or one.
template <int R>
RowsFn rows_fn(int panels) {
  switch (panels) {
    case 1: return &rows_of_panels<R, 1>;
    case 2: return &rows_of_panels<R, 2>;
    case 3: return &rows_of_panels<R, 3>;
    default: return &rows_of_panels<R, 4>;
  }
}
RowsFn small_rows_fn(int r, int panels) {
  switch (r) {
    case 1: return rows_fn<1>(panels);
    case 2: return rows_fn<2>(panels);
    case 3: return rows_fn<3>(panels);
    case 4: return rows_fn<4>(panels);
    case 5: return rows_fn<5>(panels);
    case 6: return rows_fn<6>(panels);
#if !defined(ORDERED_ISA_AVX2)
    case 7: return rows_fn<7>(panels);
    case 8: return rows_fn<8>(panels);
#endif
    default: return nullptr;
  }
}

// ---------------------------------------------------------------------------------------------------
// A packing: shard c, rows [r0, r0 + R) (rows >= m are zeros), k in [c*ks, c*ks + kp) (k >= ks zeros):
// fp32 [kp][R], or uint32 pairs [kp/2][R] for the native pair chain.
template <class TX, int R>
void pack_a_f32(const TX* x, int64_t lda, int64_t m, int64_t r0, int64_t k0, int64_t ks, int64_t kp, float* dst) {
  const TX* src[R];
  int live = 0;
  for (int r = 0; r < R; r++) {
    if (r0 + r < m) live = r + 1;
    src[r] = x + (r0 + r < m ? r0 + r : r0) * lda + k0;
  }
  if (live == R) {
    for (int64_t k = 0; k < ks; k++) {
      UNROLL
      for (int r = 0; r < R; r++) dst[k * R + r] = to_f32<TX>(src[r][k]);
    }
  } else {
    for (int64_t k = 0; k < ks; k++)
      for (int r = 0; r < R; r++) dst[k * R + r] = r < live ? to_f32<TX>(src[r][k]) : 0.0f;
  }
  for (int64_t k = ks; k < kp; k++)
    for (int r = 0; r < R; r++) dst[k * R + r] = 0.0f;
}

void pack_a_pairs(const uint16_t* x, int64_t lda, int64_t m, int64_t r0, int R, int64_t k0, int64_t ks, int64_t kp,
                  uint32_t* dst) {
  const int64_t np = kp / 2;
  for (int r = 0; r < R; r++) {
    const int64_t row = r0 + r;
    const uint16_t* src = x + row * lda + k0;
    for (int64_t i = 0; i < np; i++) {
      uint32_t lo = 0, hi = 0;
      if (row < m) {
        if (2 * i < ks) lo = src[2 * i];
        if (2 * i + 1 < ks) hi = src[2 * i + 1];
      }
      dst[i * R + r] = lo | (hi << 16);
    }
  }
}

template <class TX>
void pack_f32_rows(const Gemm& g, int64_t r0, int64_t k0, float* dst) {
  const TX* x = (const TX*)g.x;
  switch (g.R) {
    case 1: return pack_a_f32<TX, 1>(x, g.lda, g.m, r0, k0, g.ks, g.kp, dst);
    case 2: return pack_a_f32<TX, 2>(x, g.lda, g.m, r0, k0, g.ks, g.kp, dst);
    case 3: return pack_a_f32<TX, 3>(x, g.lda, g.m, r0, k0, g.ks, g.kp, dst);
    case 4: return pack_a_f32<TX, 4>(x, g.lda, g.m, r0, k0, g.ks, g.kp, dst);
    case 5: return pack_a_f32<TX, 5>(x, g.lda, g.m, r0, k0, g.ks, g.kp, dst);
    case 6: return pack_a_f32<TX, 6>(x, g.lda, g.m, r0, k0, g.ks, g.kp, dst);
    case 7: return pack_a_f32<TX, 7>(x, g.lda, g.m, r0, k0, g.ks, g.kp, dst);
    default: return pack_a_f32<TX, 8>(x, g.lda, g.m, r0, k0, g.ks, g.kp, dst);
  }
}

void pack_item(const Gemm& g, int64_t item) {  // item = shard * nblk + micro-panel
  const int64_t c = item / g.nblk, b = item % g.nblk;
  uint32_t* dst = g.apack + item * g.ablk;
  if (g.native)
    pack_a_pairs((const uint16_t*)g.x, g.lda, g.m, b * g.R, g.R, c * g.ks, g.ks, g.kp, dst);
  else if (g.x_bf16)
    pack_f32_rows<uint16_t>(g, b * g.R, c * g.ks, (float*)dst);
  else
    pack_f32_rows<float>(g, b * g.R, c * g.ks, (float*)dst);
}

// Packed A, reused across calls of the calling thread; one of more than KEEP_WORDS (a long prefill's) is
// freed after its call.
thread_local std::vector<uint32_t> a_scratch;
constexpr size_t KEEP_WORDS = size_t(1) << 22;

// One thread's share (tid of nth): pack its part of A, wait for every part, compute its part of C.
void gemm_body(const Gemm& g, int tid, int nth) {
  Mxcsr guard(MXCSR_RUN);
  const int64_t items = g.direct ? 0 : g.shards * g.nblk;
  for (int64_t it = items * tid / nth; it < items * (tid + 1) / nth; it++) pack_item(g, it);
  if (!g.direct) {
#pragma omp barrier
  }
  if (g.small) {
    // Few rows: one micro-panel, the whole shard's K in registers, the weight read once.
    const int nps = g.chain == F32W ? small_panels(g.R) : small_panels_pairs(g.R);
    const int64_t groups = (g.np + nps - 1) / nps;
    const RowsFn full = small_rows_fn(g.R, nps), one = small_rows_fn(g.R, 1);
    const int64_t all = g.shards * groups;
    for (int64_t it = all * tid / nth; it < all * (tid + 1) / nth; it++) {
      const int64_t c = it / groups, p0 = (it % groups) * nps;
      if (p0 + nps <= g.np)
        full(g, c, p0, 0, 1, 0, g.steps_all);
      else
        for (int64_t p = p0; p < g.np; p++) one(g, c, p, 0, 1, 0, g.steps_all);
    }
    return;
  }
  // Large M: each thread a rectangle of micro-panels x panel groups; K-blocks ascending (the chains go on
  // through C), M-blocks, panel groups, micro-panels (the weight's K-block slice of a group stays in L1
  // while the M-block's A streams from L2).
  const int64_t groups = (g.np + NPB - 1) / NPB;
  const int tp = (int)std::min<int64_t>(nth, groups);
  const int tr = nth / tp;
  const int my_p = tid % tp, my_r = tid / tp;
  if (my_r >= tr) return;
  const int64_t g0 = groups * my_p / tp, g1 = groups * (my_p + 1) / tp;
  const int64_t b0 = g.nblk * my_r / tr, b1 = g.nblk * (my_r + 1) / tr;
  const int64_t kc = g.w_bf16 ? KC_PAIR : KC_F32;
  const int64_t mcb = MC_BLOCKS;
  const RowsFn big = small_rows_fn(g.R, NPB), one = small_rows_fn(g.R, 1);
  for (int64_t c = 0; c < g.shards; c++)
    for (int64_t s0 = 0; s0 == 0 || s0 < g.steps_all; s0 += kc) {
      const int64_t steps = std::min(kc, g.steps_all - s0);
      for (int64_t bb = b0; bb < b1; bb += mcb) {
        const int64_t be = std::min(b1, bb + mcb);
        for (int64_t gi = g0; gi < g1; gi++) {
          const int64_t p0 = gi * NPB;
          if (p0 + NPB <= g.np)
            big(g, c, p0, bb, be, s0, steps);
          else
            for (int64_t p = p0; p < g.np; p++) one(g, c, p, bb, be, s0, steps);
        }
      }
    }
}

}  // namespace

extern "C" {

int ordered_isa() {
#if defined(ORDERED_ISA_AVX512BF16)
  return 3;
#elif defined(ORDERED_ISA_AVX512)
  return 2;
#elif defined(ORDERED_ISA_AVX2)
  return 1;
#else
  return 0;
#endif
}

// out [shards][m][n] fp32 = the chains of x [m][k] (row stride lda; bf16 if x_bf16 else fp32) against the
// packed weight of w [n][k]:
//   fp32 weight: float [np][k][16] (np = ceil(n/16), columns >= n zero); shard c = k in [c*ks, (c+1)*ks);
//   bf16 weight: uint16 [np][shards][kp/2][16][2] pairs (element 2i first), kp = ks rounded up to even,
//   each shard zero-padded (with ks even: [np][k/2][16][2] whatever the shard count).
// Chain: the pair chain if x and w are both bf16, else the fp32 chain. Returns 0, or 1 for the pair chain
// with an odd shard length and more than one shard, 2 for bad arguments.
int ordered_linear(const void* x, int x_bf16, int64_t m, int64_t k, int64_t lda, const void* wpack, int w_bf16,
                   int64_t n, int64_t shards, float* out, int threads) {
  if (m < 0 || k < 0 || n < 0 || shards < 1 || k % shards || (m > 1 && lda < k)) return 2;
  Gemm g;
  g.ks = k / shards;
  g.chain = (x_bf16 && w_bf16) ? PAIR : (w_bf16 ? F32B : F32W);
  if (g.chain == PAIR && shards > 1 && g.ks % 2) return 1;
  if (m == 0 || n == 0) return 0;
  g.m = m, g.n = n, g.k = k, g.shards = shards, g.x = x, g.x_bf16 = x_bf16, g.lda = lda, g.wpack = wpack;
  g.out = out, g.w_bf16 = w_bf16 != 0;
  g.kp = w_bf16 ? g.ks + (g.ks & 1) : g.ks;  // A's packed k per shard
  g.np = (n + PANEL - 1) / PANEL;
  g.native = NATIVE_PAIRS && g.chain == PAIR;
  g.direct = g.chain == F32W && !x_bf16;
  g.wstep = w_bf16 ? 2 * PANEL : PANEL;            // weight elements per step (pair or k)
  g.steps_all = w_bf16 ? g.kp / 2 : g.ks;          // steps per shard
  g.shard_stride = g.steps_all * g.wstep;          // a shard's run within a panel
  g.ps = shards * g.shard_stride;                  // panel stride
  g.small = m <= (g.chain == F32W ? SMALL_F32 : SMALL_PAIRS);
  const int64_t rb = g.chain == F32W ? RB_F32 : RB_PAIRS;
  g.R = g.small ? (int)m : (int)((m + (m + rb - 1) / rb - 1) / ((m + rb - 1) / rb));  // rows spread evenly
  g.nblk = (m + g.R - 1) / g.R;
  g.ablk = g.kp * g.R;  // 32-bit words per packed micro-panel (native pairs use half)
  const size_t words = g.direct ? 0 : (size_t)(shards * g.nblk * g.ablk);
  if (a_scratch.size() < words) a_scratch.resize(words);
  g.apack = a_scratch.data();

  const double work = (double)m * (double)k * (double)n;
  const int nt = work < 65536.0 ? 1 : std::max(1, threads);  // a parallel region costs more than the product
  if (nt == 1) {
    gemm_body(g, 0, 1);
  } else {
#pragma omp parallel num_threads(nt)
    gemm_body(g, omp_get_thread_num(), omp_get_num_threads());
  }
  if (a_scratch.size() > KEEP_WORDS) std::vector<uint32_t>().swap(a_scratch);
  return 0;
}

// The same with the arguments in one array (one ctypes argument: a call costs ~0.5 us, not ~4):
// {x, x_bf16, m, k, lda, wpack, w_bf16, n, shards, out, threads}.
int ordered_linear_v(const int64_t* a) {
  return ordered_linear((const void*)a[0], (int)a[1], a[2], a[3], a[4], (const void*)a[5], (int)a[6], a[7], a[8],
                        (float*)a[9], (int)a[10]);
}

}  // extern "C"

namespace {

// ---------------------------------------------------------------------------------------------------
// Batched product for attention: out[b] = a[b] [m][k] @ bm[b] [k][n], the fp32 chain over k ascending,
// lanes over n. R rows x NV vectors of columns per micro-kernel (rows past m computed on row 0's data and
// not stored); with one row, G batch items at once (independent chains in flight).
template <class TB>
inline V load_b(const TB* p) {
  if constexpr (sizeof(TB) == 4)
    return Vec::load((const float*)p);
  else
    return Vec::load_bf16((const uint16_t*)p);
}
template <class TB, int NV>
inline void load_b_part(const TB* brow, int ncols, V (&bv)[NV]) {
  alignas(64) float t[NV * VW] = {};
  for (int i = 0; i < ncols; i++) t[i] = to_f32<TB>(brow[i]);
  UNROLL
  for (int j = 0; j < NV; j++) bv[j] = Vec::load(t + j * VW);
}

// G batch items (a row each: a[g] [k], b[g] [k][n] at gstride_a / gstride_b apart) x NV vectors.
template <class TA, class TB, int G, int NV, bool FULL>
void bmm_micro(const TA* a, int64_t k, const TB* b, int64_t n, float* c, int ncols, int64_t sa, int64_t sb,
               int64_t sc) {
  V acc[G][NV];
  UNROLL
  for (int g = 0; g < G; g++)
    UNROLL
    for (int j = 0; j < NV; j++) acc[g][j] = Vec::zero();
  for (int64_t kk = 0; kk < k; kk++) {
    UNROLL
    for (int g = 0; g < G; g++) {
      const TB* brow = b + g * sb + kk * n;
      V bv[NV];
      if (FULL) {
        UNROLL
        for (int j = 0; j < NV; j++) bv[j] = load_b<TB>(brow + j * VW);
      } else {
        load_b_part<TB, NV>(brow, ncols, bv);
      }
      const V av = Vec::set1(to_f32<TA>(a[g * sa + kk]));
      UNROLL
      for (int j = 0; j < NV; j++) acc[g][j] = Vec::fma(av, bv[j], acc[g][j]);
    }
  }
  UNROLL
  for (int g = 0; g < G; g++) {
    if (FULL) {
      UNROLL
      for (int j = 0; j < NV; j++) Vec::store(c + g * sc + j * VW, acc[g][j]);
    } else {
      alignas(64) float t[NV * VW];
      UNROLL
      for (int j = 0; j < NV; j++) Vec::store(t + j * VW, acc[g][j]);
      std::memcpy(c + g * sc, t, sizeof(float) * ncols);
    }
  }
}

template <class TA, class TB, int R, int NV, bool FULL>
void bmm_rows(const TA* a, int64_t k, const TB* b, int64_t n, float* c, int mrows, int ncols) {
  V acc[R][NV];
  UNROLL
  for (int r = 0; r < R; r++)
    UNROLL
    for (int j = 0; j < NV; j++) acc[r][j] = Vec::zero();
  const TA* rows[R];
  UNROLL
  for (int r = 0; r < R; r++) rows[r] = a + (r < mrows ? r : 0) * k;
  for (int64_t kk = 0; kk < k; kk++) {
    const TB* brow = b + kk * n;
    V bv[NV];
    if (FULL) {
      UNROLL
      for (int j = 0; j < NV; j++) bv[j] = load_b<TB>(brow + j * VW);
    } else {
      load_b_part<TB, NV>(brow, ncols, bv);
    }
    UNROLL
    for (int r = 0; r < R; r++) {
      const V av = Vec::set1(to_f32<TA>(rows[r][kk]));
      UNROLL
      for (int j = 0; j < NV; j++) acc[r][j] = Vec::fma(av, bv[j], acc[r][j]);
    }
  }
  tile_store<R, NV>(acc, c, n, mrows, ncols);
}

// Items [i0, i1) of the call's work: (batch item, row block) for m > 1, groups of G batch items for m == 1.
template <class TA, class TB, int R, int NV, int G>
void bmm_part(const TA* a, const TB* b, int64_t batch, int64_t m, int64_t k, int64_t n, float* out, int tid,
              int nth) {
  Mxcsr guard(MXCSR_RUN);
  const int64_t cw = NV * VW;
  const int64_t cblk = (n + cw - 1) / cw;
  if (m == 1) {
    const int64_t groups = (batch + G - 1) / G;
    for (int64_t it = groups * tid / nth; it < groups * (tid + 1) / nth; it++) {
      const int64_t b0 = it * G;
      for (int64_t cb = 0; cb < cblk; cb++) {
        const int ncols = (int)std::min<int64_t>(cw, n - cb * cw);
        const bool full = ncols == cw;
        const TA* ap = a + b0 * k;
        const TB* bp = b + b0 * k * n + cb * cw;
        float* cp = out + b0 * n + cb * cw;
        if (b0 + G <= batch) {
          if (full)
            bmm_micro<TA, TB, G, NV, true>(ap, k, bp, n, cp, ncols, k, k * n, n);
          else
            bmm_micro<TA, TB, G, NV, false>(ap, k, bp, n, cp, ncols, k, k * n, n);
        } else {
          for (int64_t bi = b0; bi < batch; bi++) {
            const TA* ap1 = a + bi * k;
            const TB* bp1 = b + bi * k * n + cb * cw;
            float* cp1 = out + bi * n + cb * cw;
            if (full)
              bmm_rows<TA, TB, 1, NV, true>(ap1, k, bp1, n, cp1, 1, ncols);
            else
              bmm_rows<TA, TB, 1, NV, false>(ap1, k, bp1, n, cp1, 1, ncols);
          }
        }
      }
    }
    return;
  }
  const int64_t rblk = (m + R - 1) / R;
  const int64_t items = batch * rblk;
  for (int64_t it = items * tid / nth; it < items * (tid + 1) / nth; it++) {
    const int64_t bi = it / rblk, rb = it % rblk;
    const int mrows = (int)std::min<int64_t>(R, m - rb * R);
    for (int64_t cb = 0; cb < cblk; cb++) {
      const int ncols = (int)std::min<int64_t>(cw, n - cb * cw);
      const TA* ap = a + (bi * m + rb * R) * k;
      const TB* bp = b + bi * k * n + cb * cw;
      float* cp = out + (bi * m + rb * R) * n + cb * cw;
      if (ncols == cw)
        bmm_rows<TA, TB, R, NV, true>(ap, k, bp, n, cp, mrows, ncols);
      else
        bmm_rows<TA, TB, R, NV, false>(ap, k, bp, n, cp, mrows, ncols);
    }
  }
}

template <class TA, class TB, int R, int NV, int G>
void bmm_all(const TA* a, const TB* b, int64_t batch, int64_t m, int64_t k, int64_t n, float* out, int nt) {
  if (nt == 1) return bmm_part<TA, TB, R, NV, G>(a, b, batch, m, k, n, out, 0, 1);
#pragma omp parallel num_threads(nt)
  bmm_part<TA, TB, R, NV, G>(a, b, batch, m, k, n, out, omp_get_thread_num(), omp_get_num_threads());
}

// Blocking: rows x vectors of accumulators within the registers (AVX2: 16, AVX-512: 32); one row: up to
// 8 vectors of one item, or G items x NV vectors.
template <class TA, class TB>
void bmm_dispatch(const TA* a, const TB* b, int64_t batch, int64_t m, int64_t k, int64_t n, float* out, int nt) {
  const int64_t vecs = (n + VW - 1) / VW;
  if (m == 1) {
    if (vecs >= 8) return bmm_all<TA, TB, 1, 8, 1>(a, b, batch, m, k, n, out, nt);
    if (vecs >= 4) return bmm_all<TA, TB, 1, 4, 2>(a, b, batch, m, k, n, out, nt);
    if (vecs >= 2) return bmm_all<TA, TB, 1, 2, 4>(a, b, batch, m, k, n, out, nt);
    return bmm_all<TA, TB, 1, 1, 8>(a, b, batch, m, k, n, out, nt);
  }
#if defined(ORDERED_ISA_AVX2)
  if (vecs >= 2) return bmm_all<TA, TB, 6, 2, 1>(a, b, batch, m, k, n, out, nt);  // 12 chains, 15 registers
  return bmm_all<TA, TB, 8, 1, 1>(a, b, batch, m, k, n, out, nt);
#else
  if (vecs >= 4) return bmm_all<TA, TB, 6, 4, 1>(a, b, batch, m, k, n, out, nt);  // 24 chains, 29 registers
  if (vecs >= 2) return bmm_all<TA, TB, 8, 2, 1>(a, b, batch, m, k, n, out, nt);
  return bmm_all<TA, TB, 8, 1, 1>(a, b, batch, m, k, n, out, nt);
#endif
}

}  // namespace

extern "C" {

// out [batch][m][n] fp32 = a [batch][m][k] @ b [batch][k][n] (both contiguous; bf16 if *_bf16), the fp32
// chain over k ascending. Returns 0, or 2 for bad arguments.
int ordered_bmm(const void* a, int a_bf16, const void* b, int b_bf16, int64_t batch, int64_t m, int64_t k, int64_t n,
                float* out, int threads) {
  if (batch < 0 || m < 0 || k < 0 || n < 0) return 2;
  if (batch == 0 || m == 0 || n == 0) return 0;
  const double work = (double)batch * (double)m * (double)k * (double)n;
  const int nt = (work < 32768.0 || batch * m < 2) ? 1 : std::max(1, threads);
  if (a_bf16 && b_bf16)
    bmm_dispatch((const uint16_t*)a, (const uint16_t*)b, batch, m, k, n, out, nt);
  else if (a_bf16)
    bmm_dispatch((const uint16_t*)a, (const float*)b, batch, m, k, n, out, nt);
  else if (b_bf16)
    bmm_dispatch((const float*)a, (const uint16_t*)b, batch, m, k, n, out, nt);
  else
    bmm_dispatch((const float*)a, (const float*)b, batch, m, k, n, out, nt);
  return 0;
}

// The same with the arguments in one array: {a, a_bf16, b, b_bf16, batch, m, k, n, out, threads}.
int ordered_bmm_v(const int64_t* v) {
  return ordered_bmm((const void*)v[0], (int)v[1], (const void*)v[2], (int)v[3], v[4], v[5], v[6], v[7], (float*)v[8],
                     (int)v[9]);
}

// ---------------------------------------------------------------------------------------------------
// The scalar reference (tests only): the definition's obvious code on the unpacked operands.
static float ref_load(const void* p, int bf16, int64_t i) {
  return bf16 ? bf16_to_f32(((const uint16_t*)p)[i]) : ((const float*)p)[i];
}

// out [shards][m][n] for x [m][k] (row stride lda) and w [n][k] (row-major), as ordered_linear.
int ordered_reference(const void* x, int x_bf16, int64_t m, int64_t k, int64_t lda, const void* w, int w_bf16,
                      int64_t n, int64_t shards, float* out) {
  if (m < 0 || k < 0 || n < 0 || shards < 1 || k % shards || lda < k) return 2;
  const int64_t ks = k / shards;
  const bool pair = x_bf16 && w_bf16;
  if (pair && shards > 1 && ks % 2) return 1;
  Mxcsr guard(MXCSR_IEEE);
  for (int64_t c = 0; c < shards; c++)
    for (int64_t i = 0; i < m; i++)
      for (int64_t j = 0; j < n; j++) {
        const int64_t k0 = c * ks;
        float acc = 0.0f;
        if (pair) {
          for (int64_t q = 0; q < (ks + 1) / 2; q++) {
            const int64_t e = k0 + 2 * q, o = e + 1;
            const float ao = o < k0 + ks ? ref_load(x, 1, i * lda + o) : 0.0f;  // the zero pad
            const float wo = o < k0 + ks ? ref_load(w, 1, j * k + o) : 0.0f;
            acc = ref_fma(ao, wo, acc);
            acc = ref_fma(ref_load(x, 1, i * lda + e), ref_load(w, 1, j * k + e), acc);
          }
        } else {
          for (int64_t q = k0; q < k0 + ks; q++)
            acc = ref_fma(ref_load(x, x_bf16, i * lda + q), ref_load(w, w_bf16, j * k + q), acc);
        }
        out[(c * m + i) * n + j] = acc;
      }
  return 0;
}

int ordered_bmm_reference(const void* a, int a_bf16, const void* b, int b_bf16, int64_t batch, int64_t m, int64_t k,
                          int64_t n, float* out) {
  if (batch < 0 || m < 0 || k < 0 || n < 0) return 2;
  Mxcsr guard(MXCSR_IEEE);
  for (int64_t bi = 0; bi < batch; bi++)
    for (int64_t i = 0; i < m; i++)
      for (int64_t j = 0; j < n; j++) {
        float acc = 0.0f;
        for (int64_t q = 0; q < k; q++)
          acc = ref_fma(ref_load(a, a_bf16, (bi * m + i) * k + q), ref_load(b, b_bf16, (bi * k + q) * n + j), acc);
        out[(bi * m + i) * n + j] = acc;
      }
  return 0;
}

}  // extern "C"
