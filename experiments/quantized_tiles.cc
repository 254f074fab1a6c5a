// Standalone prototype (not built by hsdjax): one 4-bit block-quantized matmul tile, single thread,
// weights L2-resident, four ways:
//   A: float32 multiply-add chains on the decoded weights (the kernel's default scheme);
//   B: x rounded to bfloat16, codes exact in bfloat16, AVX512-BF16 dot products (2 k per instruction),
//      block scale and offset applied once per block (`--cpu-matmul bf16x`);
//   C: x quantized to int8 per row and 32-k block (scale max|x|/127), codes as u8 re-laid out four k per
//      lane, AVX512-VNNI (4 k per instruction), scale and offset once per block;
//   D: C on A's layout, one byte permute per four k rows (what `--cpu-matmul int8x` runs).
// Prints the max error of A-C against a float64 product, max |D - C| (0), and the median time per M.
//   g++ -O3 -march=native -ffp-contract=fast -o /tmp/quantized_tiles experiments/quantized_tiles.cc
//   /tmp/quantized_tiles 576 1536; /tmp/quantized_tiles 1536 576
// Needs AVX512-BF16, AVX512-VNNI and AVX512-VBMI.
#include <immintrin.h>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>
#include <algorithm>
#include <random>

typedef float v16 __attribute__((vector_size(64)));
constexpr int P = 32, L = 32;  // panel columns, k per block

// A: layout per panel: per block: s[32], o[32] f32 + 32 rows x 16 bytes (col j low nibble, j+16 high)
template <int MT>
void tileA(const float* x, int K, const uint8_t* panel, float* y, int N) {
  v16 a0[MT], a1[MT];
  for (int m = 0; m < MT; ++m) { a0[m] = v16{}; a1[m] = v16{}; }
  const int blk_bytes = 256 + L * 16;
  for (int b = 0; b < K / L; ++b) {
    const uint8_t* blk = panel + b * blk_bytes;
    v16 d0, d1, o0, o1;
    memcpy(&d0, blk, 64); memcpy(&d1, blk + 64, 64); memcpy(&o0, blk + 128, 64); memcpy(&o1, blk + 192, 64);
    for (int kk = 0; kk < L; ++kk) {
      __m128i raw = _mm_loadu_si128((const __m128i*)(blk + 256 + kk * 16));
      __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(15));
      __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15));
      __m512 flo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
      __m512 fhi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
      v16 w0, w1; memcpy(&w0, &flo, 64); memcpy(&w1, &fhi, 64);
      w0 = w0 * d0 + o0; w1 = w1 * d1 + o1;
      const int k = b * L + kk;
      for (int m = 0; m < MT; ++m) { const float xv = x[m * K + k]; a0[m] += xv * w0; a1[m] += xv * w1; }
    }
  }
  for (int m = 0; m < MT; ++m) { memcpy(y + m * N, &a0[m], 64); memcpy(y + m * N + 16, &a1[m], 64); }
}

