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
// one-token `ar` step compute bitwise-equal matmul outputs. Vectors are the instruction set's own
// (cpu_simd.h: 16 floats with AVX-512, 8 with AVX2, 4 with NEON), a panel row is kPanel / kLanes of
// them, and a tile holds as many rows of x as the registers hold accumulators (8 with AVX-512, 3 with
// AVX2 or NEON). A compressed or bfloat16 panel is decoded one block of k at a time into a small buffer
// (L1-resident) that every tile of rows then reads, so the decode is paid once per weight whatever M is;
// a tile's chains pause in y between blocks, which does not change them. Since every instruction set
// here has fused multiply-adds, the products are also bitwise equal across AVX-512, AVX2 and NEON
// builds. Chunks of panels are shared between the calling thread and XLA's own intra-op thread pool (no
// threads of its own).
#include <atomic>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>

#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using hsdjax_simd::kLanes;
using hsdjax_simd::Load;
using hsdjax_simd::Splat;
using hsdjax_simd::Store;
using hsdjax_simd::u8x16;
using hsdjax_simd::vf;
constexpr int64_t kPanel = 32;
constexpr int kVecs = kPanel / kLanes;  // native vectors per panel row
// Rows of x per tile: MT x kVecs accumulators and a broadcast within the vector registers.
constexpr int kTileRows = std::min(8, (hsdjax_simd::kRegisters - 1) / kVecs);
// Up to this many rows multiply a compressed panel straight from registers, a tile at a time, each
// tile decoding the weights again; more rows decode each block once into a buffer that tiles sweep
// (AVX2, SmolLM2's 576 x 1536: 3 rows 130 us inline against 197 through the buffer; AVX-512 keeps
// its 8-row tiles inline and buffers beyond, as before).
constexpr int kInlineRows = hsdjax_simd::kRegisters >= 32 ? kTileRows : 2 * kTileRows;

// The two compressed formats (see the top of the file).
template <int BITS>
struct Format {
  static constexpr int64_t kRows = BITS == 4 ? 32 : 16;                // k per block
  static constexpr int64_t kHeader = (BITS == 4 ? 2 : 1) * kPanel * 4;  // scales (+ offsets), f32
  static constexpr int64_t kRowBytes = BITS * kPanel / 8;
  static constexpr int64_t kBlockBytes = kHeader + kRows * kRowBytes;
};
constexpr int64_t kBf16BlockRows = 32;  // k per decoded block of a bfloat16 panel

// Calls f(std::integral_constant<int, rows>) for 1 <= rows <= kTileRows (tile sizes are template
// arguments, so each one's accumulators live in registers).
template <int MT = kTileRows, typename F>
inline void WithRows(int64_t rows, F&& f) {
  if constexpr (MT > 1) {
    if (rows == MT) {
      f(std::integral_constant<int, MT>{});
      return;
    }
    WithRows<MT - 1>(rows, f);
  } else {
    f(std::integral_constant<int, 1>{});
  }
}

// The chains of MT rows of x (row stride k_len) over weight rows k0 .. k1 - 1, the weights of row k at
// w + (k - k0) * kPanel, continuing from acc.
template <int MT>
inline void Chain(const float* x, int64_t k_len, const float* w, int64_t k0, int64_t k1, vf (&acc)[MT][kVecs]) {
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + (k - k0) * kPanel;
    for (int m = 0; m < MT; ++m) {
      const vf xv = Splat(x[m * k_len + k]);
      for (int j = 0; j < kVecs; ++j) acc[m][j] += xv * Load(wk + j * kLanes);
    }
  }
}

// MT rows' 32 outputs of one panel for weight rows [k0, k1): chains start at zero when k0 == 0, else
// continue from what y holds (the same chain, paused between blocks), and end in y.
template <int MT>
void TileSpan(const float* x, int64_t k_len, const float* w, int64_t k0, int64_t k1, float* y, int64_t n) {
  vf acc[MT][kVecs];
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < kVecs; ++j) acc[m][j] = k0 == 0 ? vf{} : Load(y + m * n + j * kLanes);
  Chain<MT>(x, k_len, w, k0, k1, acc);
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < kVecs; ++j) Store(y + m * n + j * kLanes, acc[m][j]);
}

// Rows [0, m) of x against weight rows [k0, k1) of one panel (float32 rows at w), tile by tile.
void SweepRows(const float* x, int64_t m, int64_t k_len, const float* w, int64_t k0, int64_t k1, float* y,
               int64_t n) {
  for (int64_t m0 = 0; m0 < m; m0 += kTileRows) {
    WithRows(std::min<int64_t>(kTileRows, m - m0), [&](auto mt) {
      TileSpan<decltype(mt)::value>(x + m0 * k_len, k_len, w, k0, k1, y + m0 * n, n);
    });
  }
}

