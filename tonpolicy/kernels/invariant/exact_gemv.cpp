// The compiled exact products of tonpolicy.kernels.invariant.exact_gemv (see its docstring): exact_gemm's bits for
// few rows, by construction. Built by exact_gemv.library_path() with g++; no torch headers (a ~1-8 s build).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// Half to even (the default rounding mode), exact for |v| < 2^51; kept as written without -ffast-math.
static inline double round_even(double v) {
  const double magic = 6755399441055744.0;  // 1.5 * 2^52
  return (v + magic) - magic;
}
static inline double pow2(int e) {
  uint64_t u = (uint64_t)(int64_t)(e + 1023) << 52;
  double d;
  std::memcpy(&d, &u, 8);
  return d;
}
template <int DT> static inline double load(const void* p, int64_t i) {
  if (DT == 0) return (double)((const float*)p)[i];
  uint32_t u = (uint32_t)((const uint16_t*)p)[i] << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return (double)f;
}

// 8 lanes of fp64 (GCC vector extensions: AVX-512, or two AVX2 halves, or whatever the CPU has).
typedef double d8 __attribute__((vector_size(64)));
typedef float f8 __attribute__((vector_size(32)));
typedef uint32_t u8 __attribute__((vector_size(32)));
typedef uint16_t h8 __attribute__((vector_size(16)));
template <int DT> static inline d8 load8(const void* p, int64_t i) {
  f8 f;
  if (DT == 0) {
    std::memcpy(&f, (const float*)p + i, 32);
  } else {
    h8 h;
    std::memcpy(&h, (const uint16_t*)p + i, 16);
    u8 u = __builtin_convertvector(h, u8) << 16;
    std::memcpy(&f, &u, 32);
  }
  return __builtin_convertvector(f, d8);
}

// NC columns (weight rows n.., shard c) against R quantized A lines qa [R][ks]: integer products summed
// exactly in any order (2 x 8 lanes per column and line, 2*NC*R independent chains, then the tail).
template <int DT, int R, int NC>
static inline void block(const void* w, int64_t k_all, int64_t off, int64_t ks, const double* su, const double* qa,
                         double (*acc)[R]) {
  const d8 magic = d8{} + 6755399441055744.0;
  d8 a[NC][R][2];
  for (int c = 0; c < NC; c++)
    for (int r = 0; r < R; r++) a[c][r][0] = a[c][r][1] = d8{} + 0.0;
  int64_t k = 0;
  for (; k + 16 <= ks; k += 16) {
    d8 b0[NC], b1[NC];
    for (int c = 0; c < NC; c++) {
      b0[c] = (load8<DT>(w, off + c * k_all + k) * su[c] + magic) - magic;  // round half to even
      b1[c] = (load8<DT>(w, off + c * k_all + k + 8) * su[c] + magic) - magic;
    }
    for (int r = 0; r < R; r++) {
      d8 q0, q1;
      std::memcpy(&q0, qa + r * ks + k, 64);
      std::memcpy(&q1, qa + r * ks + k + 8, 64);
      for (int c = 0; c < NC; c++) {
        a[c][r][0] += q0 * b0[c];
        a[c][r][1] += q1 * b1[c];
      }
    }
  }
  for (; k + 8 <= ks; k += 8) {
    for (int c = 0; c < NC; c++) {
      d8 b = (load8<DT>(w, off + c * k_all + k) * su[c] + magic) - magic;
      for (int r = 0; r < R; r++) {
        d8 q;
        std::memcpy(&q, qa + r * ks + k, 64);
        a[c][r][0] += q * b;
      }
    }
  }
  for (int c = 0; c < NC; c++)
    for (int r = 0; r < R; r++) {
      d8 v = a[c][r][0] + a[c][r][1];
      double t = 0.0;
      for (int l = 0; l < 8; l++) t += v[l];
      for (int64_t j = k; j < ks; j++) t += qa[r * ks + j] * round_even(load<DT>(w, off + c * k_all + j) * su[c]);
      acc[c][r] = t;
    }
}