// B: layout per panel: per block: s[32], o[32] f32 + 16 k-pairs x 32 bytes (byte j: low nibble code of
// (col j/2, k0 + j%2), high nibble (col 16 + j/2, k0 + j%2)). xb: x as bf16 pairs (uint32 per k-pair),
// xs: per row per block the sum of the bf16-rounded x (float).
template <int MT>
void tileB(const uint32_t* xb, const float* xs, int K, const uint8_t* panel, float* y, int N) {
  const __m512i lut = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
      0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080,
      0x4040, 0x4000, 0x3f80, 0x0000);
  __m512 a0[MT], a1[MT];
  for (int m = 0; m < MT; ++m) { a0[m] = _mm512_setzero_ps(); a1[m] = _mm512_setzero_ps(); }
  const int blk_bytes = 256 + (L / 2) * 32;
  const int nb = K / L;
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * blk_bytes;
    __m512 i0[MT], i1[MT];
    for (int m = 0; m < MT; ++m) { i0[m] = _mm512_setzero_ps(); i1[m] = _mm512_setzero_ps(); }
    for (int kp = 0; kp < L / 2; ++kp) {
      __m256i raw = _mm256_loadu_si256((const __m256i*)(blk + 256 + kp * 32));
      __m256i lo = _mm256_and_si256(raw, _mm256_set1_epi8(15));
      __m256i hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), _mm256_set1_epi8(15));
      __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(lo), lut);
      __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(hi), lut);
      const int k2 = b * (L / 2) + kp;
      for (int m = 0; m < MT; ++m) {
        __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xb[m * (K / 2) + k2]);
        i0[m] = _mm512_dpbf16_ps(i0[m], xv, w0);
        i1[m] = _mm512_dpbf16_ps(i1[m], xv, w1);
      }
    }
    __m512 d0 = _mm512_loadu_ps((const float*)blk), d1 = _mm512_loadu_ps((const float*)(blk + 64));
    __m512 o0 = _mm512_loadu_ps((const float*)(blk + 128)), o1 = _mm512_loadu_ps((const float*)(blk + 192));
    for (int m = 0; m < MT; ++m) {
      __m512 sx = _mm512_set1_ps(xs[m * nb + b]);
      a0[m] = _mm512_fmadd_ps(d0, i0[m], _mm512_fmadd_ps(o0, sx, a0[m]));
      a1[m] = _mm512_fmadd_ps(d1, i1[m], _mm512_fmadd_ps(o1, sx, a1[m]));
    }
  }
  for (int m = 0; m < MT; ++m) { _mm512_storeu_ps(y + m * N, a0[m]); _mm512_storeu_ps(y + m * N + 16, a1[m]); }
}


// C: int8 activations (per row per 32-k block: scale sq = max|x|/127, xq = round(x/sq)) against the 4-bit
// codes with AVX512-VNNI (u8 x s8, 4 k per 32-bit lane). Layout per block: s[32], o[32] f32 + 8 k-quads x
// 64 bytes (byte 4*j + r: low nibble code(col j, k0 + r), high nibble code(col j + 16, k0 + r)).
template <int MT>
void tileC(const uint32_t* xq, const float* sq, const float* xs, int K, const uint8_t* panel, float* y, int N) {
  __m512 a0[MT], a1[MT];
  for (int m = 0; m < MT; ++m) { a0[m] = _mm512_setzero_ps(); a1[m] = _mm512_setzero_ps(); }
  const int blk_bytes = 256 + (L / 4) * 64;
  const int nb = K / L;
  const __m512i nib = _mm512_set1_epi8(15);
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * blk_bytes;
    __m512i i0[MT], i1[MT];
    for (int m = 0; m < MT; ++m) { i0[m] = _mm512_setzero_si512(); i1[m] = _mm512_setzero_si512(); }
    for (int q = 0; q < L / 4; ++q) {
      const __m512i raw = _mm512_loadu_si512((const void*)(blk + 256 + q * 64));
      const __m512i lo = _mm512_and_si512(raw, nib);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
      const int k4 = b * (L / 4) + q;
      for (int m = 0; m < MT; ++m) {
        const __m512i xv = _mm512_set1_epi32((int)xq[m * (K / 4) + k4]);
        i0[m] = _mm512_dpbusd_epi32(i0[m], lo, xv);
        i1[m] = _mm512_dpbusd_epi32(i1[m], hi, xv);
      }
    }
    __m512 d0 = _mm512_loadu_ps((const float*)blk), d1 = _mm512_loadu_ps((const float*)(blk + 64));
    __m512 o0 = _mm512_loadu_ps((const float*)(blk + 128)), o1 = _mm512_loadu_ps((const float*)(blk + 192));
    for (int m = 0; m < MT; ++m) {
      const __m512 sx = _mm512_set1_ps(xs[m * nb + b]), s = _mm512_set1_ps(sq[m * nb + b]);
      a0[m] = _mm512_fmadd_ps(_mm512_mul_ps(d0, s), _mm512_cvtepi32_ps(i0[m]), _mm512_fmadd_ps(o0, sx, a0[m]));
      a1[m] = _mm512_fmadd_ps(_mm512_mul_ps(d1, s), _mm512_cvtepi32_ps(i1[m]), _mm512_fmadd_ps(o1, sx, a1[m]));
    }
  }
  for (int m = 0; m < MT; ++m) { _mm512_storeu_ps(y + m * N, a0[m]); _mm512_storeu_ps(y + m * N + 16, a1[m]); }
}

