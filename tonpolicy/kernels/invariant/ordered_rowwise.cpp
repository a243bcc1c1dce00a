// Contract v2's row-local ops ("owned order"): exp, log, sin/cos, row sum, row max, RMSNorm, SwiGLU,
// logprobs and RoPE tables, each defined by the arithmetic written here (fp32, every FMA explicit, fixed
// constants, a fixed 16-lane summation order), so their bits depend on IEEE 754 alone: not on the vector
// width, the CPU, the thread count, the row's position or the other rows. The definition is stated in
// tonpolicy/kernels/invariant/ordered_rowwise.py (and its describe()); this file implements it, with no torch headers.
//
// One source, one shared library per instruction-set path, selected by a macro:
//   ROWWISE_ISA_AVX512    AVX-512F/BW/VL/DQ: a 16-lane block is one zmm register
//   ROWWISE_ISA_AVX2      AVX2 + FMA: a 16-lane block is two ymm registers (lanes 0-7, 8-15)
//   ROWWISE_ISA_PORTABLE  tests only: GCC vector extensions (16 lanes) on baseline x86-64, std::fma per lane
// Every library also has the scalar reference of every op (plain loops over floats, std::fma, the same
// definition written a second time); rowwise_call(op, ref=1, ...) runs it.
//
// MXCSR is set to its IEEE default (round to nearest even, no FTZ, no DAZ, exceptions masked) for each call
// in every thread that computes, so a caller's flush-to-zero mode (torch.set_flush_denormal) changes nothing.
// Every NaN an op returns is the one pattern 0x7FC00000 (bf16: 0x7FC0).
#include <xmmintrin.h>
#if defined(ROWWISE_ISA_AVX2) || defined(ROWWISE_ISA_AVX512)
#include <immintrin.h>
#endif
#include <omp.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// The 16-lane helpers must inline: a 64-byte block passed to a call goes through memory.
#define INL inline __attribute__((always_inline))