// Row kk of a compressed block decoded: its 32 weights, code * scale (exact) + offset.
template <int BITS>
inline void DecodeRow(const uint8_t* blk, int64_t kk, vf (&w)[kVecs]) {
  using F = Format<BITS>;
  const float* scale = reinterpret_cast<const float*>(blk);
  const uint8_t* codes = blk + F::kHeader + kk * F::kRowBytes;
  if constexpr (BITS == 4) {
    const float* offset = reinterpret_cast<const float*>(blk + kPanel * 4);
    hsdjax_simd::NibblesToFloat(codes, w);
    for (int j = 0; j < kVecs; ++j) w[j] = w[j] * Load(scale + j * kLanes) + Load(offset + j * kLanes);
  } else {
    hsdjax_simd::SignedBytesToFloat(codes, w);  // int8 codes
    for (int j = 0; j < kVecs; ++j) w[j] = w[j] * Load(scale + j * kLanes);
  }
}

// One block of a compressed panel decoded to float32 rows [kRows][32].
template <int BITS>
inline void DecodeBlock(const uint8_t* blk, float* out) {
  for (int64_t kk = 0; kk < Format<BITS>::kRows; ++kk) {
    vf w[kVecs];
    DecodeRow<BITS>(blk, kk, w);
    for (int j = 0; j < kVecs; ++j) Store(out + kk * kPanel + j * kLanes, w[j]);
  }
}

// Up to kTileRows rows of x against a whole compressed panel, each weight row decoded into registers and
// used at once by every row (the same chains as through the block buffer; no buffer round trip: a
// decoding step or a small tree pass pays one decode and its multiply-adds).
template <int BITS, int MT>
void DecodedRowsProduct(const float* x, int64_t k, const uint8_t* wq, float* y, int64_t n) {
  using F = Format<BITS>;
  vf acc[MT][kVecs] = {};
  for (int64_t b = 0; b < k / F::kRows; ++b) {
    const uint8_t* blk = wq + b * F::kBlockBytes;
    for (int64_t kk = 0; kk < F::kRows; ++kk) {
      vf w[kVecs];
      DecodeRow<BITS>(blk, kk, w);
      for (int m = 0; m < MT; ++m) {
        const vf xv = Splat(x[m * k + b * F::kRows + kk]);
        for (int j = 0; j < kVecs; ++j) acc[m][j] += xv * w[j];
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int j = 0; j < kVecs; ++j) Store(y + m * n + j * kLanes, acc[m][j]);
}


#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2 (4 vectors per panel row, 16 registers: full-panel tiles hold 3 rows): tiles of 4-6 rows over
// half a panel, vectors {H, H + 2} (columns 8H..8H+7 and 16+8H..16+8H+7: one 8-byte load of 4-bit codes
// holds both), so a 4-6 row tree pass decodes the panel once in all instead of once per 3-row tile, with
// 8-12 chains in flight. Each output's chain is unchanged (the same bits). 576x1536 4-bit, one thread,
// x86-64-v3 build on a Xeon: M = 4 134 -> 88 us, 5 148 -> 103, 6 166 -> 121 (M = 3: 83).
constexpr bool kHalfTiles = true;
template <int BITS, int H>
inline void DecodeHalfRow(const uint8_t* blk, int64_t kk, vf (&w)[2]) {
  using F = Format<BITS>;
  const float* scale = reinterpret_cast<const float*>(blk);
  const uint8_t* codes = blk + F::kHeader + kk * F::kRowBytes;
  __m256 c0, c1;
  if constexpr (BITS == 4) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * H)));
    c0 = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
    c1 = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
  } else {
    c0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * H))));
    c1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 16 + 8 * H))));
  }
  vf a, b;
  std::memcpy(&a, &c0, 32);
  std::memcpy(&b, &c1, 32);
  if constexpr (BITS == 4) {
    const float* offset = reinterpret_cast<const float*>(blk + kPanel * 4);
    w[0] = a * Load(scale + H * kLanes) + Load(offset + H * kLanes);
    w[1] = b * Load(scale + (H + 2) * kLanes) + Load(offset + (H + 2) * kLanes);
  } else {
    w[0] = a * Load(scale + H * kLanes);
    w[1] = b * Load(scale + (H + 2) * kLanes);
  }
}

