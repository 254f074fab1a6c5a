// The native vector of the instruction set the kernels are compiled for, shared by cpu_matmul.cc and
// cpu_attention.cc: 16 floats with AVX-512, 8 with AVX2 + FMA (x86-64-v3), 4 with NEON (aarch64) and
// 4 elsewhere (SSE, or whatever GCC's generic vectors become). Every kernel is written against `vf`
// (kLanes floats) and sizes its register blocking by kRegisters, so no operation is split by the
// compiler into halves or quarters kept on the stack (what a 64-byte vector type did without AVX-512).
// Byte -> float and half -> float conversions use the instruction set's own widening instructions.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
// GCC 12 warns inside its own AVX-512 headers (their _mm512_undefined_ps() idiom, GCC bug 105593),
// wherever a kernel converts with them; the warning is about the header, not about our code.
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ == 12
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif

namespace hsdjax_simd {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kRegisters = 32;
constexpr const char* kIsa = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int kLanes = 8;
constexpr int kRegisters = 16;
constexpr const char* kIsa = "avx2";
#elif defined(__aarch64__)
constexpr int kLanes = 4;
constexpr int kRegisters = 32;
constexpr const char* kIsa = "neon";
#else
constexpr int kLanes = 4;
constexpr int kRegisters = 16;
constexpr const char* kIsa = "generic";
#endif

// Whether a * b + c is one fused instruction (then every chain of multiply-adds rounds once per step,
// the same on every instruction set that has it, so products are bitwise equal across them).
#if defined(__FMA__) || defined(__aarch64__) || defined(__AVX512F__)
constexpr bool kFused = true;
#else
constexpr bool kFused = false;
#endif

// A float16 value as stored (the KV cache's half precision): GCC's _Float16 on x86, __fp16 on ARM
// (GCC 12's C++ has no _Float16 there).
#if defined(__aarch64__)
typedef __fp16 half;
#else
typedef _Float16 half;
#endif

typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef uint8_t u8x16 __attribute__((vector_size(16)));

// Unaligned loads and stores through a may_alias vector type (one instruction each).
typedef float vf_unaligned __attribute__((vector_size(4 * kLanes), aligned(4), may_alias));

inline vf Load(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }

inline void Store(float* p, const vf& v) { *reinterpret_cast<vf_unaligned*>(p) = v; }

inline vf Splat(float x) {  // every lane x (bitwise: not 0 + x, which would turn -0 into +0)
#if defined(__AVX512F__)
  return (vf)_mm512_set1_ps(x);
#elif defined(__AVX2__) && defined(__FMA__)
  return (vf)_mm256_set1_ps(x);
#elif defined(__aarch64__)
  return (vf)vdupq_n_f32(x);
#else
  vf v;
  for (int i = 0; i < kLanes; ++i) v[i] = x;
  return v;
#endif
}

// 16 bytes (codes) widened to 16 floats, 16 / kLanes vectors (small integers: exact).
template <bool kSigned>
inline void Bytes16ToFloat(u8x16 b, vf* out) {
#if defined(__AVX512F__)
  __m128i raw;
  std::memcpy(&raw, &b, 16);
  const __m512 f = _mm512_cvtepi32_ps(kSigned ? _mm512_cvtepi8_epi32(raw) : _mm512_cvtepu8_epi32(raw));
  std::memcpy(out, &f, 64);
#elif defined(__AVX2__) && defined(__FMA__)
  __m128i raw;
  std::memcpy(&raw, &b, 16);
  const __m128i high = _mm_unpackhi_epi64(raw, raw);
  const __m256 f0 = _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw));
  const __m256 f1 = _mm256_cvtepi32_ps(kSigned ? _mm256_cvtepi8_epi32(high) : _mm256_cvtepu8_epi32(high));
  std::memcpy(out, &f0, 32);
  std::memcpy(out + 1, &f1, 32);