namespace {

constexpr unsigned MXCSR_IEEE = 0x1F80;  // all exceptions masked, round to nearest even, no flushing

struct Mxcsr {  // set for the scope, the caller's restored after
  unsigned old;
  Mxcsr() : old(_mm_getcsr()) { _mm_setcsr(MXCSR_IEEE); }
  ~Mxcsr() { _mm_setcsr(old); }
};

inline float f_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t u_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// ---------------------------------------------------------------------------------------------------
// The constants of the definition (hex literals: exactly these fp32 values).
constexpr uint32_t QNAN = 0x7FC00000u;
constexpr uint16_t QNAN_BF16 = 0x7FC0;
constexpr float NEG_ZERO = -0.0f;
constexpr float MAGIC = 0x1.8p23f;  // 1.5 * 2^23: (v + MAGIC) - MAGIC = v rounded to nearest even, |v| < 2^22

// exp: x clamped to [EXP_LO, EXP_HI]; n = rne(x * LOG2E); r = fma(-n, LN2_HI, x); r = fma(-n, LN2_LO, r);
// p = Horner(EXP_P, r) (fma steps); exp = (p * 2^(n>>1)) * 2^(n - (n>>1)).
constexpr float EXP_LO = -112.0f;
constexpr float EXP_HI = 89.0f;
constexpr float LOG2E = 0x1.715476p+0f;
constexpr float LN2_HI = 0x1.63p-1f;          // 0.693359375 (Cody-Waite high part, 9 bits)
constexpr float LN2_LO = -0x1.bd0106p-13f;    // -2.12194440e-4
constexpr int EXP_DEG = 7;
constexpr float EXP_P[EXP_DEG + 1] = {0x1.a0d2cep-13f, 0x1.6e879cp-10f, 0x1.111210p-7f, 0x1.555382p-5f,
                                      0x1.555554p-3f,  0x1.0p-1f,       0x1.0p+0f,      0x1.0p+0f};

// log: x = 2^e * m, m in [sqrt(2)/2, sqrt(2)) from the bits (subnormals scaled by 2^23 first); f = m - 1;
// z = f*f; q = Horner(LOG_P, f); y = (q*f)*z; y = fma(e, LN2_LO, y); y = fma(-0.5, z, y); r = f + y;
// log = fma(e, LN2_HI, r).
constexpr uint32_t SQRT2_MANT = 0x3504F3;  // mantissa bits of sqrt(2) in fp32
constexpr int LOG_DEG = 8;
constexpr float LOG_P[LOG_DEG + 1] = {0x1.204376p-4f,  -0x1.d7a370p-4f, 0x1.de4a34p-4f,
                                      -0x1.fcba9ep-4f, 0x1.23d37ep-3f,  -0x1.555ca0p-3f,
                                      0x1.999d58p-3f,  -0x1.fffff8p-3f, 0x1.555554p-2f};

// sin/cos: n = rne(a * TWO_OVER_PI) (round to the nearest even integer); r = a - n*pi/2 in three fma steps (PIO2_1 + PIO2_2 + PIO2_3 = pi/2 to
// ~70 bits); z = r*r; S(r) = fma(Horner(SIN_P, z) * z, r, r); C(r) = fma(Horner(COS_P, z) * z, z, -0.5*z) + 1;
// quadrant n & 3 picks +-S / +-C. |a| > 2^24 or not finite: NaN.
constexpr float TWO_OVER_PI = 0x1.45f306p-1f;
constexpr float PIO2_1 = 0x1.921fb6p+0f;
constexpr float PIO2_2 = -0x1.777a5cp-25f;
constexpr float PIO2_3 = -0x1.ee59dap-50f;
constexpr float TRIG_MAX = 0x1.0p24f;
constexpr float SIN_P[3] = {-0x1.9943f2p-13f, 0x1.11073cp-7f, -0x1.555546p-3f};
constexpr float COS_P[3] = {0x1.99eb9cp-16f, -0x1.6c0c34p-10f, 0x1.55554ap-5f};

constexpr int LANES = 16;  // the summation lanes of every row reduction (every path)

// ---------------------------------------------------------------------------------------------------
// The scalar definition (the reference, and the per-row scalar steps of every path).
inline float canon(float y) { return y != y ? f_of(QNAN) : y; }

inline uint16_t bf16_round(float y) {  // round to nearest even; NaN -> 0x7FC0
  if (y != y) return QNAN_BF16;
  const uint32_t u = u_of(y);
  return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float pow2i(int32_t k) { return f_of((uint32_t)(k + 127) << 23); }  // k in [-126, 127]

float s_exp(float x) {
  if (x != x) return f_of(QNAN);
  const float xc = x < EXP_LO ? EXP_LO : (x > EXP_HI ? EXP_HI : x);
  const float kf = (xc * LOG2E + MAGIC) - MAGIC;
  float r = std::fma(-kf, LN2_HI, xc);
  r = std::fma(-kf, LN2_LO, r);
  float p = EXP_P[0];
  for (int i = 1; i <= EXP_DEG; i++) p = std::fma(p, r, EXP_P[i]);
  const int32_t n = (int32_t)kf;
  const int32_t n1 = n >> 1;  // arithmetic: floor(n / 2)
  return (p * pow2i(n1)) * pow2i(n - n1);
}

float s_log(float x) {
  if (x != x || x < 0.0f) return f_of(QNAN);
  if (x == 0.0f) return -INFINITY;
  if (x == INFINITY) return INFINITY;
  int32_t e = 0;
  if (x < FLT_MIN) {
    x = x * 0x1.0p23f;
    e = -23;
  }
  const uint32_t u = u_of(x);
  const uint32_t mant = u & 0x7FFFFFu;
  const int32_t off = mant > SQRT2_MANT ? 1 : 0;
  e += (int32_t)(u >> 23) - 127 + off;
  const float m = f_of(mant | ((uint32_t)(127 - off) << 23));
  const float f = m - 1.0f;
  const float z = f * f;
  float q = LOG_P[0];
  for (int i = 1; i <= LOG_DEG; i++) q = std::fma(q, f, LOG_P[i]);
  const float fe = (float)e;
  float y = (q * f) * z;
  y = std::fma(fe, LN2_LO, y);
  y = std::fma(-0.5f, z, y);
  const float r = f + y;
  return std::fma(fe, LN2_HI, r);
}

void s_sincos(float a, float& s, float& c) {
  if (!(std::fabs(a) <= TRIG_MAX)) {
    s = c = f_of(QNAN);
    return;
  }
  const float kf = std::nearbyint(a * TWO_OVER_PI);  // round to nearest even (MXCSR_IEEE)
  float r = std::fma(-kf, PIO2_1, a);
  r = std::fma(-kf, PIO2_2, r);
  r = std::fma(-kf, PIO2_3, r);
  const float z = r * r;
  const float ps = std::fma(std::fma(SIN_P[0], z, SIN_P[1]), z, SIN_P[2]);
  const float sn = std::fma(ps * z, r, r);
  const float pc = std::fma(std::fma(COS_P[0], z, COS_P[1]), z, COS_P[2]);
  const float cs = std::fma(pc * z, z, -0.5f * z) + 1.0f;
  const int32_t q = (int32_t)kf & 3;
  const float s0 = (q & 1) ? cs : sn;
  const float c0 = (q & 1) ? sn : cs;
  s = (q & 2) ? -s0 : s0;
  c = ((q + 1) & 2) ? -c0 : c0;
}

// The total order of the row max: -NaN < -inf < ... < -0 < +0 < ... < +inf < +NaN as int32 keys.
inline int32_t max_key(float x) {
  const int32_t u = (int32_t)u_of(x);
  return u ^ (int32_t)((uint32_t)(u >> 31) >> 1);
}
inline float from_key(int32_t k) { return f_of((uint32_t)(k ^ (int32_t)((uint32_t)(k >> 31) >> 1))); }

// The tree that folds the 16 lane sums a[0..15]: a[j] += a[j+8], then a[j] += a[j+4], a[j] += a[j+2], a[0] + a[1].
inline float s_tree(float* a) {
  for (int w = LANES / 2; w >= 1; w /= 2)
    for (int j = 0; j < w; j++) a[j] = a[j] + a[j + w];
  return a[0];
}

// f(i) summed: lane i % 16 adds its terms in ascending i from -0.0, then the tree.
template <class Term>
inline float s_row_sum(int64_t n, Term f) {
  float acc[LANES];
  for (int j = 0; j < LANES; j++) acc[j] = NEG_ZERO;
  for (int64_t i = 0; i < n; i++) acc[i % LANES] = acc[i % LANES] + f(i);
  return s_tree(acc);
}

// max by max_key; any NaN gives NaN; an empty row gives -inf.
template <class Term>
inline float s_row_max(int64_t n, Term f) {
  int32_t best = max_key(-INFINITY);
  bool nan = false;
  for (int64_t i = 0; i < n; i++) {
    const float v = f(i);
    nan = nan || v != v;
    best = std::max(best, max_key(v));
  }
  return nan ? f_of(QNAN) : from_key(best);
}

// ---------------------------------------------------------------------------------------------------
// RoPE's inverse frequencies: inv[i] = 1.0f / (float)exp64(e_i * log64(theta)), e_i = (float)(2i) / (float)D
// (fp32 division), exp64/log64 the fp64 routines below (scalar, the same code on every path).
constexpr double LN2_HI_D = 0x1.62e42feep-1;        // fdlibm's split of ln 2
constexpr double LN2_LO_D = 0x1.a39ef35793c76p-33;

double log64(double x) {  // x > 0 finite; ~1e-16 relative
  uint64_t u;
  std::memcpy(&u, &x, 8);
  int64_t k = 0;
  if (x < 0x1.0p-1022) {
    x *= 0x1.0p54;
    std::memcpy(&u, &x, 8);
    k = -54;
  }
  const uint64_t mant = u & 0xFFFFFFFFFFFFFull;
  const int64_t off = mant > 0x6A09E667F3BCDull ? 1 : 0;  // mantissa bits of sqrt(2) in fp64
  k += (int64_t)(u >> 52) - 1023 + off;
  const uint64_t mb = mant | ((uint64_t)(1023 - off) << 52);
  double m;
  std::memcpy(&m, &mb, 8);
  const double f = (m - 1.0) / (m + 1.0);  // |f| <= 0.1716
  const double s = f * f;
  double p = 1.0 / 25.0;
  for (int j = 11; j >= 0; j--) p = p * s + 1.0 / (2 * j + 1);  // sum s^j / (2j+1), j = 0..12
  const double lm = 2.0 * f * p;
  const double kd = (double)k;
  return kd * LN2_HI_D + (kd * LN2_LO_D + lm);
}

double exp64(double y) {  // |y| < 700; ~1e-16 relative
  const double kf = (y * 0x1.71547652b82fep+0 + 0x1.8p52) - 0x1.8p52;
  const double r = (y - kf * LN2_HI_D) - kf * LN2_LO_D;
  double p = 1.0;
  for (int j = 17; j >= 1; j--) p = p * (r / j) + 1.0;  // Taylor, 17 terms, Horner
  const int64_t k = (int64_t)kf;
  const uint64_t sb = (uint64_t)(k + 1023) << 52;
  double sc;
  std::memcpy(&sc, &sb, 8);
  return p * sc;
}

void inv_freq(int64_t d, double theta, float* inv) {
  const double lt = log64(theta);
  for (int64_t i = 0; i < d / 2; i++) {
    const float e = (float)(2 * i) / (float)d;
    const float p = (float)exp64((double)e * lt);
    inv[i] = 1.0f / p;
  }
}

// ---------------------------------------------------------------------------------------------------
// 16-lane blocks: F (fp32 lanes), I (int32 lanes), M (lane mask). Lane j of a row's block b is element
// 16*b + j: the summation lanes of the definition, on every path.
#if defined(ROWWISE_ISA_AVX2)
constexpr int ISA_ID = 2;
struct F {
  __m256 a, b;
};
struct I {
  __m256i a, b;
};
typedef F M;
#define F2(op, x, y) F{op((x).a, (y).a), op((x).b, (y).b)}
#define I2(op, x, y) I{op((x).a, (y).a), op((x).b, (y).b)}
INL F set1(float x) { return F{_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
INL I iset1(int32_t x) { return I{_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
INL F load(const float* p) { return F{_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
INL void store(float* p, F x) {
  _mm256_storeu_ps(p, x.a);
  _mm256_storeu_ps(p + 8, x.b);
}
INL F load(const uint16_t* p) {
  const __m256i a = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  const __m256i b = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 8)));
  return F{_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16))};
}
INL void store16(uint16_t* p, I h) {  // the low 16 bits of each lane (values < 2^16)
  const __m256i pk = _mm256_packus_epi32(h.a, h.b);  // a0-3 b0-3 a4-7 b4-7
  _mm256_storeu_si256((__m256i*)p, _mm256_permute4x64_epi64(pk, 0xD8));
}
INL F add(F x, F y) { return F2(_mm256_add_ps, x, y); }
INL F sub(F x, F y) { return F2(_mm256_sub_ps, x, y); }
INL F mul(F x, F y) { return F2(_mm256_mul_ps, x, y); }
INL F div(F x, F y) { return F2(_mm256_div_ps, x, y); }
INL F vmin(F x, F y) { return F2(_mm256_min_ps, x, y); }  // y where unordered
INL F vmax(F x, F y) { return F2(_mm256_max_ps, x, y); }
INL F fma(F x, F y, F z) {
  return F{_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)};
}
INL M cmp_lt(F x, F y) { return F{_mm256_cmp_ps(x.a, y.a, _CMP_LT_OQ), _mm256_cmp_ps(x.b, y.b, _CMP_LT_OQ)}; }
INL M cmp_le(F x, F y) { return F{_mm256_cmp_ps(x.a, y.a, _CMP_LE_OQ), _mm256_cmp_ps(x.b, y.b, _CMP_LE_OQ)}; }
INL M cmp_eq(F x, F y) { return F{_mm256_cmp_ps(x.a, y.a, _CMP_EQ_OQ), _mm256_cmp_ps(x.b, y.b, _CMP_EQ_OQ)}; }
INL M is_nan(F x) { return F{_mm256_cmp_ps(x.a, x.a, _CMP_UNORD_Q), _mm256_cmp_ps(x.b, x.b, _CMP_UNORD_Q)}; }
INL M icmp_gt(I x, I y) {
  return F{_mm256_castsi256_ps(_mm256_cmpgt_epi32(x.a, y.a)), _mm256_castsi256_ps(_mm256_cmpgt_epi32(x.b, y.b))};
}
INL M m_or(M x, M y) { return F2(_mm256_or_ps, x, y); }
INL M m_none() { return set1(0.0f); }
INL bool m_any(M x) { return _mm256_movemask_ps(_mm256_or_ps(x.a, x.b)) != 0; }
INL M first_n(int64_t n) {  // lanes j < n
  const __m256i v = _mm256_set1_epi32((int)std::min<int64_t>(n, LANES));
  return F{_mm256_castsi256_ps(_mm256_cmpgt_epi32(v, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7))),
           _mm256_castsi256_ps(_mm256_cmpgt_epi32(v, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)))};
}
INL F sel(M m, F x, F y) { return F{_mm256_blendv_ps(y.a, x.a, m.a), _mm256_blendv_ps(y.b, x.b, m.b)}; }
INL I as_i(F x) { return I{_mm256_castps_si256(x.a), _mm256_castps_si256(x.b)}; }
INL F as_f(I x) { return F{_mm256_castsi256_ps(x.a), _mm256_castsi256_ps(x.b)}; }
INL I seli(M m, I x, I y) { return as_i(sel(m, as_f(x), as_f(y))); }
INL I iadd(I x, I y) { return I2(_mm256_add_epi32, x, y); }
INL I isub(I x, I y) { return I2(_mm256_sub_epi32, x, y); }
INL I iand(I x, I y) { return I2(_mm256_and_si256, x, y); }
INL I ior(I x, I y) { return I2(_mm256_or_si256, x, y); }
INL I ixor(I x, I y) { return I2(_mm256_xor_si256, x, y); }
INL I imax(I x, I y) { return I2(_mm256_max_epi32, x, y); }
template <int N>
INL I shl(I x) { return I{_mm256_slli_epi32(x.a, N), _mm256_slli_epi32(x.b, N)}; }
template <int N>
INL I sra(I x) { return I{_mm256_srai_epi32(x.a, N), _mm256_srai_epi32(x.b, N)}; }
template <int N>
INL I srl(I x) { return I{_mm256_srli_epi32(x.a, N), _mm256_srli_epi32(x.b, N)}; }
INL I to_int(F x) { return I{_mm256_cvttps_epi32(x.a), _mm256_cvttps_epi32(x.b)}; }  // integral values
INL F to_float(I x) { return F{_mm256_cvtepi32_ps(x.a), _mm256_cvtepi32_ps(x.b)}; }
INL F rint(F x) {  // round to nearest even integer
  constexpr int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return F{_mm256_round_ps(x.a, mode), _mm256_round_ps(x.b, mode)};
}
INL float hsum(F x) {  // the tree: a[j] + a[j+8], then + [j+4], + [j+2], a0 + a1
  const __m256 t8 = _mm256_add_ps(x.a, x.b);
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}
INL void istore(int32_t* p, I x) {
  _mm256_storeu_si256((__m256i*)p, x.a);
  _mm256_storeu_si256((__m256i*)(p + 8), x.b);
}
#elif defined(ROWWISE_ISA_AVX512)
constexpr int ISA_ID = 5;
struct F {
  __m512 v;
};
struct I {
  __m512i v;
};
typedef __mmask16 M;
INL F set1(float x) { return F{_mm512_set1_ps(x)}; }
INL I iset1(int32_t x) { return I{_mm512_set1_epi32(x)}; }
INL F load(const float* p) { return F{_mm512_loadu_ps(p)}; }
INL void store(float* p, F x) { _mm512_storeu_ps(p, x.v); }
INL F load(const uint16_t* p) {
  return F{_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16))};
}
INL void store16(uint16_t* p, I h) { _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(h.v)); }
INL F add(F x, F y) { return F{_mm512_add_ps(x.v, y.v)}; }
INL F sub(F x, F y) { return F{_mm512_sub_ps(x.v, y.v)}; }
INL F mul(F x, F y) { return F{_mm512_mul_ps(x.v, y.v)}; }
INL F div(F x, F y) { return F{_mm512_div_ps(x.v, y.v)}; }
INL F vmin(F x, F y) { return F{_mm512_min_ps(x.v, y.v)}; }
INL F vmax(F x, F y) { return F{_mm512_max_ps(x.v, y.v)}; }
INL F fma(F x, F y, F z) { return F{_mm512_fmadd_ps(x.v, y.v, z.v)}; }
INL M cmp_lt(F x, F y) { return _mm512_cmp_ps_mask(x.v, y.v, _CMP_LT_OQ); }
INL M cmp_le(F x, F y) { return _mm512_cmp_ps_mask(x.v, y.v, _CMP_LE_OQ); }
INL M cmp_eq(F x, F y) { return _mm512_cmp_ps_mask(x.v, y.v, _CMP_EQ_OQ); }
INL M is_nan(F x) { return _mm512_cmp_ps_mask(x.v, x.v, _CMP_UNORD_Q); }
INL M icmp_gt(I x, I y) { return _mm512_cmpgt_epi32_mask(x.v, y.v); }
INL M m_or(M x, M y) { return (M)(x | y); }
INL M m_none() { return 0; }
INL bool m_any(M x) { return x != 0; }
INL M first_n(int64_t n) { return n >= LANES ? (M)0xFFFF : (M)((1u << n) - 1u); }
INL F sel(M m, F x, F y) { return F{_mm512_mask_blend_ps(m, y.v, x.v)}; }
INL I seli(M m, I x, I y) { return I{_mm512_mask_blend_epi32(m, y.v, x.v)}; }
INL I as_i(F x) { return I{_mm512_castps_si512(x.v)}; }
INL F as_f(I x) { return F{_mm512_castsi512_ps(x.v)}; }
INL I iadd(I x, I y) { return I{_mm512_add_epi32(x.v, y.v)}; }
INL I isub(I x, I y) { return I{_mm512_sub_epi32(x.v, y.v)}; }
INL I iand(I x, I y) { return I{_mm512_and_si512(x.v, y.v)}; }
INL I ior(I x, I y) { return I{_mm512_or_si512(x.v, y.v)}; }
INL I ixor(I x, I y) { return I{_mm512_xor_si512(x.v, y.v)}; }
INL I imax(I x, I y) { return I{_mm512_max_epi32(x.v, y.v)}; }
template <int N>
INL I shl(I x) { return I{_mm512_slli_epi32(x.v, N)}; }
template <int N>
INL I sra(I x) { return I{_mm512_srai_epi32(x.v, N)}; }
template <int N>
INL I srl(I x) { return I{_mm512_srli_epi32(x.v, N)}; }
INL I to_int(F x) { return I{_mm512_cvttps_epi32(x.v)}; }
INL F to_float(I x) { return F{_mm512_cvtepi32_ps(x.v)}; }
INL F rint(F x) { return F{_mm512_roundscale_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
INL float hsum(F x) {  // the tree: a[j] + a[j+8], then + [j+4], + [j+2], a0 + a1
  const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(x.v), _mm512_extractf32x8_ps(x.v, 1));
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}
INL void istore(int32_t* p, I x) { _mm512_storeu_si512((void*)p, x.v); }
#elif defined(ROWWISE_ISA_PORTABLE)
constexpr int ISA_ID = 0;
typedef float fv __attribute__((vector_size(64)));
typedef int32_t iv __attribute__((vector_size(64)));
typedef uint32_t uv __attribute__((vector_size(64)));
struct F {
  fv v;
};
struct I {
  iv v;
};
struct M {
  iv v;
};
INL F set1(float x) {
  F r;
  for (int j = 0; j < LANES; j++) r.v[j] = x;
  return r;
}
INL I iset1(int32_t x) {
  I r;
  for (int j = 0; j < LANES; j++) r.v[j] = x;
  return r;
}
INL F load(const float* p) {
  F r;
  std::memcpy(&r.v, p, sizeof r.v);
  return r;
}
INL void store(float* p, F x) { std::memcpy(p, &x.v, sizeof x.v); }
INL F load(const uint16_t* p) {
  F r;
  for (int j = 0; j < LANES; j++) r.v[j] = f_of((uint32_t)p[j] << 16);
  return r;
}
INL void store16(uint16_t* p, I h) {
  for (int j = 0; j < LANES; j++) p[j] = (uint16_t)h.v[j];
}
INL F add(F x, F y) { return F{x.v + y.v}; }
INL F sub(F x, F y) { return F{x.v - y.v}; }
INL F mul(F x, F y) { return F{x.v * y.v}; }
INL F div(F x, F y) { return F{x.v / y.v}; }
INL F vmin(F x, F y) { return F{x.v < y.v ? x.v : y.v}; }  // y where unordered, as minps
INL F vmax(F x, F y) { return F{x.v > y.v ? x.v : y.v}; }
INL F fma(F x, F y, F z) {
  F r;
  for (int j = 0; j < LANES; j++) r.v[j] = std::fma(x.v[j], y.v[j], z.v[j]);
  return r;
}
INL M cmp_lt(F x, F y) { return M{x.v < y.v}; }
INL M cmp_le(F x, F y) { return M{x.v <= y.v}; }
INL M cmp_eq(F x, F y) { return M{x.v == y.v}; }
INL M is_nan(F x) { return M{x.v != x.v}; }
INL M icmp_gt(I x, I y) { return M{x.v > y.v}; }
INL M m_or(M x, M y) { return M{x.v | y.v}; }
INL M m_none() { return M{iset1(0).v}; }
INL bool m_any(M x) {
  for (int j = 0; j < LANES; j++)
    if (x.v[j]) return true;
  return false;
}
INL M first_n(int64_t n) {
  M r;
  for (int j = 0; j < LANES; j++) r.v[j] = j < n ? -1 : 0;
  return r;
}
INL F sel(M m, F x, F y) { return F{m.v ? x.v : y.v}; }
INL I seli(M m, I x, I y) { return I{m.v ? x.v : y.v}; }
INL I as_i(F x) { return I{(iv)x.v}; }
INL F as_f(I x) { return F{(fv)x.v}; }
INL I iadd(I x, I y) { return I{(iv)((uv)x.v + (uv)y.v)}; }  // wrapping
INL I isub(I x, I y) { return I{(iv)((uv)x.v - (uv)y.v)}; }
INL I iand(I x, I y) { return I{x.v & y.v}; }
INL I ior(I x, I y) { return I{x.v | y.v}; }
INL I ixor(I x, I y) { return I{x.v ^ y.v}; }
INL I imax(I x, I y) { return I{x.v > y.v ? x.v : y.v}; }
template <int N>
INL I shl(I x) { return I{(iv)((uv)x.v << N)}; }
template <int N>
INL I sra(I x) { return I{x.v >> N}; }
template <int N>
INL I srl(I x) { return I{(iv)((uv)x.v >> N)}; }
INL I to_int(F x) { return I{__builtin_convertvector(x.v, iv)}; }  // integral values in range only
INL F to_float(I x) { return F{__builtin_convertvector(x.v, fv)}; }
INL F rint(F x) {
  for (int j = 0; j < LANES; j++) x.v[j] = std::nearbyint(x.v[j]);
  return x;
}
INL float hsum(F x) {
  float a[LANES];
  std::memcpy(a, &x.v, sizeof a);
  return s_tree(a);
}
INL void istore(int32_t* p, I x) { std::memcpy(p, &x.v, sizeof x.v); }
#else
#error "define one of ROWWISE_ISA_AVX512, ROWWISE_ISA_AVX2, ROWWISE_ISA_PORTABLE"
#endif

INL F neg(F x) { return as_f(ixor(as_i(x), iset1(INT32_MIN))); }
INL F vabs(F x) { return as_f(iand(as_i(x), iset1(0x7FFFFFFF))); }
INL F vcanon(F y) { return sel(is_nan(y), as_f(iset1((int32_t)QNAN)), y); }

// ---------------------------------------------------------------------------------------------------
// The definition on 16 lanes (each line the scalar definition's, lane by lane).
INL F v_exp(F x) {
  const M nan = is_nan(x);
  const F xc = vmin(vmax(x, set1(EXP_LO)), set1(EXP_HI));  // NaN lanes: a bound (replaced below)
  const F kf = sub(add(mul(xc, set1(LOG2E)), set1(MAGIC)), set1(MAGIC));
  const F nk = neg(kf);
  F r = fma(nk, set1(LN2_HI), xc);
  r = fma(nk, set1(LN2_LO), r);
  F p = set1(EXP_P[0]);
  for (int i = 1; i <= EXP_DEG; i++) p = fma(p, r, set1(EXP_P[i]));
  const I n = to_int(kf);
  const I n1 = sra<1>(n);
  const I n2 = isub(n, n1);
  const F s1 = as_f(shl<23>(iadd(n1, iset1(127))));
  const F s2 = as_f(shl<23>(iadd(n2, iset1(127))));
  return sel(nan, as_f(iset1((int32_t)QNAN)), mul(mul(p, s1), s2));
}

INL F v_log(F x) {
  const F zero = set1(0.0f);
  const M tiny = cmp_lt(x, set1(FLT_MIN));
  const F xs = sel(tiny, mul(x, set1(0x1.0p23f)), x);
  const I u = as_i(xs);
  const I mant = iand(u, iset1(0x7FFFFF));
  const I off = seli(icmp_gt(mant, iset1((int32_t)SQRT2_MANT)), iset1(1), iset1(0));
  I e = iadd(isub(srl<23>(u), iset1(127)), off);
  e = seli(tiny, isub(e, iset1(23)), e);
  const F m = as_f(ior(mant, shl<23>(isub(iset1(127), off))));
  const F f = sub(m, set1(1.0f));
  const F z = mul(f, f);
  F q = set1(LOG_P[0]);
  for (int i = 1; i <= LOG_DEG; i++) q = fma(q, f, set1(LOG_P[i]));
  const F fe = to_float(e);
  F y = mul(mul(q, f), z);
  y = fma(fe, set1(LN2_LO), y);
  y = fma(set1(-0.5f), z, y);
  F r = fma(fe, set1(LN2_HI), add(f, y));
  r = sel(cmp_eq(x, zero), set1(-INFINITY), r);
  r = sel(cmp_eq(x, set1(INFINITY)), set1(INFINITY), r);
  return sel(m_or(cmp_lt(x, zero), is_nan(x)), as_f(iset1((int32_t)QNAN)), r);
}

INL void v_sincos(F a, F& s, F& c) {
  const M ok = cmp_le(vabs(a), set1(TRIG_MAX));  // false for NaN
  a = sel(ok, a, set1(0.0f));
  const F kf = rint(mul(a, set1(TWO_OVER_PI)));
  const F nk = neg(kf);
  F r = fma(nk, set1(PIO2_1), a);
  r = fma(nk, set1(PIO2_2), r);
  r = fma(nk, set1(PIO2_3), r);
  const F z = mul(r, r);
  const F ps = fma(fma(set1(SIN_P[0]), z, set1(SIN_P[1])), z, set1(SIN_P[2]));
  const F sn = fma(mul(ps, z), r, r);
  const F pc = fma(fma(set1(COS_P[0]), z, set1(COS_P[1])), z, set1(COS_P[2]));
  const F cs = add(fma(mul(pc, z), z, mul(set1(-0.5f), z)), set1(1.0f));
  const I q = to_int(kf);
  const M swap = icmp_gt(iand(q, iset1(1)), iset1(0));
  const I sgn_s = shl<30>(iand(q, iset1(2)));
  const I sgn_c = shl<30>(iand(iadd(q, iset1(1)), iset1(2)));
  const F qnan = as_f(iset1((int32_t)QNAN));
  s = sel(ok, as_f(ixor(as_i(sel(swap, cs, sn)), sgn_s)), qnan);
  c = sel(ok, as_f(ixor(as_i(sel(swap, sn, cs)), sgn_c)), qnan);
}

INL I v_key(F x) {
  const I u = as_i(x);
  return ixor(u, srl<1>(sra<31>(u)));
}

// bf16 bits (low 16 of each lane) of y rounded to nearest even; NaN -> 0x7FC0.
INL I v_bf16(F y) {
  const I u = as_i(y);
  const I r = srl<16>(iadd(iadd(u, iset1(0x7FFF)), iand(srl<16>(u), iset1(1))));
  return seli(is_nan(y), iset1(QNAN_BF16), r);
}

// Loads of 16 elements (tails through a zero-filled buffer) and stores of results (NaN made one pattern;
// bf16 rounded to nearest even).
template <class T>
INL F load_tail(const T* p, int64_t n) {
  T buf[LANES] = {};
  std::memcpy(buf, p, sizeof(T) * n);
  return load(buf);
}
INL void put(float* p, F y) { store(p, vcanon(y)); }
INL void put(uint16_t* p, F y) { store16(p, v_bf16(y)); }
template <class T>
INL void put_tail(T* p, F y, int64_t n) {
  T buf[LANES];
  put(buf, y);
  std::memcpy(p, buf, sizeof(T) * n);
}

// scalar load/store of one element in the op's dtype
INL float get1(const float* p) { return *p; }
INL float get1(const uint16_t* p) { return f_of((uint32_t)*p << 16); }
INL void put1(float* p, float y) { *p = canon(y); }
INL void put1(uint16_t* p, float y) { *p = bf16_round(y); }

// ---------------------------------------------------------------------------------------------------
// Threads: OpenMP over rows (or, for elementwise ops, over 16-element blocks); each thread runs under
// MXCSR_IEEE. A row is always one thread's, so no reduction is ever split.
constexpr int64_t PARALLEL_MIN = 1 << 15;  // elements below which one thread does all

template <class Body>
void for_rows(int64_t rows, int64_t per_row, int nt, Body body) {
  if (nt <= 1 || rows <= 1 || rows * per_row < PARALLEL_MIN) {
    Mxcsr guard;
    for (int64_t r = 0; r < rows; r++) body(r);
    return;
  }
#pragma omp parallel num_threads(nt)
  {
    Mxcsr guard;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) body(r);
  }
}