template <int BITS, int MT, int H>
void DecodedHalfProduct(const float* x, int64_t k, const uint8_t* wq, float* y, int64_t n) {
  using F = Format<BITS>;
  vf acc[MT][2] = {};
  for (int64_t b = 0; b < k / F::kRows; ++b) {
    const uint8_t* blk = wq + b * F::kBlockBytes;
    for (int64_t kk = 0; kk < F::kRows; ++kk) {
      vf w[2];
      DecodeHalfRow<BITS, H>(blk, kk, w);
      for (int m = 0; m < MT; ++m) {
        const vf xv = Splat(x[m * k + b * F::kRows + kk]);
        acc[m][0] += xv * w[0];
        acc[m][1] += xv * w[1];
      }
    }
  }
  for (int m = 0; m < MT; ++m) {
    Store(y + m * n + H * kLanes, acc[m][0]);
    Store(y + m * n + (H + 2) * kLanes, acc[m][1]);
  }
}
#else
constexpr bool kHalfTiles = false;
template <int BITS, int MT, int H>
void DecodedHalfProduct(const float*, int64_t, const uint8_t*, float*, int64_t) {}
#endif
// Rows of a bfloat16 panel as float32: the 16 bits become the high half of the float (exact).
inline void DecodeBf16Rows(const uint16_t* p, int64_t rows, float* out) {
  typedef uint16_t u16v __attribute__((vector_size(2 * kLanes)));
  typedef uint32_t u32v __attribute__((vector_size(4 * kLanes)));
  for (int64_t i = 0; i < rows * kPanel; i += kLanes) {
    u16v h;
    __builtin_memcpy(&h, p + i, sizeof(h));
    const u32v bits = __builtin_convertvector(h, u32v) << 16;
    __builtin_memcpy(out + i, &bits, sizeof(bits));
  }
}