// D: as C, reading layout A (32 rows of 16 bytes per block): 4 consecutive k rows are 64 contiguous
// bytes; one byte permute gives C's quad layout.
template <int MT>
void tileD(const uint32_t* xq, const float* sq, const float* xs, int K, const uint8_t* panel, float* y, int N) {
  __m512 a0[MT], a1[MT];
  for (int m = 0; m < MT; ++m) { a0[m] = _mm512_setzero_ps(); a1[m] = _mm512_setzero_ps(); }
  const int blk_bytes = 256 + L * 16;
  const int nb = K / L;
  const __m512i nib = _mm512_set1_epi8(15);
  alignas(64) uint8_t idx[64];
  for (int j = 0; j < 16; ++j) for (int r = 0; r < 4; ++r) idx[4 * j + r] = 16 * r + j;
  const __m512i perm = _mm512_load_si512(idx);
  for (int b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * blk_bytes;
    __m512i i0[MT], i1[MT];
    for (int m = 0; m < MT; ++m) { i0[m] = _mm512_setzero_si512(); i1[m] = _mm512_setzero_si512(); }
    for (int q = 0; q < L / 4; ++q) {
      const __m512i raw = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512((const void*)(blk + 256 + q * 64)));
      const __m512i lo = _mm512_and_si512(raw, nib);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nib);
      const int k4 = b * (L / 4) + q;
      for (int m = 0; m < MT; ++m) {
        const __m512i xv = _mm512_set1_epi32((int)xq[m * (K / 4) + k4]);
        i0[m] = _mm512_dpbusd_epi32(i0[m], lo, xv);
        i1[m] = _mm512_dpbusd_epi32(i1[m], hi, xv);
      }
    }
    __m512 d0 = _mm512_loadu_ps((const float*)blk), d1 = _mm512_loadu_ps((const float*)(blk + 64));
    __m512 o0 = _mm512_loadu_ps((const float*)(blk + 128)), o1 = _mm512_loadu_ps((const float*)(blk + 192));
    for (int m = 0; m < MT; ++m) {
      const __m512 sx = _mm512_set1_ps(xs[m * nb + b]), s = _mm512_set1_ps(sq[m * nb + b]);
      a0[m] = _mm512_fmadd_ps(_mm512_mul_ps(d0, s), _mm512_cvtepi32_ps(i0[m]), _mm512_fmadd_ps(o0, sx, a0[m]));
      a1[m] = _mm512_fmadd_ps(_mm512_mul_ps(d1, s), _mm512_cvtepi32_ps(i1[m]), _mm512_fmadd_ps(o1, sx, a1[m]));
    }
  }
  for (int m = 0; m < MT; ++m) { _mm512_storeu_ps(y + m * N, a0[m]); _mm512_storeu_ps(y + m * N + 16, a1[m]); }
}

static uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); return (uint16_t)(u >> 16);
}
static float from_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

template <int MT>
double run(int mode, const uint32_t* xq, const float* sq, const float* xsq, const uint8_t* pc, const float* x, const uint32_t* xb, const float* xs, int K, int N, const uint8_t* pa,
           const uint8_t* pb, float* y, int reps) {
  const int panels = N / P;
  const size_t ba = (size_t)(K / L) * (256 + L * 16), bb = (size_t)(K / L) * (256 + (L / 2) * 32), bc = (size_t)(K / L) * (256 + (L / 4) * 64);
  auto t0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r)
    for (int p = 0; p < panels; ++p) {
      if (mode == 3) tileD<MT>(xq, sq, xsq, K, pa + p * ba, y + p * P, N);
      else if (mode == 2) tileC<MT>(xq, sq, xsq, K, pc + p * bc, y + p * P, N);
      else if (mode == 1) tileB<MT>(xb, xs, K, pb + p * bb, y + p * P, N);
      else tileA<MT>(x, K, pa + p * ba, y + p * P, N);
    }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
}