template <int DT, int R>
static void columns(const void* w, int64_t n_cols, int64_t k_all, int64_t c, int64_t ks, const double* su,
                    const double* sd, const double* qa, const double* sa, int rows, int slices, int bits_a,
                    int64_t n_all, float* out, int threads) {
  const double lo_scale = pow2(-bits_a);
  const int64_t pairs = (n_cols + 1) / 2;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t p = 0; p < pairs; p++) {
    const int64_t n0 = 2 * p;
    const int nc = n0 + 1 < n_cols ? 2 : 1;
    double acc[2][R];
    if (nc == 2)
      block<DT, R, 2>(w, k_all, n0 * k_all + c * ks, ks, su + c * n_all + n0, qa, acc);
    else
      block<DT, R, 1>(w, k_all, n0 * k_all + c * ks, ks, su + c * n_all + n0, qa, acc);
    for (int j = 0; j < nc; j++) {
      const int64_t n = n0 + j;
      for (int m = 0; m < rows; m++) {
        double v = acc[j][m];
        if (slices == 2) v = v + acc[j][rows + m] * lo_scale;
        v = v * sa[m];
        v = v * sd[c * n_all + n];
        out[(c * rows + m) * n_all + n] = (float)v;
      }
    }
  }
}

template <int DT>
static void dispatch(int R, const void* w, int64_t n, int64_t k, int64_t c, int64_t ks, const double* su,
                     const double* sd, const double* qa, const double* sa, int rows, int slices, int bits_a,
                     float* out, int threads) {
  switch (R) {
#define CASE(r) case r: columns<DT, r>(w, n, k, c, ks, su, sd, qa, sa, rows, slices, bits_a, n, out, threads); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
  }
}

// x [rows, k] (dtype xdt), w [n, k] (dtype wdt), both contiguous; out [shards, rows, n] fp32.
extern "C" int exact_gemv(const void* x, int xdt, const void* w, int wdt, int64_t rows, int64_t k, int64_t n,
                          int64_t shards, int bits_a, int slices, const double* su, const double* sd, float* out,
                          int threads) {
  const int64_t ks = k / shards;
  const int R = (int)(rows * slices);
  if (R < 1 || R > 8) return 1;
  std::vector<double> qa(R * ks), sa(rows);
  for (int64_t c = 0; c < shards; c++) {
    for (int64_t m = 0; m < rows; m++) {  // quantize A's row m over shard c, as exact_gemm.quantize
      const int64_t base = m * k + c * ks;
      double amax = 0.0;
      for (int64_t i = 0; i < ks; i++) {
        double v = std::fabs(xdt == 0 ? load<0>(x, base + i) : load<1>(x, base + i));
        if (v > amax || std::isnan(v)) amax = v;
      }
      int e = 0;
      std::frexp(amax, &e);
      if (!std::isfinite(amax)) return 2;  // the torch path decides what a NaN or inf gives
      const double up = pow2(bits_a - e);
      for (int64_t i = 0; i < ks; i++) {
        double s = (xdt == 0 ? load<0>(x, base + i) : load<1>(x, base + i)) * up;
        double q0 = round_even(s);
        qa[m * ks + i] = q0;
        if (slices == 2) qa[(rows + m) * ks + i] = round_even((s - q0) * pow2(bits_a));
      }
      sa[m] = pow2(e - bits_a);
    }
    if (wdt == 0)
      dispatch<0>(R, w, n, k, c, ks, su, sd, qa.data(), sa.data(), (int)rows, slices, bits_a, out, threads);
    else
      dispatch<1>(R, w, n, k, c, ks, su, sd, qa.data(), sa.data(), (int)rows, slices, bits_a, out, threads);
  }
  return 0;
}

// One line of A (fp64 values, exact) quantized as exact_gemm.quantize(a, -1, bits, slices): slice 0 to
// q[0..k), slice 1 to q[stride..stride+k); returns the line's scale 2^(e - bits), or 0 for NaN/inf.
static double quantize_line(const double* v, int64_t k, int bits, int slices, double* q, int64_t stride) {
  double amax = 0.0;
  for (int64_t i = 0; i < k; i++) {
    double a = std::fabs(v[i]);
    if (a > amax || std::isnan(a)) amax = a;  // NaN sticks (a later number must not replace it)
  }
  if (!std::isfinite(amax)) return 0.0;
  int e = 0;
  std::frexp(amax, &e);
  const double up = pow2(bits - e), lo = pow2(bits);
  for (int64_t i = 0; i < k; i++) {
    double s = v[i] * up;
    double q0 = round_even(s);
    q[i] = q0;
    if (slices == 2) q[stride + i] = round_even((s - q0) * lo);
  }
  return pow2(e - bits);
}