// Rows [0, m) of x against one panel in any of the float formats (bits 32: float32, 16: bfloat16, 4 / 8:
// compressed) into y's 32 columns of the panel. A compressed or bfloat16 panel is decoded a block at a
// time into buf (kBf16BlockRows x 32 floats) shared by all tiles.
void PanelProduct(const float* x, int64_t m, int64_t k, const void* panel, int bits, float* y, int64_t n,
                  float* buf) {
  if (bits == 32) {
    SweepRows(x, m, k, static_cast<const float*>(panel), 0, k, y, n);
    return;
  }
  if (bits == 16) {
    const uint16_t* wb = static_cast<const uint16_t*>(panel);
    for (int64_t k0 = 0; k0 < k; k0 += kBf16BlockRows) {
      const int64_t k1 = std::min<int64_t>(k, k0 + kBf16BlockRows);
      DecodeBf16Rows(wb + k0 * kPanel, k1 - k0, buf);
      SweepRows(x, m, k, buf, k0, k1, y, n);
    }
    return;
  }
  const uint8_t* wq = static_cast<const uint8_t*>(panel);
  if (kHalfTiles && m > kTileRows && m <= 6) {  // AVX2, 4-6 rows: two half-panel tiles, one decode in all
    WithRows<6>(m, [&](auto mt) {
      constexpr int MT = decltype(mt)::value;
      if (bits == 4) {
        DecodedHalfProduct<4, MT, 0>(x, k, wq, y, n);
        DecodedHalfProduct<4, MT, 1>(x, k, wq, y, n);
      } else {
        DecodedHalfProduct<8, MT, 0>(x, k, wq, y, n);
        DecodedHalfProduct<8, MT, 1>(x, k, wq, y, n);
      }
    });
    return;
  }
  if (m <= kInlineRows) {  // a decoding step or a small tree pass: no buffer
    for (int64_t m0 = 0; m0 < m; m0 += kTileRows) {
      WithRows(std::min<int64_t>(kTileRows, m - m0), [&](auto mt) {
        if (bits == 4) DecodedRowsProduct<4, decltype(mt)::value>(x + m0 * k, k, wq, y + m0 * n, n);
        else DecodedRowsProduct<8, decltype(mt)::value>(x + m0 * k, k, wq, y + m0 * n, n);
      });
    }
    return;
  }
  auto blocks = [&](auto format, auto decode) {
    using F = decltype(format);
    for (int64_t b = 0; b < k / F::kRows; ++b) {
      decode(wq + b * F::kBlockBytes, buf);
      SweepRows(x, m, k, buf, b * F::kRows, (b + 1) * F::kRows, y, n);
    }
  };
  if (bits == 4) blocks(Format<4>{}, DecodeBlock<4>);
  else blocks(Format<8>{}, DecodeBlock<8>);
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

// ---- integer pair tiles (AVX2 and NEON): the int8x / int16x products without VNNI --------------------
// Without a dot product of bytes, a k pair of codes is widened to int16 (4-bit: 0..15; 8-bit: signed)
// and multiplied with the pair of quantized activations (int8 or int16 values, widened alike), both
// products of a lane added in int32: AVX2's vpmaddwd, NEON's smlal / smlal2 (one k at a time). The sums
// are exact (|q| <= 32767, 32 k), so they equal VNNI's. Per block the float32 chains pause in y (loaded,
// the VNNI tiles' fused multiply-adds, stored): y = fma(offset, sum(q) * scale, y) (4-bit), then
// y = fma(d * scale, float(sum(q * code)), y): every output the VNNI build's sequence of operations.
#if (defined(__AVX2__) && defined(__FMA__)) || defined(__aarch64__)
#define HSDJAX_PAIR_TILES 1
// The two activations of a k pair as int16 halves of one word (the first k in the low half).
template <typename Q>
inline uint32_t ActivationPair(const Q* q) {
  return static_cast<uint16_t>(static_cast<int16_t>(q[0])) |
         static_cast<uint32_t>(static_cast<uint16_t>(static_cast<int16_t>(q[1]))) << 16;
}

#if defined(__AVX2__)
constexpr int kPairVecs = 4;  // 8 int32 columns per vector
typedef __m256i PairAcc;
// A k pair's codes as int16 (row 0, row 1) pairs per lane: columns 0-7, 8-15, 16-23, 24-31.
template <int BITS>
inline void PairCodes(const uint8_t* rows, __m256i w[4]) {
  if constexpr (BITS == 4) {  // a row's byte c holds column c (low nibble) and c + 16 (high)
    const __m128i nib = _mm_set1_epi8(15);
    const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows));
    const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + 16));
    const __m128i lo = _mm_unpacklo_epi8(r0, r1), hi = _mm_unpackhi_epi8(r0, r1);
    w[0] = _mm256_cvtepu8_epi16(_mm_and_si128(lo, nib));
    w[1] = _mm256_cvtepu8_epi16(_mm_and_si128(hi, nib));
    w[2] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(lo, 4), nib));
    w[3] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(hi, 4), nib));
  } else {  // a row is 32 signed bytes, column c at byte c
    for (int h = 0; h < 2; ++h) {
      const __m128i r0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + 16 * h));
      const __m128i r1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows + 32 + 16 * h));
      w[2 * h] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(r0, r1));
      w[2 * h + 1] = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(r0, r1));
    }
  }
}
inline void PairZero(__m256i* acc) {
  for (int j = 0; j < kPairVecs; ++j) acc[j] = _mm256_setzero_si256();
}
inline void PairAdd(__m256i* acc, const __m256i* w, uint32_t pair) {
  const __m256i xv = _mm256_set1_epi32(static_cast<int>(pair));
  for (int j = 0; j < kPairVecs; ++j) acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(w[j], xv));
}
// y[0:8] = fma(o, sx, y) (with o) then fma(d * scale, float(acc), y); y starts at 0 when first.
inline void PairStore(float* y, const float* d, const float* o, float sx, float scale, __m256i acc, bool first) {
  __m256 a = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y);
  if (o) a = _mm256_fmadd_ps(_mm256_loadu_ps(o), _mm256_set1_ps(sx), a);
  a = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(d), _mm256_set1_ps(scale)), _mm256_cvtepi32_ps(acc), a);
  _mm256_storeu_ps(y, a);
}
#else  // NEON
constexpr int kPairVecs = 8;  // 4 int32 columns per vector
typedef int32x4_t PairAcc;
// A k pair's codes as int16: per row (w[0..3] row 0, w[4..7] row 1) columns 0-7, 8-15, 16-23, 24-31.
template <int BITS>
inline void PairCodes(const uint8_t* rows, int16x8_t w[8]) {
  for (int r = 0; r < 2; ++r) {
    if constexpr (BITS == 4) {
      const uint8x16_t bytes = vld1q_u8(rows + 16 * r);
      const uint8x16_t lo = vandq_u8(bytes, vdupq_n_u8(15)), hi = vshrq_n_u8(bytes, 4);
      w[4 * r] = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(lo)));
      w[4 * r + 1] = vreinterpretq_s16_u16(vmovl_high_u8(lo));
      w[4 * r + 2] = vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(hi)));
      w[4 * r + 3] = vreinterpretq_s16_u16(vmovl_high_u8(hi));
    } else {
      const int8x16_t c0 = vld1q_s8(reinterpret_cast<const int8_t*>(rows + 32 * r));
      const int8x16_t c1 = vld1q_s8(reinterpret_cast<const int8_t*>(rows + 32 * r + 16));
      w[4 * r] = vmovl_s8(vget_low_s8(c0));
      w[4 * r + 1] = vmovl_high_s8(c0);
      w[4 * r + 2] = vmovl_s8(vget_low_s8(c1));
      w[4 * r + 3] = vmovl_high_s8(c1);
    }
  }
}
inline void PairZero(int32x4_t* acc) {
  for (int j = 0; j < kPairVecs; ++j) acc[j] = vdupq_n_s32(0);
}
inline void PairAdd(int32x4_t* acc, const int16x8_t* w, uint32_t pair) {
  const int16_t q[2] = {static_cast<int16_t>(pair & 0xFFFF), static_cast<int16_t>(pair >> 16)};
  for (int r = 0; r < 2; ++r)
    for (int j = 0; j < 4; ++j) {
      acc[2 * j] = vmlal_n_s16(acc[2 * j], vget_low_s16(w[4 * r + j]), q[r]);
      acc[2 * j + 1] = vmlal_high_n_s16(acc[2 * j + 1], w[4 * r + j], q[r]);
    }
}
inline void PairStore(float* y, const float* d, const float* o, float sx, float scale, int32x4_t acc, bool first) {
  float32x4_t a = first ? vdupq_n_f32(0.0f) : vld1q_f32(y);
  if (o) a = vfmaq_f32(a, vld1q_f32(o), vdupq_n_f32(sx));
  a = vfmaq_f32(a, vmulq_f32(vld1q_f32(d), vdupq_n_f32(scale)), vcvtq_f32_s32(acc));
  vst1q_f32(y, a);
}
#endif