int main(int argc, char** argv) {
  const int K = argc > 1 ? atoi(argv[1]) : 576, N = argc > 2 ? atoi(argv[2]) : 1536, M = 8;
  std::mt19937 rng(0);
  std::uniform_int_distribution<int> code(0, 15);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int panels = N / P, nb = K / L;
  // weights: codes c[n][k], per (block, col) scale/offset
  std::vector<uint8_t> c((size_t)N * K);
  std::vector<float> s((size_t)N * nb), o((size_t)N * nb);
  for (auto& v : c) v = code(rng);
  for (size_t i = 0; i < s.size(); ++i) { s[i] = 0.01f * std::fabs(nd(rng)) + 1e-3f; o[i] = -8 * s[i] + 0.001f * nd(rng); }
  const size_t ba = (size_t)nb * (256 + L * 16), bb = (size_t)nb * (256 + (L / 2) * 32);
  const size_t bc = (size_t)nb * (256 + (L / 4) * 64);
  std::vector<uint8_t> pa(ba * panels), pb(bb * panels), pc(bc * panels);
  for (int p = 0; p < panels; ++p)
    for (int b = 0; b < nb; ++b) {
      uint8_t* A = pa.data() + p * ba + b * (256 + L * 16);
      uint8_t* B = pb.data() + p * bb + b * (256 + (L / 2) * 32);
      for (int j = 0; j < 32; ++j) {
        const int n = p * P + j;
        memcpy(A + 4 * j, &s[(size_t)n * nb + b], 4); memcpy(A + 128 + 4 * j, &o[(size_t)n * nb + b], 4);
        memcpy(B + 4 * j, &s[(size_t)n * nb + b], 4); memcpy(B + 128 + 4 * j, &o[(size_t)n * nb + b], 4);
      }
      for (int kk = 0; kk < L; ++kk)
        for (int j = 0; j < 16; ++j) {
          const int k = b * L + kk;
          A[256 + kk * 16 + j] = c[(size_t)(p * P + j) * K + k] | (c[(size_t)(p * P + j + 16) * K + k] << 4);
        }
      for (int kp = 0; kp < L / 2; ++kp)
        for (int j = 0; j < 32; ++j) {
          const int k = b * L + 2 * kp + (j % 2), col = j / 2;
          B[256 + kp * 32 + j] = c[(size_t)(p * P + col) * K + k] | (c[(size_t)(p * P + col + 16) * K + k] << 4);
              {
        uint8_t* C = pc.data() + p * bc + b * (256 + (L / 4) * 64);
        memcpy(C, B, 256);
        for (int q = 0; q < L / 4; ++q)
          for (int j = 0; j < 16; ++j)
            for (int r = 0; r < 4; ++r) {
              const int k = b * L + 4 * q + r;
              C[256 + q * 64 + 4 * j + r] = c[(size_t)(p * P + j) * K + k] | (c[(size_t)(p * P + j + 16) * K + k] << 4);
            }
      }
    }
    }
  std::vector<float> x((size_t)M * K), xs((size_t)M * nb, 0.f);
  std::vector<uint32_t> xb((size_t)M * K / 2);
  for (auto& v : x) v = nd(rng);
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < K; k += 2) {
      uint16_t h0 = to_bf16(x[m * K + k]), h1 = to_bf16(x[m * K + k + 1]);
      xb[m * (K / 2) + k / 2] = h0 | ((uint32_t)h1 << 16);
      xs[m * nb + k / L] += from_bf16(h0) + from_bf16(h1);
    }
  std::vector<uint32_t> xq((size_t)M * K / 4);
  std::vector<float> sq((size_t)M * nb), xsq((size_t)M * nb, 0.f);
  for (int m = 0; m < M; ++m)
    for (int b = 0; b < nb; ++b) {
      float amax = 0;
      for (int k = b * L; k < (b + 1) * L; ++k) amax = std::max(amax, std::fabs(x[m * K + k]));
      const float scale = amax / 127.f, inv = amax > 0 ? 127.f / amax : 0.f;
      sq[m * nb + b] = scale;
      int8_t* q8 = reinterpret_cast<int8_t*>(xq.data() + m * (K / 4));
      for (int k = b * L; k < (b + 1) * L; ++k) {
        const int v = (int)std::nearbyint(x[m * K + k] * inv);
        q8[k] = (int8_t)v;
        xsq[m * nb + b] += v * scale;
      }
    }
  auto R = [&](int mode, int mt, float* out, int reps) -> double {
    switch (mt) {
      case 1: return run<1>(mode, xq.data(), sq.data(), xsq.data(), pc.data(), x.data(), xb.data(), xs.data(), K, N, pa.data(), pb.data(), out, reps);
      case 2: return run<2>(mode, xq.data(), sq.data(), xsq.data(), pc.data(), x.data(), xb.data(), xs.data(), K, N, pa.data(), pb.data(), out, reps);
      case 4: return run<4>(mode, xq.data(), sq.data(), xsq.data(), pc.data(), x.data(), xb.data(), xs.data(), K, N, pa.data(), pb.data(), out, reps);
      default: return run<8>(mode, xq.data(), sq.data(), xsq.data(), pc.data(), x.data(), xb.data(), xs.data(), K, N, pa.data(), pb.data(), out, reps);
    }
  };
  std::vector<float> ya((size_t)M * N), ybv((size_t)M * N), yc((size_t)M * N);
  R(0, 8, ya.data(), 1); R(1, 8, ybv.data(), 1); R(2, 8, yc.data(), 1); std::vector<float> yd((size_t)M * N); R(3, 8, yd.data(), 1); double dd = 0; for (size_t i = 0; i < yd.size(); ++i) dd = std::max(dd, (double)std::fabs(yd[i] - yc[i])); printf("max|D - C| = %g\n", dd);
  double ea = 0, eb = 0, ec = 0, ref2 = 0;
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      double r = 0;
      for (int k = 0; k < K; ++k) {
        const float w = (float)c[(size_t)n * K + k] * s[(size_t)n * nb + k / L] + o[(size_t)n * nb + k / L];
        r += (double)x[m * K + k] * w;
      }
      ea = std::max(ea, std::fabs(ya[m * N + n] - r)); eb = std::max(eb, std::fabs(ybv[m * N + n] - r));
      ec = std::max(ec, std::fabs(yc[m * N + n] - r));
      ref2 += r * r;
    }
  printf("K=%d N=%d rms(y)=%.4g max|err| A(f32)=%.3g B(bf16 x)=%.3g C(int8 x)=%.3g\n", K, N, std::sqrt(ref2 / (M * N)), ea, eb, ec);
  std::vector<float> y((size_t)M * N);
  const int reps = 200;
  for (int mt : {1, 2, 4, 8}) {
    std::vector<double> t[4];
    for (int it = 0; it < 15; ++it) for (int mode = 0; mode < 4; ++mode) t[mode].push_back(R(mode, mt, y.data(), reps));
    for (auto& v : t) std::sort(v.begin(), v.end());
    printf("M=%d  A %.1f us  B %.1f us  C %.1f us  D %.1f us  A/B %.2f  B/C %.2f  B/D %.2f\n", mt, t[0][7] * 1e6, t[1][7] * 1e6, t[2][7] * 1e6, t[3][7] * 1e6,
           t[0][7] / t[1][7], t[1][7] / t[2][7], t[1][7] / t[3][7]);
  }
}