#elif defined(__aarch64__)
  if constexpr (kSigned) {
    int8x16_t raw;
    std::memcpy(&raw, &b, 16);
    const int16x8_t lo = vmovl_s8(vget_low_s8(raw)), hi = vmovl_s8(vget_high_s8(raw));
    const float32x4_t f[4] = {vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))),
                              vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)))};
    std::memcpy(out, f, 64);
  } else {
    uint8x16_t raw;
    std::memcpy(&raw, &b, 16);
    const uint16x8_t lo = vmovl_u8(vget_low_u8(raw)), hi = vmovl_u8(vget_high_u8(raw));
    const float32x4_t f[4] = {vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo))), vcvtq_f32_u32(vmovl_u16(vget_high_u16(lo))),
                              vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi))), vcvtq_f32_u32(vmovl_u16(vget_high_u16(hi)))};
    std::memcpy(out, f, 64);
  }
#else
  float f[16];
  for (int j = 0; j < 16; ++j) f[j] = kSigned ? static_cast<float>(static_cast<int8_t>(b[j])) : static_cast<float>(b[j]);
  std::memcpy(out, f, 64);
#endif
}

// 16 bytes of 4-bit codes at p (column j in the low nibble of byte j, column j + 16 in the high one)
// as 32 floats, 32 / kLanes vectors in column order (exact).
inline void NibblesToFloat(const uint8_t* p, vf* out) {
#if defined(__AVX512F__)
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i nib = _mm512_set1_epi32(15);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, nib));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  std::memcpy(out, &lo, 64);
  std::memcpy(out + 1, &hi, 64);
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256i nib = _mm256_set1_epi32(15);
  for (int half = 0; half < 2; ++half) {  // bytes 0-7 (columns 0-7 and 16-23), then 8-15
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * half)));
    const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, nib));
    const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
    std::memcpy(out + half, &lo, 32);
    std::memcpy(out + 2 + half, &hi, 32);
  }
#else
  u8x16 b;
  std::memcpy(&b, p, 16);
  Bytes16ToFloat<false>(b & 15, out);
  Bytes16ToFloat<false>(b >> 4, out + 16 / kLanes);
#endif
}

// 32 int8 codes at p as 32 floats, 32 / kLanes vectors (exact).
inline void SignedBytesToFloat(const uint8_t* p, vf* out) {
#if defined(__AVX512F__)
  for (int i = 0; i < 2; ++i) {
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * i))));
    std::memcpy(out + i, &f, 64);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  for (int i = 0; i < 4; ++i) {
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
    std::memcpy(out + i, &f, 32);
  }
#else
  u8x16 b0, b1;
  std::memcpy(&b0, p, 16);
  std::memcpy(&b1, p + 16, 16);
  Bytes16ToFloat<true>(b0, out);
  Bytes16ToFloat<true>(b1, out + 16 / kLanes);
#endif
}

// kLanes halves widened to float32 (exact).
inline vf HalfToFloat(const half* p) {
#if defined(__AVX512F__)
  const __m512 f = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX2__) && defined(__F16C__)
  const __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__aarch64__)
  float16x4_t h;
  std::memcpy(&h, p, 8);
  const float32x4_t f = vcvt_f32_f16(h);
#else
  float f[kLanes];
  for (int j = 0; j < kLanes; ++j) f[j] = static_cast<float>(p[j]);
#endif
  vf out;
  std::memcpy(&out, &f, sizeof(vf));
  return out;
}

// A spinning thread's hint to the core (x86 pause, ARM yield).
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// The element offset of the operand a kernel call reads inside a stack over layers: an operand of
// `rank` dimensions is read whole (layer must be 0); one of rank + 1 is [L, ...] and its slice `layer`
// is read in place (the scanned layer loop passes the whole stack and the loop's index, so XLA copies
// nothing out of it). -1: neither rank, or the layer out of range.
template <typename Dims>
inline int64_t LayerOffset(const Dims& dims, size_t rank, int64_t layer) {
  if (dims.size() == rank) return layer == 0 ? 0 : -1;
  if (dims.size() != rank + 1 || layer < 0 || layer >= dims[0]) return -1;
  int64_t per_layer = 1;
  for (size_t i = 1; i < dims.size(); ++i) per_layer *= dims[i];
  return layer * per_layer;
}

}  // namespace hsdjax_simd