// MT rows of quantized activations q [MT, k_len] (int8 or int16 values) against one 4- or 8-bit panel;
// sq: their scale per 32 k, xs: sum(q) * scale per 32 k (4-bit only; 8-bit blocks have no offset).
template <int MT, int BITS, typename Q>
void PairTile(const Q* q, const float* sq, const float* xs, int64_t k_len, const uint8_t* panel, float* y, int64_t n) {
  using F = Format<BITS>;
  constexpr int kLanesPerVec = 32 / kPairVecs;
  const int64_t x_blocks = k_len / 32;
  for (int64_t b = 0; b < k_len / F::kRows; ++b) {
    const uint8_t* blk = panel + b * F::kBlockBytes;
    PairAcc acc[MT][kPairVecs];
    for (int m = 0; m < MT; ++m) PairZero(acc[m]);
    for (int64_t kp = 0; kp < F::kRows / 2; ++kp) {
#if defined(__AVX2__)
      __m256i w[4];
#else
      int16x8_t w[8];
#endif
      PairCodes<BITS>(blk + F::kHeader + 2 * kp * F::kRowBytes, w);
      const int64_t k0 = b * F::kRows + 2 * kp;
      for (int m = 0; m < MT; ++m) PairAdd(acc[m], w, ActivationPair(q + m * k_len + k0));
    }
    const int64_t xb = BITS == 4 ? b : b / 2;  // the 32 k of x the block lies in
    const float* d = reinterpret_cast<const float*>(blk);
    for (int m = 0; m < MT; ++m)
      for (int j = 0; j < kPairVecs; ++j)
        PairStore(y + m * n + kLanesPerVec * j, d + kLanesPerVec * j,
                  BITS == 4 ? reinterpret_cast<const float*>(blk + 128) + kLanesPerVec * j : nullptr,
                  BITS == 4 ? xs[m * x_blocks + xb] : 0.0f, sq[m * x_blocks + xb], acc[m][j], b == 0);
  }
}
#else
#define HSDJAX_PAIR_TILES 0
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
constexpr int kInt8Rows = 4;

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
#elif HSDJAX_PAIR_TILES
// AVX2 or NEON (no four-k dot product of bytes): the pair tiles above on the int8 activations, whose
// integer sums equal VNNI's (exact either way), followed by the same float32 operations: the same bits.
constexpr bool kHaveInt8x = true;
constexpr int kInt8Rows = 2;

template <int MT>
void ITile(const uint32_t* xq, const float* sq, const float* xs, int64_t k_len, const uint8_t* panel, float* y,
           int64_t n) {
  PairTile<MT, 4>(reinterpret_cast<const int8_t*>(xq), sq, xs, k_len, panel, y, n);
}

template <int MT>
void ITile8(const uint32_t* xq, const float* sq, int64_t k_len, const uint8_t* panel, float* y, int64_t n) {
  PairTile<MT, 8>(reinterpret_cast<const int8_t*>(xq), sq, nullptr, k_len, panel, y, n);
}
#else
constexpr bool kHaveInt8x = false;
constexpr int kInt8Rows = 1;
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
constexpr int kInt16Rows = 4;  // 4 rows per tile (8 accumulators of 32 registers)

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
#elif HSDJAX_PAIR_TILES
// AVX2 or NEON: the pair tiles above on the int16 activations (the same bits as the VNNI tile).
constexpr bool kHaveInt16x = true;
constexpr int kInt16Rows = 2;

