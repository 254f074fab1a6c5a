// hsdjax's CPU matmul for small M (an XLA FFI custom call; optional, built by `hsdjax cpu-matmul build`).
//
//   y[M, N] = x[M, K] @ W, with W packed in panels wp[N/32, K, 32] (float32), or in compressed panels
//   wq[N/32, K/L, B] (bytes) when every weight of W is exactly code * scale + offset in float32 for a
//   per-column scale (and offset) in each block of L rows of k, what a GGUF's block-quantized tensors
//   dequantize to. Two formats:
//     4-bit: L = 32, a block holds 32 scales and 32 offsets (f32), then 32 rows of 4-bit codes
//            (column j in the low nibble of byte j, column j + 16 in the high one): B = 768
//            (Q4_1, Q4_K);
//     8-bit: L = 16, 32 scales (f32), then 16 rows of int8 codes, no offset: B = 640 (Q8_0, Q6_K,
//            Q5_0, Q4_0).
//   The packer checked that code * scale is exact where there is an offset and that the weight is
//   what the decode gives, so fused or not the decode yields the weight's float32 bits, and the
//   compressed and float32 panels give bitwise-equal products while a one-token step, which streams
//   every weight once, reads 4-6x fewer bytes. Built with -ffp-contract=fast: the chains over k are
//   fused multiply-adds, the same in every tile.
//   Or in bfloat16 panels wb[N/32, K, 32] when every weight is a bfloat16 value (a drafter's trained
//   matrices): the decode is a shift, exact, and the product equals the float32 panels' bit for bit at
//   half the bytes.
//
// Every output is one multiply-add chain over k = 0 .. K-1 whatever M is, so a T-token tree pass and a
// one-token `ar` step compute bitwise-equal matmul outputs. A panel (K x 32 weights, contiguous) is read
// once for up to 8 rows of x; M > 8 sweeps it again per 8 rows. Chunks of panels are shared between
// the calling thread and XLA's own intra-op thread pool (no threads of its own).
#include <atomic>
#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
constexpr int64_t kPanel = 32;

// The two compressed formats (see the top of the file).
template <int BITS>
struct Format {
  static constexpr int64_t kRows = BITS == 4 ? 32 : 16;                // k per block
  static constexpr int64_t kHeader = (BITS == 4 ? 2 : 1) * kPanel * 4;  // scales (+ offsets), f32
  static constexpr int64_t kRowBytes = BITS * kPanel / 8;
  static constexpr int64_t kBlockBytes = kHeader + kRows * kRowBytes;
};

// 16 codes to 16 floats. GCC scalarizes a vector byte -> float conversion, hence intrinsics where the
// machine has AVX-512 and a plain loop elsewhere (same values either way: small integers are exact).
inline v16 BytesToFloat(u8x16 b, bool is_signed) {
#if defined(__AVX512F__)
  __m128i raw;
  __builtin_memcpy(&raw, &b, 16);
  const __m512 f = _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw));
  v16 out;
  __builtin_memcpy(&out, &f, 64);
  return out;
#else
  v16 out;
  for (int j = 0; j < 16; ++j) out[j] = is_signed ? static_cast<float>(static_cast<int8_t>(b[j])) : b[j];
  return out;
#endif
}

// The multiply-add chains of MT rows against one panel, whatever stores it: rows(use) calls
// use(k, w0, w1) with the panel's 32 weights of row k, k = 0 .. K-1 in order. One body for float32 and
// compressed panels, so their chains are the same by construction.
template <int MT, typename Rows>
inline void Chains(const float* x, int64_t k_len, float* y, int64_t n, Rows&& rows) {
  v16 a0[MT], a1[MT];
  for (int m = 0; m < MT; ++m) {
    a0[m] = v16{};
    a1[m] = v16{};
  }
  rows([&](int64_t k, const v16& w0, const v16& w1) {
    for (int m = 0; m < MT; ++m) {
      const float xv = x[m * k_len + k];
      a0[m] += xv * w0;
      a1[m] += xv * w1;
    }
  });
  for (int m = 0; m < MT; ++m) {
    __builtin_memcpy(y + m * n, &a0[m], 64);
    __builtin_memcpy(y + m * n + 16, &a1[m], 64);
  }
}

template <int MT>
void Tile(const float* x, int64_t k_len, const float* wp, float* y, int64_t n) {
  Chains<MT>(x, k_len, y, n, [&](auto&& use) {
    for (int64_t k = 0; k < k_len; ++k) {
      v16 w0, w1;
      __builtin_memcpy(&w0, wp + k * kPanel, 64);
      __builtin_memcpy(&w1, wp + k * kPanel + 16, 64);
      use(k, w0, w1);
    }
  });
}

// 16 bfloat16 values to float32: the 16 bits become the high half of the float (exact).
inline v16 Bf16ToFloat(const uint16_t* p) {
  u16x16 h;
  __builtin_memcpy(&h, p, 32);
  const u32x16 bits = __builtin_convertvector(h, u32x16) << 16;
  v16 out;
  __builtin_memcpy(&out, &bits, 64);
  return out;
}

// Same products as Tile on the bfloat16 panel's float32 values.
template <int MT>
void BTile(const float* x, int64_t k_len, const uint16_t* wb, float* y, int64_t n) {
  Chains<MT>(x, k_len, y, n, [&](auto&& use) {
    for (int64_t k = 0; k < k_len; ++k) use(k, Bf16ToFloat(wb + k * kPanel), Bf16ToFloat(wb + k * kPanel + 16));
  });
}

// The 32 weights of one k row of a compressed block: code * scale (exact) + offset.
template <int BITS>
inline void Decode(const uint8_t* codes, const v16& d0, const v16& d1, const v16& o0, const v16& o1, v16& w0,
                   v16& w1) {
  if constexpr (BITS == 4) {
    u8x16 c;
    __builtin_memcpy(&c, codes, 16);
    v16 lo = BytesToFloat(c & 15, false);  // columns 0-15 in the low nibbles
    v16 hi = BytesToFloat(c >> 4, false);  // columns 16-31 in the high ones
    w0 = lo * d0 + o0;
    w1 = hi * d1 + o1;
  } else {
    u8x16 c0, c1;  // int8 codes
    __builtin_memcpy(&c0, codes, 16);
    __builtin_memcpy(&c1, codes + 16, 16);
    w0 = BytesToFloat(c0, true) * d0;
    w1 = BytesToFloat(c1, true) * d1;
  }
}