// Elementwise over n: body(i0, i1) for chunks of whole 16-element blocks.
template <class Body>
void for_chunks(int64_t n, int nt, Body body) {
  const int64_t blocks = (n + LANES - 1) / LANES;
  const int64_t per = 256;  // blocks per chunk
  const int64_t chunks = (blocks + per - 1) / per;
  for_rows(chunks, per * LANES, nt, [&](int64_t c) {
    body(c * per * LANES, std::min(n, (c + 1) * per * LANES));
  });
}

// ---------------------------------------------------------------------------------------------------
// The vector ops.
template <bool LOG>
void v_elementwise(const float* x, float* y, int64_t n, int nt) {
  for_chunks(n, nt, [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
    for (; i + LANES <= i1; i += LANES) put(y + i, LOG ? v_log(load(x + i)) : v_exp(load(x + i)));
    if (i < i1) put_tail(y + i, LOG ? v_log(load_tail(x + i, i1 - i)) : v_exp(load_tail(x + i, i1 - i)), i1 - i);
  });
}

INL float v_row_sum(const float* x, int64_t n) {
  F acc = set1(NEG_ZERO);
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) acc = add(acc, load(x + i));
  if (i < n) acc = add(acc, sel(first_n(n - i), load_tail(x + i, n - i), set1(NEG_ZERO)));
  return hsum(acc);
}