template <int MT>
void WTile(const uint32_t* xw, const float* sq, const float* xs, int64_t k_len, const uint8_t* panel, float* y,
           int64_t n) {
  PairTile<MT, 4>(reinterpret_cast<const int16_t*>(xw), sq, xs, k_len, panel, y, n);
}
#else
constexpr bool kHaveInt16x = false;
constexpr int kInt16Rows = 1;
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

  // Whether this panel format goes through the activation modes' own tiles (bf16x / int16x: 4-bit
  // blocks; int8x: 4- and 8-bit); other panels keep the float32 chains.
  bool QuantizedActivations() const { return (xq && (bits == 4 || bits == 8)) || ((xb || xw) && bits == 4); }
};

// Rows [m0, m0 + rows) (rows <= 8) of x against one compressed panel through the activation modes'
// tiles (AVX-512 builds only); y points at the panel's first column.
void ActivationRows(const Work& w, const uint8_t* pq, float* y, int64_t m0, int64_t rows) {
  float* ys = y + m0 * w.n;
  const float* xsr = w.xs ? w.xs + m0 * (w.k / 32) : nullptr;
  const float* sqr = w.sq ? w.sq + m0 * (w.k / 32) : nullptr;
  // Integer tiles of kInt16Rows / kInt8Rows rows: 4 with AVX-512 VNNI (8 would spill), 2 with AVX2's 16
  // registers and NEON's 8 accumulators a row.
  if (w.xw) {
    for (int64_t r0 = 0; r0 < rows; r0 += kInt16Rows) {
      const int64_t st = r0 * (w.k / 32);
      WithRows<kInt16Rows>(std::min<int64_t>(kInt16Rows, rows - r0), [&](auto mt) {
        WTile<decltype(mt)::value>(w.xw + (m0 + r0) * (w.k / 2), sqr + st, xsr + st, w.k, pq, ys + r0 * w.n, w.n);
      });
    }
  } else if (w.xq) {
    for (int64_t r0 = 0; r0 < rows; r0 += kInt8Rows) {
      const int64_t bt = r0 * (w.k / 32);
      const uint32_t* xqr = w.xq + (m0 + r0) * (w.k / 4);
      WithRows<kInt8Rows>(std::min<int64_t>(kInt8Rows, rows - r0), [&](auto mt) {
        if (w.bits == 8) {
          ITile8<decltype(mt)::value>(xqr, sqr + bt, w.k, pq, ys + r0 * w.n, w.n);
        } else {
          ITile<decltype(mt)::value>(xqr, sqr + bt, xsr + bt, w.k, pq, ys + r0 * w.n, w.n);
        }
      });
    }
  }
  if (w.xb) {  // bf16x: tiles of up to 8 rows
    const uint32_t* xbr = w.xb + m0 * (w.k / 2);
    WithRows<8>(rows, [&](auto mt) { XTile<decltype(mt)::value, 4>(xbr, xsr, w.k, pq, ys, w.n); });
  }
}

// ---- exact greedy tokens through an int8 screen (`screened_argmax`) -----------------------------------
// The index of each row's largest logit, as the float32 chains compute the logits, without running the
// chains over the whole vocabulary. The int8x products give every logit up to a bound: x differs from
// its int8 rounding by at most half a step, max|x_b| / 254, in each block b of 32 k, so a logit differs
// by at most sum_b max|x_b| / 254 * sum_{k in b} |w_kv| (plus float32 rounding of both products, far
// below the 2^-11 slack added here). Only a column whose upper bound reaches the largest lower bound can
// hold the maximum; the float32 chains then run on the panels holding those columns (PanelProduct, the same
// chains as the full product, so the same values bit for bit) and the first largest value wins, as in
// argmax. Rows that hold a NaN or an infinity run the chains on every panel.
constexpr float kScreenSlack = 0.5f / 127.f + 1.f / 2048.f;

// Panel p's upper bounds per column (written over its int8x products in y) and, per row, the panel's
// largest lower and upper bound (w.lo_max / w.hi_max [M, N/32]).
inline float MaxOf(const vf* a) {
  float out = a[0][0];
  for (int j = 0; j < kVecs; ++j)
    for (int l = 0; l < kLanes; ++l) out = std::max(out, a[j][l]);
  return out;
}

void Bounds(const Work& w, int64_t p) {
  const int64_t blocks = w.k / 32, panels = w.n / kPanel;
  const float* a = w.colabs + p * blocks * kPanel;
  for (int64_t m = 0; m < w.m; ++m) {
    const float* sq = w.sq + m * blocks;  // max|x_b| / 127
    vf e[kVecs] = {};
    for (int64_t b = 0; b < blocks; ++b) {
      const float s = sq[b] * 127.f;
      for (int j = 0; j < kVecs; ++j) e[j] += s * Load(a + b * kPanel + j * kLanes);
    }
    float* y = w.y + m * w.n + p * kPanel;
    vf lo[kVecs], hi[kVecs];
    for (int j = 0; j < kVecs; ++j) {
      const vf y0 = Load(y + j * kLanes), ej = e[j] * kScreenSlack;
      lo[j] = y0 - ej;
      hi[j] = y0 + ej;
      Store(y + j * kLanes, hi[j]);
    }
    w.lo_max[m * panels + p] = MaxOf(lo);
    w.hi_max[m * panels + p] = MaxOf(hi);
  }
}