// C[b] = A[b] @ B[b] for fp32 A [batch, m, k] and B [batch, k, n] (contiguous), as exact_gemm does it:
// mode 0 (matmul_as): B quantized per column (over k), A per row; mode 1 (pv_product): B quantized per
// row (over n), its scale folded into A's columns before A is quantized per row, B's column scale 1.
// Lanes run over n, 8 columns at a time; every sum is of exact integers.
template <int R>
static void bmm_batch(const float* a, const float* b, int64_t m, int64_t k, int64_t n, int bits_a, int bits_b,
                      int slices, int mode, float* out, double* buf) {
  double* qa = buf;             // [R][k]
  double* row = qa + R * k;     // [k]
  double* sa = row + k;         // [m]
  double* bu = sa + m;          // mode 0: [n] column scale up; mode 1: [k] row scale up
  double* bd = bu + (n > k ? n : k);  // mode 0: [n] column scale down
  if (mode == 0) {
    for (int64_t j = 0; j < n; j++) bu[j] = 0.0;
    for (int64_t i = 0; i < k; i++)
      for (int64_t j = 0; j < n; j++) {
        double v = std::fabs((double)b[i * n + j]);
        if (v > bu[j] || std::isnan(v)) bu[j] = v;  // NaN sticks
      }
    for (int64_t j = 0; j < n; j++) {
      if (!std::isfinite(bu[j])) return;  // caller sees the flag below
      int e = 0;
      std::frexp(bu[j], &e);
      bu[j] = pow2(bits_b - e);
      bd[j] = pow2(e - bits_b);
    }
  } else {
    for (int64_t i = 0; i < k; i++) {
      double amax = 0.0;
      for (int64_t j = 0; j < n; j++) {
        double v = std::fabs((double)b[i * n + j]);
        if (v > amax || std::isnan(v)) amax = v;  // NaN sticks
      }
      if (!std::isfinite(amax)) return;
      int e = 0;
      std::frexp(amax, &e);
      bu[i] = pow2(bits_b - e);
      bd[i] = pow2(e - bits_b);  // v's per-key scale, folded into A
    }
  }
  for (int64_t r = 0; r < m; r++) {
    for (int64_t i = 0; i < k; i++) row[i] = mode == 0 ? (double)a[r * k + i] : (double)a[r * k + i] * bd[i];
    sa[r] = quantize_line(row, k, bits_a, slices, qa + r * k, m * k);
    if (sa[r] == 0.0) return;
  }
  const d8 magic = d8{} + 6755399441055744.0;
  const double lo_scale = pow2(-bits_a);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    d8 acc[R];
    for (int r = 0; r < R; r++) acc[r] = d8{} + 0.0;
    d8 su;
    if (mode == 0) std::memcpy(&su, bu + j, 64);
    for (int64_t i = 0; i < k; i++) {
      f8 f;
      std::memcpy(&f, b + i * n + j, 32);
      d8 bq = (__builtin_convertvector(f, d8) * (mode == 0 ? su : d8{} + bu[i]) + magic) - magic;
      for (int r = 0; r < R; r++) acc[r] += qa[r * k + i] * bq;
    }
    for (int64_t r = 0; r < m; r++)
      for (int l = 0; l < 8; l++) {
        double v = acc[r][l];
        if (slices == 2) v = v + acc[m + r][l] * lo_scale;
        v = v * sa[r];
        if (mode == 0) v = v * bd[j + l];
        out[r * n + j + l] = (float)v;
      }
  }
  for (; j < n; j++) {
    double acc[R];
    for (int r = 0; r < R; r++) acc[r] = 0.0;
    for (int64_t i = 0; i < k; i++) {
      double bq = round_even((double)b[i * n + j] * (mode == 0 ? bu[j] : bu[i]));
      for (int r = 0; r < R; r++) acc[r] += qa[r * k + i] * bq;
    }
    for (int64_t r = 0; r < m; r++) {
      double v = acc[r];
      if (slices == 2) v = v + acc[m + r] * lo_scale;
      v = v * sa[r];
      if (mode == 0) v = v * bd[j];
      out[r * n + j] = (float)v;
    }
  }
}