// A block's scales (and offsets).
template <int BITS>
inline void Header(const uint8_t* blk, v16& d0, v16& d1, v16& o0, v16& o1) {
  __builtin_memcpy(&d0, blk, 64);
  __builtin_memcpy(&d1, blk + 64, 64);
  if constexpr (BITS == 4) {
    __builtin_memcpy(&o0, blk + 128, 64);
    __builtin_memcpy(&o1, blk + 192, 64);
  } else {
    o0 = v16{};
    o1 = v16{};
  }
}

// Walks a compressed panel row by row of k: use(k, w0, w1) with the row's 32 decoded weights.
template <int BITS, typename Use>
inline void WalkPanel(const uint8_t* panel, int64_t k_len, Use&& use) {
  using F = Format<BITS>;
  for (int64_t b = 0; b < k_len / F::kRows; ++b) {
    const uint8_t* blk = panel + b * F::kBlockBytes;
    v16 d0, d1, o0, o1;
    Header<BITS>(blk, d0, d1, o0, o1);
    for (int64_t kk = 0; kk < F::kRows; ++kk) {
      v16 w0, w1;
      Decode<BITS>(blk + F::kHeader + kk * F::kRowBytes, d0, d1, o0, o1, w0, w1);
      use(b * F::kRows + kk, w0, w1);
    }
  }
}

// Same products as Tile on the decoded weights: the chain over k is identical, so results are too.
template <int MT, int BITS>
void QTile(const float* x, int64_t k_len, const uint8_t* panel, float* y, int64_t n) {
  Chains<MT>(x, k_len, y, n, [&](auto&& use) { WalkPanel<BITS>(panel, k_len, use); });
}


// ---- bfloat16 activations (opt-in, `cpu_matmul="bf16x"`): compressed panels only ----------------------
// x is rounded to bfloat16 once per call; a block's codes are small integers, exact in bfloat16, so
// each product code * x is exact in float32 and AVX512-BF16's dot instruction adds two of them per lane
// (two k at a time, half the instructions of the float32 chains). The block's scale and offset are
// applied once per block: y += scale * sum(x * code) + offset * sum(x). Each output is still one fixed
// sequence of operations over k whatever M is (tree passes equal `ar` steps bit for bit), but not the
// float32 product: x carries 8 significant bits (like llama.cpp's 8-bit activations on CPU). 4-bit
// blocks only: an int8 block (a Q8_0 head) keeps the float32 chains, as fast at one row and exact.
#if defined(__AVX512F__)
// Two k rows of 16 bytes interleaved byte by byte: lane 2c + r holds row r's byte c (bf16x and int16x).
inline __m256i PairBytes16(const uint8_t* r0, const uint8_t* r1) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r0));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r1));
  return _mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b));
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
constexpr bool kHaveBf16x = true;

// The 32 columns of a k pair as two vectors of bfloat16 pairs (columns 0-15, 16-31).
template <int BITS>
inline void PairWeights(const uint8_t* rows, __m512bh& w0, __m512bh& w1) {
  if constexpr (BITS == 4) {
    // the codes 0..15 as bfloat16 bit patterns
    const __m512i lut = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150,
                                         0x4140, 0x4130, 0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080,
                                         0x4040, 0x4000, 0x3f80, 0x0000);
    const __m256i both = PairBytes16(rows, rows + 16);  // low nibbles: columns 0-15, high: 16-31
    const __m256i nib = _mm256_set1_epi8(15);
    const __m256i lo = _mm256_and_si256(both, nib);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(both, 4), nib);
    w0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(lo), lut);
    w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(hi), lut);
  } else {
    auto widen = [](__m256i codes) {  // 32 int8 -> 32 bfloat16 (exact: |code| <= 128)
      const __m512i c16 = _mm512_cvtepi8_epi16(codes);
      const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(c16)));
      const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(c16, 1)));
      return _mm512_cvtne2ps_pbh(f1, f0);
    };
    w0 = widen(PairBytes16(rows, rows + 32));
    w1 = widen(PairBytes16(rows + 16, rows + 48));
  }
}

template <int MT, int BITS>
void XTile(const uint32_t* xb, const float* xs, int64_t k_len, const uint8_t* panel, float* y, int64_t n) {
  using F = Format<BITS>;
  constexpr int64_t kPairs = F::kRows / 2;
  const int64_t pairs_per_row = k_len / 2, sums_per_row = k_len / 32;
  __m512 a0[MT], a1[MT];
  for (int m = 0; m < MT; ++m) {
    a0[m] = _mm512_setzero_ps();
    a1[m] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < k_len / F::kRows; ++b) {
    const uint8_t* blk = panel + b * F::kBlockBytes;
    __m512 i0[MT], i1[MT];
    for (int m = 0; m < MT; ++m) {
      i0[m] = _mm512_setzero_ps();
      i1[m] = _mm512_setzero_ps();
    }
    for (int64_t kp = 0; kp < kPairs; ++kp) {
      __m512bh w0, w1;
      PairWeights<BITS>(blk + F::kHeader + 2 * kp * F::kRowBytes, w0, w1);
      const int64_t pair = b * kPairs + kp;
      for (int m = 0; m < MT; ++m) {
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(xb[m * pairs_per_row + pair]));
        i0[m] = _mm512_dpbf16_ps(i0[m], xv, w0);
        i1[m] = _mm512_dpbf16_ps(i1[m], xv, w1);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(reinterpret_cast<const float*>(blk));
    const __m512 d1 = _mm512_loadu_ps(reinterpret_cast<const float*>(blk + 64));
    for (int m = 0; m < MT; ++m) {
      if constexpr (BITS == 4) {
        const __m512 sx = _mm512_set1_ps(xs[m * sums_per_row + b]);
        a0[m] = _mm512_fmadd_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(blk + 128)), sx, a0[m]);
        a1[m] = _mm512_fmadd_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(blk + 192)), sx, a1[m]);
      }
      a0[m] = _mm512_fmadd_ps(d0, i0[m], a0[m]);
      a1[m] = _mm512_fmadd_ps(d1, i1[m], a1[m]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    _mm512_storeu_ps(y + m * n, a0[m]);
    _mm512_storeu_ps(y + m * n + 16, a1[m]);
  }
}
// Rows of x [m, k] (k a multiple of 32: 4-bit blocks) to bfloat16 pairs xb [m, k/2], rounded to nearest
// even, and per 32 k the sum of the rounded values xs [m, k/32].
void RoundActivations(const float* x, int64_t m, int64_t k, uint32_t* xb, float* xs) {
  const int64_t sums = k / 32;
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = x + r * k;
    uint16_t* out = reinterpret_cast<uint16_t*>(xb + r * (k / 2));
    for (int64_t s = 0; s < sums; ++s) {
      const int64_t k0 = 32 * s;
      const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + k0 + 16), _mm512_loadu_ps(xr + k0));
      _mm512_storeu_si512(out + k0, (__m512i)h);
      const __m512i wide = (__m512i)h;  // back to float32: the 16 bits become the high half
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(wide)), 16));
      const __m512 hi =
          _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(wide, 1)), 16));
      xs[r * sums + s] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  }
}
#else
constexpr bool kHaveBf16x = false;
void RoundActivations(const float*, int64_t, int64_t, uint32_t*, float*) {}
template <int MT, int BITS>
void XTile(const uint32_t*, const float*, int64_t, const uint8_t*, float*, int64_t) {}
#endif