// Every panel of the chunk [p0, p1) for all rows: the float32 chains (PanelProduct), or the activation
// modes' tiles.
void Panels(const Work& w) {
  alignas(64) float buf[kBf16BlockRows * kPanel];  // one decoded block (4 KB)
  const bool quantized = w.QuantizedActivations();
  for (int64_t p = w.p0; p < w.p1; ++p) {
    const void* panel = static_cast<const uint8_t*>(w.wp) + p * w.panel_bytes;
    float* y = w.y + p * kPanel;
    if (quantized) {
      for (int64_t m0 = 0; m0 < w.m; m0 += 8)
        ActivationRows(w, static_cast<const uint8_t*>(panel), y, m0, std::min<int64_t>(8, w.m - m0));
    } else {
      PanelProduct(w.x, w.m, w.k, panel, w.bits, y, w.n, buf);
    }
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
  while (call->done.load(std::memory_order_acquire) < call->chunks) hsdjax_simd::CpuRelax();
  return ffi::Error::Success();
}

// Float32 or bfloat16 panels [N/32, K, 32] (or a stack of them over layers, [L, N/32, K, 32], and the
// layer to read): one row of 32 values per k, `bits` wide each.
template <ffi::DataType T>
ffi::Error WidePanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<T> wp,
                           ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, int bits,
                           const char* bad_shape) {
  auto xd = x.dimensions();
  auto wd = wp.dimensions();
  const int64_t at = layer.element_count() == 1 ? hsdjax_simd::LayerOffset(wd, 3, layer.typed_data()[0]) : -1;
  if (xd.size() != 2 || at < 0 || wd[wd.size() - 1] != kPanel || xd[1] != wd[wd.size() - 2]) {
    return ffi::Error::InvalidArgument(bad_shape);
  }
  const int64_t m = xd[0], k = xd[1], panels = wd[wd.size() - 3];
  const auto* w = static_cast<const uint8_t*>(wp.untyped_data()) + at * (bits / 8);
  return RunChunks(pool, Work{x.typed_data(), m, k, w, k * kPanel * (bits / 8), bits, 0, panels, y->typed_data(),
                              panels * kPanel});
}

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wp,
                       ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  return WidePanelMatmul(pool, x, wp, layer, y, 32,
                         "hsdjax panel matmul: expects x [M, K], panels [(L,) N/32, K, 32] and a layer in range");
}

ffi::Error Bf16Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::BF16> wb,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  return WidePanelMatmul(pool, x, wb, layer, y, 16,
                         "hsdjax bfloat16 matmul: expects x [M, K], panels [(L,) N/32, K, 32] and a layer in range");
}

enum class Activations { kFloat32, kBf16, kInt8, kInt16 };