// Rows are taken 16 / slices at a time (the accumulators live in registers): a row's quantization and
// sums depend on that row and B alone, so the chunking changes no bit.
extern "C" int exact_bmm(const float* a, const float* b, int64_t batch, int64_t m, int64_t k, int64_t n, int bits_a,
                         int bits_b, int slices, int mode, float* out, int threads) {
  if (m < 1 || slices < 1 || slices > 2) return 1;
  const int64_t chunk = 16 / slices;
  const int64_t rows = m < chunk ? m : chunk;
  const int64_t words = rows * slices * k + k + rows + 3 * (n > k ? n : k) + 8;
  int bad = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && batch > 1) reduction(| : bad)
  {
    std::vector<double> buf(words);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < batch; t++) {
      for (int64_t r0 = 0; r0 < m; r0 += chunk) {
        const int64_t mc = m - r0 < chunk ? m - r0 : chunk;
        const float* ac = a + (t * m + r0) * k;
        const float* bc = b + t * k * n;
        float* o = out + (t * m + r0) * n;
        o[0] = std::nanf("");  // a bmm_batch that stops early (NaN/inf operands) leaves this flag
        switch ((int)(mc * slices)) {
#define CASE(r) \
  case r: bmm_batch<r>(ac, bc, mc, k, n, bits_a, bits_b, slices, mode, o, buf.data()); break;
          CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
          CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
        }
        if (std::isnan(o[0])) bad |= 1;
      }
    }
  }
  return bad ? 2 : 0;
}

// invariant_linear.tree_sum's fp32 pairwise tree over parts [c][len]: ((p0+p1)+(p2+p3)), an odd one out
// carried to the next level as it is; each add one IEEE fp32 rounding, as torch's.
extern "C" void tree_sum_f32(const float* parts, int64_t c, int64_t len, float* out) {
  std::vector<float> level(c);
  for (int64_t i = 0; i < len; i++) {
    int64_t n = c;
    for (int64_t j = 0; j < n; j++) level[j] = parts[j * len + i];
    while (n > 1) {
      int64_t h = 0;
      for (int64_t j = 0; j + 1 < n; j += 2) level[h++] = level[j] + level[j + 1];
      if (n % 2) level[h++] = level[n - 1];
      n = h;
    }
    out[i] = level[0];
  }
}

// A of exact_gemm.linear_partials' GEMM for many rows, as exact_gemm.quantize(x3, -1, bits_a, slices) with
// x3 = x [rows, k] (dtype xdt) cut into `shards` K-shards: integers qa [shards][slices * rows][k / shards]
// (slice 1's rows after slice 0's, as exact_matmul stacks them) and scales sa [shards][rows] = 2^(e - bits).
// Returns 2 for a NaN or inf (the torch path decides what it gives).
extern "C" int quantize_rows(const void* x, int xdt, int64_t rows, int64_t k, int64_t shards, int bits_a, int slices,
                             double* qa, double* sa) {
  const int64_t ks = k / shards;
  std::vector<double> line(ks);
  for (int64_t c = 0; c < shards; c++)
    for (int64_t m = 0; m < rows; m++) {
      const int64_t base = m * k + c * ks;
      for (int64_t i = 0; i < ks; i++) line[i] = xdt == 0 ? load<0>(x, base + i) : load<1>(x, base + i);
      const double s = quantize_line(line.data(), ks, bits_a, slices, qa + (c * slices * rows + m) * ks, rows * ks);
      if (s == 0.0) return 2;
      sa[c * rows + m] = s;
    }
  return 0;
}

// exact_matmul's scaling back of the integer products prod [shards][slices * rows][n]: (hi + lo * 2^-bits_a)
// * sa[row] * sb[column], each one IEEE fp64 op in that order, then one rounding to fp32 (out [shards][rows][n]).
extern "C" void scale_back(const double* prod, int64_t shards, int64_t rows, int64_t n, int slices, int bits_a,
                           const double* sa, const double* sb, float* out) {
  const double lo_scale = pow2(-bits_a);
  for (int64_t c = 0; c < shards; c++)
    for (int64_t m = 0; m < rows; m++) {
      const double* hi = prod + (c * slices * rows + m) * n;
      const double* lo = hi + rows * n;
      const double* col = sb + c * n;
      float* o = out + (c * rows + m) * n;
      const double s = sa[c * rows + m];
      for (int64_t j = 0; j < n; j++) {
        double v = hi[j];
        if (slices == 2) v = v + lo[j] * lo_scale;
        v = v * s;
        v = v * col[j];
        o[j] = (float)v;
      }
    }
}