// ---- int8 activations (opt-in, `cpu_matmul="int8x"`): compressed panels, K a multiple of 32 ----------
// Each row of x is quantized per 32 k (one block): q = round(x * 127 / max|x|) in int8, scale
// max|x| / 127. AVX512-VNNI multiplies the block's codes (u8, 0..15) with q (s8) and adds four products
// per lane in int32 (exact); per block y += (d * scale) * sum(q * code) + offset * sum(q * scale). Four k
// rows of a block are 64 contiguous bytes, and one byte permute puts each column's four codes in one lane.
// Every output is one fixed sequence whatever M is (tree passes equal `ar` steps bit for bit); x carries
// 8 bits per block, coarser than bf16x (what llama.cpp's CPU kernels use).
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
constexpr bool kHaveInt8x = true;

template <int MT>
void ITile(const uint32_t* xq, const float* sq, const float* xs, int64_t k_len, const uint8_t* panel, float* y,
           int64_t n) {
  using F = Format<4>;
  const int64_t quads_per_row = k_len / 4, blocks = k_len / F::kRows;
  alignas(64) static const uint8_t kQuadOrder[64] = {
      0, 16, 32, 48, 1, 17, 33, 49, 2, 18, 34, 50, 3, 19, 35, 51, 4, 20, 36, 52, 5, 21, 37, 53,
      6, 22, 38, 54, 7, 23, 39, 55, 8, 24, 40, 56, 9, 25, 41, 57, 10, 26, 42, 58, 11, 27, 43, 59,
      12, 28, 44, 60, 13, 29, 45, 61, 14, 30, 46, 62, 15, 31, 47, 63};  // byte 4c + r <- row r's byte c
  const __m512i order = _mm512_load_si512(kQuadOrder);
  const __m512i nib = _mm512_set1_epi8(15);
  __m512 a0[MT], a1[MT];
  for (int m = 0; m < MT; ++m) {
    a0[m] = _mm512_setzero_ps();
    a1[m] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = panel + b * F::kBlockBytes;
    __m512i i0[MT], i1[MT];
    for (int m = 0; m < MT; ++m) {
      i0[m] = _mm512_setzero_si512();
      i1[m] = _mm512_setzero_si512();
    }
    for (int64_t q = 0; q < F::kRows / 4; ++q) {
      const __m512i quad = _mm512_permutexvar_epi8(order, _mm512_loadu_si512(blk + F::kHeader + 64 * q));
      const __m512i lo = _mm512_and_si512(quad, nib);                          // columns 0-15
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(quad, 4), nib);    // columns 16-31
      const int64_t at = b * (F::kRows / 4) + q;
      for (int m = 0; m < MT; ++m) {
        const __m512i xv = _mm512_set1_epi32(static_cast<int>(xq[m * quads_per_row + at]));
        i0[m] = _mm512_dpbusd_epi32(i0[m], lo, xv);
        i1[m] = _mm512_dpbusd_epi32(i1[m], hi, xv);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(reinterpret_cast<const float*>(blk));
    const __m512 d1 = _mm512_loadu_ps(reinterpret_cast<const float*>(blk + 64));
    const __m512 o0 = _mm512_loadu_ps(reinterpret_cast<const float*>(blk + 128));
    const __m512 o1 = _mm512_loadu_ps(reinterpret_cast<const float*>(blk + 192));
    for (int m = 0; m < MT; ++m) {
      const __m512 sx = _mm512_set1_ps(xs[m * blocks + b]), scale = _mm512_set1_ps(sq[m * blocks + b]);
      a0[m] = _mm512_fmadd_ps(o0, sx, a0[m]);
      a1[m] = _mm512_fmadd_ps(o1, sx, a1[m]);
      a0[m] = _mm512_fmadd_ps(_mm512_mul_ps(d0, scale), _mm512_cvtepi32_ps(i0[m]), a0[m]);
      a1[m] = _mm512_fmadd_ps(_mm512_mul_ps(d1, scale), _mm512_cvtepi32_ps(i1[m]), a1[m]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    _mm512_storeu_ps(y + m * n, a0[m]);
    _mm512_storeu_ps(y + m * n + 16, a1[m]);
  }
}

// 8-bit blocks (a Q8_0 head: 16 k, 32 scales, int8 codes). VNNI multiplies an unsigned byte with a
// signed one, and here both are signed: x goes in as q + 128 (q ^ 0x80, 1..255) and 128 * sum(codes)
// comes off again per block and column, counted with the same instruction against ones (once per
// panel, shared by the rows). Four k rows of a block are 128 bytes: one two-source byte permute per 16
// columns puts each column's four codes in one lane. Per block y += (d * scale) * (sum((q + 128) * code)
// - 128 * sum(code)), exact in int32; the activation scale is that of the 32 k the block lies in.
template <int MT>
void ITile8(const uint32_t* xq, const float* sq, int64_t k_len, const uint8_t* panel, float* y, int64_t n) {
  using F = Format<8>;
  const int64_t quads_per_row = k_len / 4, blocks = k_len / F::kRows, x_blocks = k_len / 32;
  alignas(64) static const uint8_t kColumns[2][64] = {  // byte 4c + r <- row r's byte c (+ 16)
      {0,  32, 64, 96,  1,  33, 65, 97,  2,  34, 66, 98,  3,  35, 67, 99,  4,  36, 68, 100, 5,  37,
       69, 101, 6,  38, 70, 102, 7,  39, 71, 103, 8,  40, 72, 104, 9,  41, 73, 105, 10, 42, 74, 106,
       11, 43, 75, 107, 12, 44, 76, 108, 13, 45, 77, 109, 14, 46, 78, 110, 15, 47, 79, 111},
      {16, 48, 80, 112, 17, 49, 81, 113, 18, 50, 82, 114, 19, 51, 83, 115, 20, 52, 84, 116, 21, 53,
       85, 117, 22, 54, 86, 118, 23, 55, 87, 119, 24, 56, 88, 120, 25, 57, 89, 121, 26, 58, 90, 122,
       27, 59, 91, 123, 28, 60, 92, 124, 29, 61, 93, 125, 30, 62, 94, 126, 31, 63, 95, 127}};
  const __m512i lo_order = _mm512_load_si512(kColumns[0]), hi_order = _mm512_load_si512(kColumns[1]);
  const __m512i ones = _mm512_set1_epi8(1);
  __m512 a0[MT], a1[MT];
  for (int m = 0; m < MT; ++m) {
    a0[m] = _mm512_setzero_ps();
    a1[m] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = panel + b * F::kBlockBytes;
    __m512i i0[MT], i1[MT];
    for (int m = 0; m < MT; ++m) {
      i0[m] = _mm512_setzero_si512();
      i1[m] = _mm512_setzero_si512();
    }
    __m512i c0 = _mm512_setzero_si512(), c1 = _mm512_setzero_si512();
    for (int64_t q = 0; q < F::kRows / 4; ++q) {
      const uint8_t* rows = blk + F::kHeader + 4 * F::kRowBytes * q;
      const __m512i r01 = _mm512_loadu_si512(rows), r23 = _mm512_loadu_si512(rows + 64);
      const __m512i lo = _mm512_permutex2var_epi8(r01, lo_order, r23);  // columns 0-15
      const __m512i hi = _mm512_permutex2var_epi8(r01, hi_order, r23);  // columns 16-31
      c0 = _mm512_dpbusd_epi32(c0, ones, lo);
      c1 = _mm512_dpbusd_epi32(c1, ones, hi);
      const int64_t at = b * (F::kRows / 4) + q;
      for (int m = 0; m < MT; ++m) {
        const __m512i xv = _mm512_set1_epi32(static_cast<int>(xq[m * quads_per_row + at] ^ 0x80808080u));
        i0[m] = _mm512_dpbusd_epi32(i0[m], xv, lo);
        i1[m] = _mm512_dpbusd_epi32(i1[m], xv, hi);
      }
    }
    c0 = _mm512_slli_epi32(c0, 7);
    c1 = _mm512_slli_epi32(c1, 7);
    const __m512 d0 = _mm512_loadu_ps(reinterpret_cast<const float*>(blk));
    const __m512 d1 = _mm512_loadu_ps(reinterpret_cast<const float*>(blk + 64));
    for (int m = 0; m < MT; ++m) {
      const __m512 scale = _mm512_set1_ps(sq[m * x_blocks + b / 2]);
      a0[m] = _mm512_fmadd_ps(_mm512_mul_ps(d0, scale), _mm512_cvtepi32_ps(_mm512_sub_epi32(i0[m], c0)), a0[m]);
      a1[m] = _mm512_fmadd_ps(_mm512_mul_ps(d1, scale), _mm512_cvtepi32_ps(_mm512_sub_epi32(i1[m], c1)), a1[m]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    _mm512_storeu_ps(y + m * n, a0[m]);
    _mm512_storeu_ps(y + m * n + 16, a1[m]);
  }
}
#else
constexpr bool kHaveInt8x = false;
template <int MT>
void ITile(const uint32_t*, const float*, const float*, int64_t, const uint8_t*, float*, int64_t) {}
template <int MT>
void ITile8(const uint32_t*, const float*, int64_t, const uint8_t*, float*, int64_t) {}
#endif

// Rows of x [m, k] (k a multiple of 32) quantized per 32 k to integers of at most kLevels: q [m, k]
// (int8: four per word, int16: two), the block's scale sq [m, k/32] (max|x| / kLevels) and the sum of
// the quantized values times the scale xs [m, k/32]. Plain C++: the same values on every machine (the
// reference rounds the same way, half to even).
template <typename Q, int kLevels>
void QuantizeBlocks(const float* x, int64_t m, int64_t k, Q* q_all, float* sq, float* xs) {
  const int64_t blocks = k / 32;
  const float levels = static_cast<float>(kLevels);
  for (int64_t r = 0; r < m; ++r) {
    Q* q = q_all + r * k;
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * k + 32 * b;
      float amax = 0.f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float scale = amax / levels, inv = amax > 0.f ? levels / amax : 0.f;
      int sum = 0;
      for (int i = 0; i < 32; ++i) {
        const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
        q[32 * b + i] = static_cast<Q>(v);
        sum += v;
      }
      sq[r * blocks + b] = scale;
      xs[r * blocks + b] = static_cast<float>(sum) * scale;
    }
  }
}

void QuantizeActivations(const float* x, int64_t m, int64_t k, uint32_t* xq, float* sq, float* xs) {
  QuantizeBlocks<int8_t, 127>(x, m, k, reinterpret_cast<int8_t*>(xq), sq, xs);
}

void QuantizeActivations16(const float* x, int64_t m, int64_t k, uint32_t* xw, float* sq, float* xs) {
  QuantizeBlocks<int16_t, 32767>(x, m, k, reinterpret_cast<int16_t*>(xw), sq, xs);
}


// ---- int16 activations (opt-in, `cpu_matmul="int16x"`): 4-bit compressed panels ----------------------
// Each row of x is quantized per 32 k (one block): q = round(x * 32767 / max|x|) in int16, scale
// max|x| / 32767: 15 bits per block against int8x's 7, so products stay within ~1e-5 of float32's.
// AVX512-VNNI's vpdpwssd multiplies two k of codes (0..15, widened to int16) with two k of q and adds
// both products per lane in int32 (exact: 32 x 15 x 32767 < 2^31); per block y += (d * scale) *
// sum(q * code) + offset * sum(q * scale), as int8x. 8-bit blocks (a Q8_0 head) keep the float32 chains,
// so the greedy head is float32's and goes through the int8 screen as in the default mode. Twice the multiply-adds per instruction of the
// float32 chains; every output one fixed sequence whatever M is (tree passes equal `ar` steps bit for bit).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kHaveInt16x = true;

// A k pair of a 4-bit block's codes as int16 pairs per lane: columns 0-15 (w0) and 16-31 (w1).
inline void PairCodes16(const uint8_t* rows, __m512i& w0, __m512i& w1) {
  const __m256i both = PairBytes16(rows, rows + 16);  // low nibbles: columns 0-15, high: 16-31
  const __m256i nib = _mm256_set1_epi8(15);
  w0 = _mm512_cvtepu8_epi16(_mm256_and_si256(both, nib));
  w1 = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(both, 4), nib));
}

template <int MT>
void WTile(const uint32_t* xw, const float* sq, const float* xs, int64_t k_len, const uint8_t* panel, float* y,
           int64_t n) {
  using F = Format<4>;
  const int64_t pairs_per_row = k_len / 2, x_blocks = k_len / 32;
  __m512 a0[MT], a1[MT];
  for (int m = 0; m < MT; ++m) {
    a0[m] = _mm512_setzero_ps();
    a1[m] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < k_len / F::kRows; ++b) {
    const uint8_t* blk = panel + b * F::kBlockBytes;
    __m512i i0[MT], i1[MT];
    for (int m = 0; m < MT; ++m) {
      i0[m] = _mm512_setzero_si512();
      i1[m] = _mm512_setzero_si512();
    }
    for (int64_t kp = 0; kp < F::kRows / 2; ++kp) {
      __m512i w0, w1;
      PairCodes16(blk + F::kHeader + 2 * kp * F::kRowBytes, w0, w1);
      const int64_t pair = b * (F::kRows / 2) + kp;
      for (int m = 0; m < MT; ++m) {
        const __m512i xv = _mm512_set1_epi32(static_cast<int>(xw[m * pairs_per_row + pair]));
        i0[m] = _mm512_dpwssd_epi32(i0[m], w0, xv);
        i1[m] = _mm512_dpwssd_epi32(i1[m], w1, xv);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(reinterpret_cast<const float*>(blk));
    const __m512 d1 = _mm512_loadu_ps(reinterpret_cast<const float*>(blk + 64));
    for (int m = 0; m < MT; ++m) {
      const __m512 scale = _mm512_set1_ps(sq[m * x_blocks + b]), sx = _mm512_set1_ps(xs[m * x_blocks + b]);
      a0[m] = _mm512_fmadd_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(blk + 128)), sx, a0[m]);
      a1[m] = _mm512_fmadd_ps(_mm512_loadu_ps(reinterpret_cast<const float*>(blk + 192)), sx, a1[m]);
      a0[m] = _mm512_fmadd_ps(_mm512_mul_ps(d0, scale), _mm512_cvtepi32_ps(i0[m]), a0[m]);
      a1[m] = _mm512_fmadd_ps(_mm512_mul_ps(d1, scale), _mm512_cvtepi32_ps(i1[m]), a1[m]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    _mm512_storeu_ps(y + m * n, a0[m]);
    _mm512_storeu_ps(y + m * n + 16, a1[m]);
  }
}
#else
constexpr bool kHaveInt16x = false;
template <int MT>
void WTile(const uint32_t*, const float*, const float*, int64_t, const uint8_t*, float*, int64_t) {}
#endif

struct Work {
  const float* x;
  int64_t m, k;
  const void* wp;
  int64_t panel_bytes;
  int bits;  // 32: float32 panels; 16: bfloat16 panels; 4 / 8: compressed
  int64_t p0, p1;  // panels [p0, p1)
  float* y;
  int64_t n;
  const uint32_t* xb = nullptr;  // bfloat16 activations (compressed panels only): x rounded, k pairs per row
  const float* xs = nullptr;     // and their sums per 32 k (the offset term of 4-bit blocks)
  const uint32_t* xq = nullptr;  // int8 activations (compressed panels only): four k per word
  const float* sq = nullptr;     // and their scale per 32 k (int8x and int16x)
  const uint32_t* xw = nullptr;  // int16 activations (compressed panels only): two k per word
  const float* colabs = nullptr;  // screened argmax: sum |w| per 32 k and column [N/32, K/32, 32]
  float* lo_max = nullptr;        // and per row and panel the largest lower bound [M, N/32]
  float* hi_max = nullptr;        // and upper bound (y gets each column's upper bound)
};

// A whole compressed panel decoded to float32 panel layout [K, 32] (for sweeps of more than 8 rows).
template <int BITS>
void DecodePanel(const uint8_t* panel, int64_t k_len, float* out) {
  WalkPanel<BITS>(panel, k_len, [out](int64_t k, const v16& w0, const v16& w1) {
    __builtin_memcpy(out + k * kPanel, &w0, 64);
    __builtin_memcpy(out + k * kPanel + 16, &w1, 64);
  });
}

// A bfloat16 panel [K, 32] as float32 panel (for sweeps of more than 8 rows).
void DecodeBf16Panel(const uint16_t* panel, int64_t k_len, float* out) {
  for (int64_t k = 0; k < k_len; ++k) {
    const v16 w0 = Bf16ToFloat(panel + k * kPanel), w1 = Bf16ToFloat(panel + k * kPanel + 16);
    __builtin_memcpy(out + k * kPanel, &w0, 64);
    __builtin_memcpy(out + k * kPanel + 16, &w1, 64);
  }
}

// Rows [m0, m0 + rows) of x against one panel; rows <= 8. bits 32: float32 panel, 16: bfloat16, else
// compressed.
void Rows(const Work& w, int bits, const void* panel, int64_t m0, int64_t rows) {
  const float* xs = w.x + m0 * w.k;
  float* ys = w.y + m0 * w.n;
  const uint32_t* xbr = w.xb ? w.xb + m0 * (w.k / 2) : nullptr;
  const float* xsr = w.xs ? w.xs + m0 * (w.k / 32) : nullptr;
  if (w.xw && bits == 4) {  // int16x: at most 4 rows per tile, as int8x
    const uint32_t* xwr = w.xw + m0 * (w.k / 2);
    const float* sqr = w.sq + m0 * (w.k / 32);
    const uint8_t* pq = static_cast<const uint8_t*>(panel);
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int64_t at = r0 * (w.k / 2), bt = r0 * (w.k / 32);
      float* yr = ys + r0 * w.n;
      const int rest = static_cast<int>(std::min<int64_t>(4, rows - r0));
#define HSDJAX_WTILE(MT) WTile<MT>(xwr + at, sqr + bt, xsr + bt, w.k, pq, yr, w.n)
      switch (rest) {
        case 4: HSDJAX_WTILE(4); break;
        case 3: HSDJAX_WTILE(3); break;
        case 2: HSDJAX_WTILE(2); break;
        default: HSDJAX_WTILE(1); break;
      }
#undef HSDJAX_WTILE
    }
    return;
  }
  if (w.xq && (bits == 4 || bits == 8)) {  // at most 4 rows per tile (8 would spill); rows are independent
    const uint32_t* xqr = w.xq + m0 * (w.k / 4);
    const float* sqr = w.sq + m0 * (w.k / 32);
    const uint8_t* pq = static_cast<const uint8_t*>(panel);
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const int64_t at = r0 * (w.k / 4), bt = r0 * (w.k / 32);
      float* yr = ys + r0 * w.n;
      if (bits == 8) {
        switch (std::min<int64_t>(4, rows - r0)) {
          case 4: ITile8<4>(xqr + at, sqr + bt, w.k, pq, yr, w.n); break;
          case 3: ITile8<3>(xqr + at, sqr + bt, w.k, pq, yr, w.n); break;
          case 2: ITile8<2>(xqr + at, sqr + bt, w.k, pq, yr, w.n); break;
          default: ITile8<1>(xqr + at, sqr + bt, w.k, pq, yr, w.n); break;
        }
        continue;
      }
      switch (std::min<int64_t>(4, rows - r0)) {
        case 4: ITile<4>(xqr + at, sqr + bt, xsr + bt, w.k, pq, yr, w.n); break;
        case 3: ITile<3>(xqr + at, sqr + bt, xsr + bt, w.k, pq, yr, w.n); break;
        case 2: ITile<2>(xqr + at, sqr + bt, xsr + bt, w.k, pq, yr, w.n); break;
        default: ITile<1>(xqr + at, sqr + bt, xsr + bt, w.k, pq, yr, w.n); break;
      }
    }
    return;
  }
#define HSDJAX_TILE(MT)                                                                                    \
  (xbr && bits == 4 ? XTile<MT, 4>(xbr, xsr, w.k, static_cast<const uint8_t*>(panel), ys, w.n)             \
   : bits == 4    ? QTile<MT, 4>(xs, w.k, static_cast<const uint8_t*>(panel), ys, w.n)                       \
   : bits == 8  ? QTile<MT, 8>(xs, w.k, static_cast<const uint8_t*>(panel), ys, w.n)                       \
   : bits == 16 ? BTile<MT>(xs, w.k, static_cast<const uint16_t*>(panel), ys, w.n)                         \
                : Tile<MT>(xs, w.k, static_cast<const float*>(panel), ys, w.n))
  switch (rows) {
    case 8: HSDJAX_TILE(8); break;
    case 7: HSDJAX_TILE(7); break;
    case 6: HSDJAX_TILE(6); break;
    case 5: HSDJAX_TILE(5); break;
    case 4: HSDJAX_TILE(4); break;
    case 3: HSDJAX_TILE(3); break;
    case 2: HSDJAX_TILE(2); break;
    default: HSDJAX_TILE(1); break;
  }
#undef HSDJAX_TILE
}

// ---- exact greedy tokens through an int8 screen (`screened_argmax`) -----------------------------------
// The index of each row's largest logit, as the float32 chains compute the logits, without running the
// chains over the whole vocabulary. The int8x products give every logit up to a bound: x differs from
// its int8 rounding by at most half a step, max|x_b| / 254, in each block b of 32 k, so a logit differs
// by at most sum_b max|x_b| / 254 * sum_{k in b} |w_kv| (plus float32 rounding of both products, far
// below the 2^-11 slack added here). Only a column whose upper bound reaches the largest lower bound can
// hold the maximum; the float32 chains then run on the panels holding those columns (QTile, the same
// chains as the full product, so the same values bit for bit) and the first largest value wins, as in
// argmax. Rows that hold a NaN or an infinity run the chains on every panel.
constexpr float kScreenSlack = 0.5f / 127.f + 1.f / 2048.f;

// Panel p's upper bounds per column (written over its int8x products in y) and, per row, the panel's
// largest lower and upper bound (w.lo_max / w.hi_max [M, N/32]).
inline float MaxOf(const v16& a, const v16& b) {
  float out = a[0] > b[0] ? a[0] : b[0];
  for (int j = 0; j < 16; ++j) out = std::max(out, std::max(a[j], b[j]));
  return out;
}

void Bounds(const Work& w, int64_t p) {
  const int64_t blocks = w.k / 32, panels = w.n / kPanel;
  const float* a = w.colabs + p * blocks * kPanel;
  for (int64_t m = 0; m < w.m; ++m) {
    const float* sq = w.sq + m * blocks;  // max|x_b| / 127
    v16 e0{}, e1{};
    for (int64_t b = 0; b < blocks; ++b) {
      v16 c0, c1;
      __builtin_memcpy(&c0, a + b * kPanel, 64);
      __builtin_memcpy(&c1, a + b * kPanel + 16, 64);
      const float s = sq[b] * 127.f;
      e0 += s * c0;
      e1 += s * c1;
    }
    e0 *= kScreenSlack;
    e1 *= kScreenSlack;
    float* y = w.y + m * w.n + p * kPanel;
    v16 y0, y1;
    __builtin_memcpy(&y0, y, 64);
    __builtin_memcpy(&y1, y + 16, 64);
    const v16 h0 = y0 + e0, h1 = y1 + e1;
    __builtin_memcpy(y, &h0, 64);
    __builtin_memcpy(y + 16, &h1, 64);
    w.lo_max[m * panels + p] = MaxOf(y0 - e0, y1 - e1);
    w.hi_max[m * panels + p] = MaxOf(h0, h1);
  }
}

// Up to 8 rows read a compressed (or bfloat16) panel once, decoding on the fly; more rows decode it
// once into a buffer (L2-sized) and sweep that per 8 rows. Either way every output is the same chain
// over k.
void Panels(const Work& w) {
  std::unique_ptr<float[]> decoded;
  if (w.bits != 32 && w.m > 8 && !w.xb && !w.xq && !w.xw) decoded.reset(new float[w.k * kPanel]);  // bf16x / int8x 4-bit: per 8 rows
  for (int64_t p = w.p0; p < w.p1; ++p) {
    const void* panel = static_cast<const uint8_t*>(w.wp) + p * w.panel_bytes;
    int bits = w.bits;
    if (decoded) {
      if (bits == 16) {
        DecodeBf16Panel(static_cast<const uint16_t*>(panel), w.k, decoded.get());
      } else if (bits == 4) {
        DecodePanel<4>(static_cast<const uint8_t*>(panel), w.k, decoded.get());
      } else {
        DecodePanel<8>(static_cast<const uint8_t*>(panel), w.k, decoded.get());
      }
      panel = decoded.get();
      bits = 32;
    }
    Work at = w;
    at.y = w.y + p * kPanel;
    for (int64_t m0 = 0; m0 < w.m; m0 += 8) Rows(at, bits, panel, m0, std::min<int64_t>(8, w.m - m0));
    if (w.colabs) Bounds(w, p);
  }
}

// One call's panels, claimed in chunks by the calling thread and by tasks on XLA's intra-op thread
// pool (shared: a task that starts after the call returned finds nothing left and only drops it).
struct Call {
  Work all;
  int64_t chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    for (int64_t c; (c = next.fetch_add(1)) < chunks;) {
      Work w = all;
      w.p0 = all.p1 * c / chunks;
      w.p1 = all.p1 * (c + 1) / chunks;
      Panels(w);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error RunChunks(ffi::ThreadPool& pool, const Work& all) {
  const int64_t panels = all.p1;
  const int64_t helpers = pool.num_threads();
  if (helpers < 1 || panels < 8) {
    Panels(all);
    return ffi::Error::Success();
  }
  auto call = std::make_shared<Call>();
  call->all = all;
  call->chunks = std::min<int64_t>(panels / 4, 4 * (helpers + 1));
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([call] { call->Run(); });
  call->Run();
  while (call->done.load(std::memory_order_acquire) < call->chunks) __builtin_ia32_pause();
  return ffi::Error::Success();
}

// Float32 or bfloat16 panels [N/32, K, 32]: one row of 32 values per k, `bits` wide each.
template <ffi::DataType T>
ffi::Error WidePanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<T> wp,
                           ffi::ResultBuffer<ffi::F32> y, int bits, const char* bad_shape) {
  auto xd = x.dimensions();
  auto wd = wp.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kPanel || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument(bad_shape);
  }
  const int64_t m = xd[0], k = xd[1], panels = wd[0];
  return RunChunks(pool, Work{x.typed_data(), m, k, wp.untyped_data(), k * kPanel * (bits / 8), bits, 0, panels,
                              y->typed_data(), panels * kPanel});
}

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wp,
                       ffi::ResultBuffer<ffi::F32> y) {
  return WidePanelMatmul(pool, x, wp, y, 32, "hsdjax panel matmul: expects x [M, K] and panels [N/32, K, 32]");
}

ffi::Error Bf16Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> wb,
                      ffi::ResultBuffer<ffi::F32> y) {
  return WidePanelMatmul(pool, x, wb, y, 16, "hsdjax bfloat16 matmul: expects x [M, K] and panels [N/32, K, 32]");
}