// Compressed panels [N/32, K/L, B] (or a stack of them over layers, [L, N/32, K/L, B], and the layer to read).
ffi::Error Compressed(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::U8>& wq,
                      ffi::Buffer<ffi::S32>& layer, ffi::ResultBuffer<ffi::F32>& y, Activations act) {
  auto xd = x.dimensions();
  auto wd = wq.dimensions();
  const int64_t at = layer.element_count() == 1 ? hsdjax_simd::LayerOffset(wd, 3, layer.typed_data()[0]) : -1;
  if (xd.size() != 2 || at < 0) {
    return ffi::Error::InvalidArgument(
        "hsdjax compressed matmul: expects x [M, K], panels [(L,) N/32, K/L, B] and a layer in range");
  }
  const size_t r = wd.size() - 3;  // 1 for a stack over layers
  const int64_t m = xd[0], k = xd[1], panels = wd[r], blocks = wd[r + 1], block = wd[r + 2];
  int bits;
  if (block == Format<4>::kBlockBytes && k == blocks * Format<4>::kRows) {
    bits = 4;
  } else if (block == Format<8>::kBlockBytes && k == blocks * Format<8>::kRows) {
    bits = 8;
  } else {
    return ffi::Error::InvalidArgument("hsdjax compressed matmul: blocks are 768 bytes per 32 k (4-bit) "
                                       "or 640 per 16 (8-bit)");
  }
  Work all{x.typed_data(), m, k, wq.typed_data() + at, blocks * block, bits, 0, panels, y->typed_data(),
           panels * kPanel};
  std::unique_ptr<uint32_t[]> xb, xw;
  std::unique_ptr<float[]> xs, sq;
  if (act == Activations::kInt8 && k % 32 == 0) {  // x is quantized per 32 k (else: the float32 chains)
    if (!kHaveInt8x) {
      return ffi::Error::InvalidArgument("hsdjax int8x matmul: this build has no integer products (AVX512-VNNI, AVX2 or NEON)");
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
      return ffi::Error::InvalidArgument(
          "hsdjax int16x matmul: this build has no integer products (AVX512-VNNI, AVX2 or NEON)");
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
                            ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  return Compressed(pool, x, wq, layer, y, Activations::kFloat32);
}

ffi::Error CompressedMatmulBf16x(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wq,
                                 ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  return Compressed(pool, x, wq, layer, y, Activations::kBf16);
}

ffi::Error CompressedMatmulInt8x(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wq,
                                 ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  return Compressed(pool, x, wq, layer, y, Activations::kInt8);
}

ffi::Error CompressedMatmulInt16x(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::U8> wq,
                                  ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  return Compressed(pool, x, wq, layer, y, Activations::kInt16);
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
  alignas(64) float buf[kBf16BlockRows * kPanel];
  for (int64_t i = 0; i < count; ++i) {
    const int64_t p = panels[i];
    PanelProduct(x, 1, k, wq + p * panel_bytes, 8, y, kPanel, buf);
    for (int64_t j = 0; j < kPanel; ++j) {
      if (keep(p * kPanel + j)) best.Offer(p * kPanel + j, y[j]);
    }
  }
  return best;
}

// Each row's argmax through the screen: x [m, k], 8-bit panels w [panels, k/16, 640], their column sums
// of |w| colabs [panels, k/32, 32]; run_panels(work) computes the int8 products and bounds of every panel
// (on a thread pool under XLA, serially in the self-test).
template <typename RunPanels>
void ScreenArgmax(const float* xs, int64_t m, int64_t k, const uint8_t* w, int64_t panels, const float* colabs,
                  int32_t* out, RunPanels&& run_panels) {
  const int64_t n = panels * kPanel, blocks = k / 32;
  const int64_t panel_bytes = k / Format<8>::kRows * Format<8>::kBlockBytes;
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
  all.colabs = colabs;
  all.lo_max = lo_max.get();
  all.hi_max = hi_max.get();
  run_panels(all);
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
    out[r] = static_cast<int32_t>(best.index);
  }
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
    return ffi::Error::InvalidArgument(
        "hsdjax screened argmax: this build has no integer products (AVX512-VNNI, AVX2 or NEON)");
  }
  ScreenArgmax(x.typed_data(), xd[0], xd[1], wq.typed_data(), wd[0], colabs.typed_data(), out->typed_data(),
               [&](const Work& all) { RunChunks(pool, all); });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxPanelMatmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // the layer of a stacked weight (0: unstacked)
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxBf16Matmul, Bf16Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // the layer of a stacked weight (0: unstacked)
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxCompressedMatmul, CompressedMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // the layer of a stacked weight (0: unstacked)
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxCompressedMatmulBf16x, CompressedMatmulBf16x,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // the layer of a stacked weight (0: unstacked)
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxCompressedMatmulInt8x, CompressedMatmulInt8x,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // the layer of a stacked weight (0: unstacked)
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxCompressedMatmulInt16x, CompressedMatmulInt16x,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // the layer of a stacked weight (0: unstacked)
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxScreenedArgmax, ScreenedArgmax,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

// Whether this build has the int8-activation products (AVX512-VNNI and AVX512-VBMI, AVX2, or NEON).
extern "C" int HsdjaxHasInt8x() { return kHaveInt8x ? 1 : 0; }

// k per integer instruction of the int8 products: 4 (VNNI's byte dot products), 2 (the pair tiles), 0.
extern "C" int HsdjaxInt8KPerInstruction() { return !kHaveInt8x ? 0 : HSDJAX_PAIR_TILES && kInt8Rows == 2 ? 2 : 4; }

// Whether this build has the int16-activation products (AVX512-VNNI and AVX512-BW, AVX2, or NEON).
extern "C" int HsdjaxHasInt16x() { return kHaveInt16x ? 1 : 0; }

// Whether this build has the bfloat16-activation products (AVX512-BF16 and AVX512-VBMI).
extern "C" int HsdjaxHasBf16x() { return kHaveBf16x ? 1 : 0; }

// The instruction set this library was compiled for ("avx512", "avx2", "neon", "generic") and the floats
// per native vector.
extern "C" const char* HsdjaxIsa() { return hsdjax_simd::kIsa; }
extern "C" int HsdjaxLanes() { return hsdjax_simd::kLanes; }