INL float v_row_max(const float* x, int64_t n) {
  I best = iset1(max_key(-INFINITY));
  M nan = m_none();
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    const F v = load(x + i);
    nan = m_or(nan, is_nan(v));
    best = imax(best, v_key(v));
  }
  if (i < n) {
    const F v = sel(first_n(n - i), load_tail(x + i, n - i), set1(-INFINITY));
    nan = m_or(nan, is_nan(v));
    best = imax(best, v_key(v));
  }
  if (m_any(nan)) return f_of(QNAN);
  int32_t k[LANES];
  istore(k, best);
  return from_key(*std::max_element(k, k + LANES));
}

template <class TX, class TW>
void v_rms_norm(const TX* x, int64_t rows, int64_t h, int64_t ldx, const TW* w, float eps, TX* out, int nt) {
  for_rows(rows, h, nt, [&](int64_t r) {
    const TX* xr = x + r * ldx;
    TX* o = out + r * h;
    F acc = set1(NEG_ZERO);
    int64_t i = 0;
    for (; i + LANES <= h; i += LANES) {
      const F v = load(xr + i);
      acc = add(acc, mul(v, v));
    }
    if (i < h) {
      const F v = load_tail(xr + i, h - i);
      acc = add(acc, sel(first_n(h - i), mul(v, v), set1(NEG_ZERO)));
    }
    const float var = hsum(acc) / (float)h;
    const F d = set1(std::sqrt(var + eps));
    for (i = 0; i + LANES <= h; i += LANES) put(o + i, mul(div(load(xr + i), d), load(w + i)));
    if (i < h) put_tail(o + i, mul(div(load_tail(xr + i, h - i), d), load_tail(w + i, h - i)), h - i);
  });
}