enum class Activations { kFloat32, kBf16, kInt8, kInt16 };

ffi::Error Compressed(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::U8>& wq,
                      ffi::ResultBuffer<ffi::F32>& y, Activations act) {
  auto xd = x.dimensions();
  auto wd = wq.dimensions();
  if (xd.size() != 2 || wd.size() != 3) {
    return ffi::Error::InvalidArgument("hsdjax compressed matmul: expects x [M, K] and panels [N/32, K/L, B]");
  }
  const int64_t m = xd[0], k = xd[1], panels = wd[0], block = wd[2];
  int bits;
  if (block == Format<4>::kBlockBytes && k == wd[1] * Format<4>::kRows) {
    bits = 4;
  } else if (block == Format<8>::kBlockBytes && k == wd[1] * Format<8>::kRows) {
    bits = 8;
  } else {
    return ffi::Error::InvalidArgument("hsdjax compressed matmul: blocks are 768 bytes per 32 k (4-bit) "
                                       "or 640 per 16 (8-bit)");
  }
  Work all{x.typed_data(), m, k, wq.typed_data(), wd[1] * block, bits, 0, panels, y->typed_data(),
           panels * kPanel};
  std::unique_ptr<uint32_t[]> xb, xw;
  std::unique_ptr<float[]> xs, sq;
  if (act == Activations::kInt8 && k % 32 == 0) {  // x is quantized per 32 k (else: the float32 chains)
    if (!kHaveInt8x) {
      return ffi::Error::InvalidArgument("hsdjax int8x matmul: this build has no AVX512-VNNI / AVX512-VBMI");
    }
    xb.reset(new uint32_t[m * (k / 4)]);
    sq.reset(new float[m * (k / 32)]);
    xs.reset(new float[m * (k / 32)]);
    QuantizeActivations(x.typed_data(), m, k, xb.get(), sq.get(), xs.get());
    all.xq = xb.get();
    all.sq = sq.get();
    all.xs = xs.get();
  }
  if (act == Activations::kInt16 && bits == 4) {  // x is quantized per 32 k (8-bit blocks: the float32 chains)
    if (!kHaveInt16x) {
      return ffi::Error::InvalidArgument("hsdjax int16x matmul: this build has no AVX512-VNNI / AVX512-BW");
    }
    xw.reset(new uint32_t[m * (k / 2)]);
    sq.reset(new float[m * (k / 32)]);
    xs.reset(new float[m * (k / 32)]);
    QuantizeActivations16(x.typed_data(), m, k, xw.get(), sq.get(), xs.get());
    all.xw = xw.get();
    all.sq = sq.get();
    all.xs = xs.get();
  }
  if (act == Activations::kBf16 && bits == 4) {  // 8-bit blocks keep the float32 chains (widening int8 to bfloat16 costs more)
    if (!kHaveBf16x) {
      return ffi::Error::InvalidArgument("hsdjax bf16x matmul: this build has no AVX512-BF16 / AVX512-VBMI");
    }
    // x rounded to bfloat16 (nearest even), two k per word, and per 32 k the sum of the rounded values
    const int64_t pairs = k / 2, sums = k / 32;
    xb.reset(new uint32_t[m * pairs]);
    xs.reset(new float[m * sums]);
    RoundActivations(x.typed_data(), m, k, xb.get(), xs.get());
    all.xb = xb.get();
    all.xs = xs.get();
  }
  return RunChunks(pool, all);
}

ffi::Error CompressedMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wq,
                            ffi::ResultBuffer<ffi::F32> y) {
  return Compressed(pool, x, wq, y, Activations::kFloat32);
}

ffi::Error CompressedMatmulBf16x(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wq,
                                 ffi::ResultBuffer<ffi::F32> y) {
  return Compressed(pool, x, wq, y, Activations::kBf16);
}

ffi::Error CompressedMatmulInt8x(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wq,
                                 ffi::ResultBuffer<ffi::F32> y) {
  return Compressed(pool, x, wq, y, Activations::kInt8);
}

ffi::Error CompressedMatmulInt16x(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wq,
                                  ffi::ResultBuffer<ffi::F32> y) {
  return Compressed(pool, x, wq, y, Activations::kInt16);
}

// The first index of the largest of 32 x n_panels values (argmax: the first NaN wins if there is one).
struct Best {
  int64_t index = -1;
  float value = 0.f;
  bool nan = false;
  void Offer(int64_t v, float y) {
    if (nan) return;
    if (std::isnan(y)) {
      index = v;
      nan = true;
    } else if (index < 0 || y > value) {
      index = v;
      value = y;
    }
  }
};

// One row's argmax over the float32 chains of the panels listed (ascending), columns filtered by keep.
template <typename Keep>
Best ExactBest(const float* x, int64_t k, const uint8_t* wq, int64_t panel_bytes, const int64_t* panels,
               int64_t count, Keep&& keep) {
  Best best;
  alignas(64) float y[kPanel];
  for (int64_t i = 0; i < count; ++i) {
    const int64_t p = panels[i];
    QTile<1, 8>(x, k, wq + p * panel_bytes, y, kPanel);
    for (int64_t j = 0; j < kPanel; ++j) {
      if (keep(p * kPanel + j)) best.Offer(p * kPanel + j, y[j]);
    }
  }
  return best;
}