INL F v_swiglu1(F g, F u) { return mul(div(g, add(v_exp(neg(g)), set1(1.0f))), u); }

template <class TG, class TU, class TO>
void v_swiglu(const TG* g, const TU* u, int64_t n, TO* out, int nt) {
  for_chunks(n, nt, [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
    for (; i + LANES <= i1; i += LANES) put(out + i, v_swiglu1(load(g + i), load(u + i)));
    if (i < i1) put_tail(out + i, v_swiglu1(load_tail(g + i, i1 - i), load_tail(u + i, i1 - i)), i1 - i);
  });
}

// One row's logprob: m = max(z) (= max(x) / T: rounding is monotonic), s = sum exp(z - m), out = (z_t - m) - log(s).
template <class TX>
float v_logprob_row(const TX* x, int64_t v, int64_t tok, float t) {
  const bool div_t = t != 1.0f;
  const F tv = set1(t);
  I best = iset1(max_key(-INFINITY));
  M nan = m_none();
  int64_t i = 0;
  for (; i + LANES <= v; i += LANES) {
    const F a = load(x + i);
    nan = m_or(nan, is_nan(a));
    best = imax(best, v_key(a));
  }
  if (i < v) {
    const F a = sel(first_n(v - i), load_tail(x + i, v - i), set1(-INFINITY));
    nan = m_or(nan, is_nan(a));
    best = imax(best, v_key(a));
  }
  if (m_any(nan)) return f_of(QNAN);
  int32_t k[LANES];
  istore(k, best);
  const float mx = from_key(*std::max_element(k, k + LANES));
  const float m = div_t ? mx / t : mx;
  const F mv = set1(m);
  F acc = set1(NEG_ZERO);
  for (i = 0; i + LANES <= v; i += LANES) {
    const F a = load(x + i);
    acc = add(acc, v_exp(sub(div_t ? div(a, tv) : a, mv)));
  }
  if (i < v) {
    const F a = load_tail(x + i, v - i);
    acc = add(acc, sel(first_n(v - i), v_exp(sub(div_t ? div(a, tv) : a, mv)), set1(NEG_ZERO)));
  }
  const float s = hsum(acc);
  const float zt = div_t ? get1(x + tok) / t : get1(x + tok);
  return canon((zt - m) - s_log(s));
}

template <class TX>
void v_logprobs(const TX* x, int64_t rows, int64_t v, int64_t ldx, const int64_t* tok, float t, float* out, int nt) {
  for_rows(rows, v, nt, [&](int64_t r) { out[r] = v_logprob_row(x + r * ldx, v, tok[r], t); });
}

void v_sincos_n(const float* a, int64_t n, float* s, float* c, int nt) {
  for_chunks(n, nt, [&](int64_t i0, int64_t i1) {
    int64_t i = i0;
    F sv, cv;
    for (; i + LANES <= i1; i += LANES) {
      v_sincos(load(a + i), sv, cv);
      put(s + i, sv);
      put(c + i, cv);
    }
    if (i < i1) {
      v_sincos(load_tail(a + i, i1 - i), sv, cv);
      put_tail(s + i, sv, i1 - i);
      put_tail(c + i, cv, i1 - i);
    }
  });
}

void v_rope(const int64_t* pos, int64_t n, int64_t d, double theta, float* cs, float* sn, int nt) {
  const int64_t h = d / 2;
  std::vector<float> inv(h + LANES, 0.0f);
  inv_freq(d, theta, inv.data());
  for_rows(n, d * 8, nt, [&](int64_t r) {
    const F p = set1((float)pos[r]);
    float* c = cs + r * d;
    float* s = sn + r * d;
    F sv, cv;
    for (int64_t i = 0; i < h; i += LANES) {
      v_sincos(mul(p, load(inv.data() + i)), sv, cv);
      const int64_t k = std::min<int64_t>(LANES, h - i);
      if (k == LANES) {
        put(c + i, cv), put(c + h + i, cv), put(s + i, sv), put(s + h + i, sv);
      } else {
        put_tail(c + i, cv, k), put_tail(c + h + i, cv, k), put_tail(s + i, sv, k), put_tail(s + h + i, sv, k);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------------
// The scalar reference: plain loops, one element at a time.
template <class TX, class TW>
void s_rms_norm(const TX* x, int64_t rows, int64_t h, int64_t ldx, const TW* w, float eps, TX* out) {
  for (int64_t r = 0; r < rows; r++) {
    const TX* xr = x + r * ldx;
    const float ss = s_row_sum(h, [&](int64_t i) {
      const float v = get1(xr + i);
      return v * v;
    });
    const float var = ss / (float)h;
    const float d = std::sqrt(var + eps);
    for (int64_t i = 0; i < h; i++) put1(out + r * h + i, (get1(xr + i) / d) * get1(w + i));
  }
}

template <class TG, class TU, class TO>
void s_swiglu(const TG* g, const TU* u, int64_t n, TO* out) {
  for (int64_t i = 0; i < n; i++) {
    const float gv = get1(g + i);
    put1(out + i, (gv / (s_exp(-gv) + 1.0f)) * get1(u + i));
  }
}

template <class TX>
void s_logprobs(const TX* x, int64_t rows, int64_t v, int64_t ldx, const int64_t* tok, float t, float* out) {
  std::vector<float> z(v);
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t i = 0; i < v; i++) z[i] = t != 1.0f ? get1(x + r * ldx + i) / t : get1(x + r * ldx + i);
    const float m = s_row_max(v, [&](int64_t i) { return z[i]; });
    const float s = s_row_sum(v, [&](int64_t i) { return s_exp(z[i] - m); });
    out[r] = canon((z[tok[r]] - m) - s_log(s));
  }
}

void s_rope(const int64_t* pos, int64_t n, int64_t d, double theta, float* cs, float* sn) {
  const int64_t h = d / 2;
  std::vector<float> inv(h);
  inv_freq(d, theta, inv.data());
  for (int64_t r = 0; r < n; r++)
    for (int64_t i = 0; i < h; i++) {
      float s, c;
      s_sincos((float)pos[r] * inv[i], s, c);
      cs[r * d + i] = cs[r * d + h + i] = canon(c);
      sn[r * d + i] = sn[r * d + h + i] = canon(s);
    }
}

// ---------------------------------------------------------------------------------------------------
// The split-KV attention's row-local steps (tonpolicy/kernels/invariant/attention.py states them as torch
// ops; these compute the same IEEE operations in the same order, so the same bits, with one call instead of
// dozens of small ones per layer).

// One query row over n key tiles of T scores s [n, T]: x = s * scale, from tile j on plus the mask's
// bias (keep [n - j, T] is 1 or 0: bias 0 or -inf); m = max x per tile; p = exp(x - safe(m)) (from tile j
// on: an -inf difference read as 0, the exp times keep); l = the ordered row sum of p. p goes to tile-major
// rows (tile t at p + t * ldp), m and l to m[t * ldm], l[t * ldm].
void attn_softmax_row(const float* s, int64_t n, int64_t t_len, float scale, int64_t j, const float* keep,
                      float* p, int64_t ldp, float* m, float* l, int64_t ldm) {
  const F vscale = set1(scale);
  const F ninf = set1(-INFINITY);
  const F zero = set1(0.0f);
  for (int64_t t = 0; t < n; t++) {
    const float* st = s + t * t_len;
    float* pt = p + t * ldp;
    const bool masked = keep != nullptr && t >= j;
    const float* kt = masked ? keep + (t - j) * t_len : nullptr;
    for (int64_t i = 0; i < t_len; i += LANES) {
      const int64_t w = std::min<int64_t>(LANES, t_len - i);
      F x = mul(w == LANES ? load(st + i) : load_tail(st + i, w), vscale);
      if (masked) {
        const F k = w == LANES ? load(kt + i) : load_tail(kt + i, w);
        x = add(x, sel(cmp_eq(k, zero), ninf, zero));
      }
      if (w == LANES) {
        store(pt + i, x);
      } else {
        float buf[LANES];
        store(buf, x);
        std::memcpy(pt + i, buf, sizeof(float) * w);
      }
    }
    const float mx = v_row_max(pt, t_len);
    const F ms = set1(mx == -INFINITY ? 0.0f : mx);  // safe_max: -inf -> 0, NaN and +inf kept
    for (int64_t i = 0; i < t_len; i += LANES) {
      const int64_t w = std::min<int64_t>(LANES, t_len - i);
      F d = sub(w == LANES ? load(pt + i) : load_tail(pt + i, w), ms);
      if (masked) d = sel(cmp_eq(d, ninf), zero, d);
      F e = vcanon(v_exp(d));
      if (masked) e = mul(e, w == LANES ? load(kt + i) : load_tail(kt + i, w));
      if (w == LANES) {
        store(pt + i, e);
      } else {
        float buf[LANES];
        store(buf, e);
        std::memcpy(pt + i, buf, sizeof(float) * w);
      }
    }
    m[t * ldm] = mx;
    l[t * ldm] = canon(v_row_sum(pt, t_len));
  }
}

// torch.cummax's step: the new value when it is >= the running one or NaN (a NaN stays).
inline float cummax_step(float run, float x) { return (x != x || (run == run && x >= run)) ? x : run; }

// One row of the left-to-right merge of kt tile partials (m[t * N], l[t * N], acc[t * N * D]) and its
// finalisation: run = (l, acc) of tile 0 times exp(m_0 - M_0), then run = run * exp(M_{t-1} - M_t) +
// (l_t, acc_t) * exp(m_t - M_t) with M the running max (-inf read as 0), each product and sum rounded;
// out = acc / l (l = 0 read as 1), rounded to the output dtype. One tile is taken as it is.
template <class TO>
void attn_merge_row(const float* m, const float* l, const float* acc, int64_t kt, int64_t rows, int64_t d,
                    TO* out, float* run) {
  float run_l = l[0];
  std::memcpy(run, acc, sizeof(float) * d);
  if (kt > 1) {
    float run_m = m[0];
    float cb = canon(s_exp(m[0] - (run_m == -INFINITY ? 0.0f : run_m)));
    run_l = run_l * cb;
    for (int64_t i = 0; i < d; i++) run[i] = run[i] * cb;
    for (int64_t t = 1; t < kt; t++) {
      const float mt = m[t * rows];
      const float prev = run_m;
      run_m = cummax_step(run_m, mt);
      const float ms = run_m == -INFINITY ? 0.0f : run_m;
      const float ca = canon(s_exp(prev - ms));
      cb = canon(s_exp(mt - ms));
      run_l = run_l * ca + l[t * rows] * cb;
      const float* at = acc + t * rows * d;
      for (int64_t i = 0; i < d; i++) run[i] = run[i] * ca + at[i] * cb;
    }
  }
  const float div = run_l == 0.0f ? 1.0f : run_l;
  for (int64_t i = 0; i < d; i++) {
    const float y = run[i] / div;
    if constexpr (sizeof(TO) == 2) {
      out[i] = bf16_round(y);
    } else {
      out[i] = y;
    }
  }
}

template <class TO>
void attn_merge(const float* m, const float* l, const float* acc, int64_t kt, int64_t rows, int64_t d, TO* out,
                int nt) {
  for_rows(rows, kt * d, nt, [&](int64_t r) {
    float stack[256];
    std::vector<float> heap(d > 256 ? d : 0);
    attn_merge_row(m + r, l + r, acc + r * d, kt, rows, d, out + r * d, d > 256 ? heap.data() : stack);
  });
}

// ---------------------------------------------------------------------------------------------------
enum Op { EXP = 0, LOG = 1, ROW_SUM = 2, ROW_MAX = 3, RMS_NORM = 4, SWIGLU = 5, LOGPROBS = 6, ROPE = 7, SINCOS = 8,
          INV_FREQ = 9, ATTN_SOFTMAX = 10, ATTN_MERGE = 11 };
enum { RC_OK = 0, RC_OP = 1, RC_DTYPE = 2, RC_TOKEN = 3, RC_POSITION = 4, RC_DIM = 5 };

template <class TX, class TW>
int rms_norm_t(int ref, const int64_t* a, float eps) {
  const TX* x = (const TX*)a[0];
  const TW* w = (const TW*)a[5];
  TX* out = (TX*)a[7];
  if (ref) {
    Mxcsr guard;
    s_rms_norm(x, a[2], a[3], a[4], w, eps, out);
  } else {
    v_rms_norm(x, a[2], a[3], a[4], w, eps, out, (int)a[8]);
  }
  return RC_OK;
}

template <class TG, class TU>
int swiglu_t(int ref, const int64_t* a) {
  const TG* g = (const TG*)a[0];
  const TU* u = (const TU*)a[2];
  const int64_t n = a[4];
  if (a[6] == 0) {
    if (ref) {
      Mxcsr guard;
      s_swiglu(g, u, n, (float*)a[5]);
    } else {
      v_swiglu(g, u, n, (float*)a[5], (int)a[7]);
    }
  } else if (a[6] == 1) {
    if (ref) {
      Mxcsr guard;
      s_swiglu(g, u, n, (uint16_t*)a[5]);
    } else {
      v_swiglu(g, u, n, (uint16_t*)a[5], (int)a[7]);
    }
  } else {
    return RC_DTYPE;
  }
  return RC_OK;
}

template <class TX>
int logprobs_t(int ref, const int64_t* a, float t) {
  const TX* x = (const TX*)a[0];
  const int64_t rows = a[2], v = a[3];
  const int64_t* tok = (const int64_t*)a[5];
  for (int64_t r = 0; r < rows; r++)
    if (tok[r] < 0 || tok[r] >= v) return RC_TOKEN;
  if (ref) {
    Mxcsr guard;
    s_logprobs(x, rows, v, a[4], tok, t, (float*)a[6]);
  } else {
    v_logprobs(x, rows, v, a[4], tok, t, (float*)a[6], (int)a[7]);
  }
  return RC_OK;
}

}  // namespace

extern "C" {

// The path this library was built for: 0 portable, 2 avx2, 5 avx512.
int rowwise_isa() { return ISA_ID; }

// One entry for every op: a holds pointers and sizes, d the floating-point parameters (see
// ordered_rowwise.py, which calls it). ref != 0: the scalar reference (one thread). 0 or an RC_ code.
int rowwise_call(int op, int ref, const int64_t* a, const double* d) {
  switch (op) {
    case EXP:
    case LOG: {  // a: src fp32, dst fp32, n, threads
      const float* x = (const float*)a[0];
      float* y = (float*)a[1];
      const int64_t n = a[2];
      if (ref) {
        Mxcsr guard;
        for (int64_t i = 0; i < n; i++) y[i] = op == EXP ? s_exp(x[i]) : s_log(x[i]);
      } else if (op == EXP) {
        v_elementwise<false>(x, y, n, (int)a[3]);
      } else {
        v_elementwise<true>(x, y, n, (int)a[3]);
      }
      return RC_OK;
    }
    case ROW_SUM:
    case ROW_MAX: {  // a: x fp32, rows, L, ld, out fp32 [rows], threads
      const float* x = (const float*)a[0];
      const int64_t rows = a[1], n = a[2], ld = a[3];
      float* out = (float*)a[4];
      if (ref) {
        Mxcsr guard;
        for (int64_t r = 0; r < rows; r++) {
          const float* xr = x + r * ld;
          out[r] = canon(op == ROW_SUM ? s_row_sum(n, [&](int64_t i) { return xr[i]; })
                                       : s_row_max(n, [&](int64_t i) { return xr[i]; }));
        }
      } else {
        for_rows(rows, n, (int)a[5], [&](int64_t r) {
          out[r] = canon(op == ROW_SUM ? v_row_sum(x + r * ld, n) : v_row_max(x + r * ld, n));
        });
      }
      return RC_OK;
    }
    case RMS_NORM: {  // a: x, x dtype, rows, H, ldx, w, w dtype, out [rows, H] (x dtype), threads; d: eps
      const float eps = (float)d[0];
      const int64_t key = a[1] * 2 + a[6];
      if (key == 0) return rms_norm_t<float, float>(ref, a, eps);
      if (key == 1) return rms_norm_t<float, uint16_t>(ref, a, eps);
      if (key == 2) return rms_norm_t<uint16_t, float>(ref, a, eps);
      if (key == 3) return rms_norm_t<uint16_t, uint16_t>(ref, a, eps);
      return RC_DTYPE;
    }
    case SWIGLU: {  // a: g, g dtype, u, u dtype, n, out, out dtype, threads
      const int64_t key = a[1] * 2 + a[3];
      if (key == 0) return swiglu_t<float, float>(ref, a);
      if (key == 1) return swiglu_t<float, uint16_t>(ref, a);
      if (key == 2) return swiglu_t<uint16_t, float>(ref, a);
      if (key == 3) return swiglu_t<uint16_t, uint16_t>(ref, a);
      return RC_DTYPE;
    }
    case LOGPROBS: {  // a: x, x dtype, rows, V, ldx, tokens int64, out fp32 [rows], threads; d: T
      const float t = (float)d[0];
      if (a[1] == 0) return logprobs_t<float>(ref, a, t);
      if (a[1] == 1) return logprobs_t<uint16_t>(ref, a, t);
      return RC_DTYPE;
    }
    case ROPE: {  // a: positions int64 [n], n, D, cos [n, D], sin [n, D], threads; d: theta
      const int64_t* pos = (const int64_t*)a[0];
      const int64_t n = a[1], dim = a[2];
      if (dim < 2 || dim % 2) return RC_DIM;
      for (int64_t r = 0; r < n; r++)
        if (pos[r] < 0 || pos[r] >= (int64_t(1) << 24)) return RC_POSITION;
      if (ref) {
        Mxcsr guard;
        s_rope(pos, n, dim, d[0], (float*)a[3], (float*)a[4]);
      } else {
        v_rope(pos, n, dim, d[0], (float*)a[3], (float*)a[4], (int)a[5]);
      }
      return RC_OK;
    }
    case SINCOS: {  // a: angles fp32, n, sin, cos, threads
      const float* x = (const float*)a[0];
      const int64_t n = a[1];
      float* s = (float*)a[2];
      float* c = (float*)a[3];
      if (ref) {
        Mxcsr guard;
        for (int64_t i = 0; i < n; i++) {
          s_sincos(x[i], s[i], c[i]);
          s[i] = canon(s[i]);
          c[i] = canon(c[i]);
        }
      } else {
        v_sincos_n(x, n, s, c, (int)a[4]);
      }
      return RC_OK;
    }
    case INV_FREQ: {  // a: D, out fp32 [D/2]; d: theta
      if (a[0] < 2 || a[0] % 2) return RC_DIM;
      Mxcsr guard;
      inv_freq(a[0], d[0], (float*)a[1]);
      return RC_OK;
    }
    case ATTN_SOFTMAX: {  // a: s, keep (0: none), p, m, l, B*Hkv, Hkv, R, n, T, j, threads; d: scale
      if (ref) return RC_OP;  // defined by the torch ops it replaces (attention.py); tested against them
      const float* s = (const float*)a[0];
      const float* keep = (const float*)a[1];
      float* p = (float*)a[2];
      float* m = (float*)a[3];
      float* l = (float*)a[4];
      const int64_t bh = a[5], hkv = a[6], r = a[7], n = a[8], t = a[9], j = a[10];
      const float scale = (float)d[0];
      // Row (bh, q) of the scores [B*Hkv, R, n, T]; its mask row keep[b, q] of [B, R, n - j, T].
      for_rows(bh * r, n * t, (int)a[11], [&](int64_t row) {
        const int64_t b = row / (hkv * r), q = row % r;
        const float* kr = keep ? keep + (b * r + q) * (n - j) * t : nullptr;
        attn_softmax_row(s + row * n * t, n, t, scale, j, kr, p + row * t, bh * r * t, m + row, l + row, bh * r);
      });
      return RC_OK;
    }
    case ATTN_MERGE: {  // a: m, l, acc, out, out dtype, kt, rows, D, threads
      if (ref) return RC_OP;
      const float* m = (const float*)a[0];
      const float* l = (const float*)a[1];
      const float* acc = (const float*)a[2];
      if (a[4] == 0) {
        attn_merge(m, l, acc, a[5], a[6], a[7], (float*)a[3], (int)a[8]);
      } else if (a[4] == 1) {
        attn_merge(m, l, acc, a[5], a[6], a[7], (uint16_t*)a[3], (int)a[8]);
      } else {
        return RC_DTYPE;
      }
      return RC_OK;
    }
    default:
      return RC_OP;
  }
}

}  // extern "C"