ffi::Error ScreenedArgmax(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wq,
                          ffi::Buffer<ffi::F32> colabs, ffi::ResultBuffer<ffi::S32> out) {
  auto xd = x.dimensions();
  auto wd = wq.dimensions();
  auto ad = colabs.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || ad.size() != 3 || wd[2] != Format<8>::kBlockBytes ||
      xd[1] != wd[1] * Format<8>::kRows || xd[1] % 32 != 0 || ad[0] != wd[0] || ad[1] != xd[1] / 32 ||
      ad[2] != kPanel) {
    return ffi::Error::InvalidArgument("hsdjax screened argmax: expects x [M, K], 8-bit panels [N/32, K/16, 640] "
                                       "and column sums [N/32, K/32, 32]");
  }
  if (!kHaveInt8x) {
    return ffi::Error::InvalidArgument("hsdjax screened argmax: this build has no AVX512-VNNI / AVX512-VBMI");
  }
  const int64_t m = xd[0], k = xd[1], panels = wd[0], n = panels * kPanel, blocks = k / 32;
  const int64_t panel_bytes = wd[1] * Format<8>::kBlockBytes;
  const float* xs = x.typed_data();
  const uint8_t* w = wq.typed_data();
  thread_local std::unique_ptr<float[]> hi, lo_max, hi_max;  // reused across calls: no page faults per call
  thread_local int64_t have = 0;
  if (have < m * n) {
    hi.reset(new float[m * n]);
    lo_max.reset(new float[m * panels]);
    hi_max.reset(new float[m * panels]);
    have = m * n;
  }
  std::unique_ptr<uint32_t[]> xq(new uint32_t[m * (k / 4)]);
  std::unique_ptr<float[]> sq(new float[m * blocks]), sums(new float[m * blocks]);
  QuantizeActivations(xs, m, k, xq.get(), sq.get(), sums.get());
  Work all{xs, m, k, w, panel_bytes, 8, 0, panels, hi.get(), n};
  all.xq = xq.get();
  all.sq = sq.get();
  all.colabs = colabs.typed_data();
  all.lo_max = lo_max.get();
  all.hi_max = hi_max.get();
  RunChunks(pool, all);
  std::unique_ptr<int64_t[]> listed(new int64_t[panels]);
  for (int64_t r = 0; r < m; ++r) {
    const float* xr = xs + r * k;
    bool finite = true;
    for (int64_t i = 0; i < k; ++i) finite &= std::isfinite(xr[i]);
    const float* h = hi.get() + r * n;
    const float* pl = lo_max.get() + r * panels;
    const float* ph = hi_max.get() + r * panels;
    float floor = pl[0];
    for (int64_t p = 1; p < panels; ++p) floor = std::max(floor, pl[p]);
    finite &= std::isfinite(floor);
    int64_t count = 0;
    Best best;
    if (finite) {
      for (int64_t p = 0; p < panels; ++p) {
        if (ph[p] >= floor) listed[count++] = p;
      }
      best = ExactBest(xr, k, w, panel_bytes, listed.get(), count, [&](int64_t v) { return h[v] >= floor; });
    }
    if (!finite || best.nan || best.index < 0) {  // every panel, every column
      for (int64_t p = 0; p < panels; ++p) listed[p] = p;
      best = ExactBest(xr, k, w, panel_bytes, listed.get(), panels, [](int64_t) { return true; });
    }
    out->typed_data()[r] = static_cast<int32_t>(best.index);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxPanelMatmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxBf16Matmul, Bf16Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxCompressedMatmul, CompressedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxCompressedMatmulBf16x, CompressedMatmulBf16x,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxCompressedMatmulInt8x, CompressedMatmulInt8x,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxCompressedMatmulInt16x, CompressedMatmulInt16x,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxScreenedArgmax, ScreenedArgmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

// Whether this build has the int8-activation products (AVX512-VNNI and AVX512-VBMI).
extern "C" int HsdjaxHasInt8x() { return kHaveInt8x ? 1 : 0; }

// Whether this build has the int16-activation products (AVX512-VNNI and AVX512-BW).
extern "C" int HsdjaxHasInt16x() { return kHaveInt16x ? 1 : 0; }

// Whether this build has the bfloat16-activation products (AVX512-BF16 and AVX512-VBMI).
extern "C" int HsdjaxHasBf16x() { return kHaveBf16x ? 1 : 0; }
