// hsdjax's CPU attention over the KV cache for decoding (an XLA FFI custom call; optional, built with the
// matmul kernel by `hsdjax cpu-matmul build`).
//
//   q [B, K, R, D] float32, already scaled (R = G query heads x T new tokens of one kv head)
//   cache_k, cache_v [B, K, S, D] float32 or float16 (two handlers); lens [B] int32 (slots >= lens[b]
//   are not attended); a float16 cache is widened to float32 as it is read (half the bytes to stream)
//   -> m [B, K, R], l [B, K, R], acc [B, K, R, D]: the online-softmax state of the cache part (running
//      max, sum of exp(score - m), sum of exp(score - m) * v), which the caller merges with the new
//      tokens' part. A row with no valid slot gets m = -1e30, l = 0, acc = 0.
//
// Work only follows the filled length: each (b, kv head) walks its valid slots in chunks of 256, the
// chunks shared between the calling thread and XLA's intra-op pool (flash-decoding: each chunk keeps its
// own max, sum and accumulator, merged at the end in chunk order, so the result does not depend on
// which thread ran what). XLA's while loop over cache blocks spent ~100 us per block on this CPU.
//
// Vectors are the instruction set's own (`vf`, kLanes floats, cpu_simd.h: 16 with AVX-512, 8 with AVX2,
// 4 with NEON or generic), but the arithmetic is defined on *logical 16-lane groups*, whatever kLanes
// is, so every instruction set computes the same bits: a dot product over d accumulates logical lane
// l (l = 0..15) over elements l, l + 16, l + 32, ... in order with fused multiply-adds (kG = 16 / kLanes
// native vectors per group), then sums the 16 lanes by one tree of halves (lane l + lane l + 8, then
// l + l + 4, l + l + 2, l + l + 1): the levels wider than a native vector are vertical adds of the
// group's vectors (Fold), the rest in-vector shuffles. Elementwise steps (exp, the weighted sum of
// values per value dimension) do the same operations per element. Register blocking (rows x keys of
// the score tiles, rows x columns of the value tiles) is sized from kLanes and kRegisters, so nothing
// spills with AVX2's 16 registers while AVX-512 keeps 16+ accumulators.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "cpu_simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using hsdjax_simd::kLanes;
using hsdjax_simd::kRegisters;
using hsdjax_simd::Load;
using hsdjax_simd::Splat;
using hsdjax_simd::Store;
using hsdjax_simd::vf;

typedef int32_t vi __attribute__((vector_size(4 * kLanes)));
constexpr int kG = 16 / kLanes;  // native vectors per logical 16-lane group
constexpr int64_t kChunk = 256;
constexpr float kNegInf = -1e30f;

inline vf LoadAs(const float* p) { return Load(p); }
inline vf LoadAs(const hsdjax_simd::half* p) { return hsdjax_simd::HalfToFloat(p); }  // exact

// a * b + c rounded once, asked for by name: -ffp-contract=fast alone leaves the choice to the compiler,
// and GCC's Zen tuning (avoid-fma-chains) keeps some accumulation chains as a multiply and an add,
// which made the bits depend on the build's -march. Without FMA (kFused false) it rounds twice.
inline vf Fma(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__) && defined(__FMA__)
  return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__aarch64__)
  return (vf)vfmaq_f32((float32x4_t)c, (float32x4_t)a, (float32x4_t)b);
#elif defined(__FMA__)
  return (vf)_mm_fmadd_ps((__m128)a, (__m128)b, (__m128)c);
#else
  return a * b + c;
#endif
}

inline float Fma(float a, float b, float c) {
  if constexpr (hsdjax_simd::kFused) return __builtin_fmaf(a, b, c);
  else return a * b + c;
}

// exp(x) per lane: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r, 2^n from the exponent
// bits (relative error ~2e-7; inputs below -87 give 0).
inline vf Exp(vf x) {
  const auto underflow = x < -87.0f;
  x = underflow ? vf{} - 87.0f : x;
  x = x > 88.0f ? vf{} + 88.0f : x;
  vf t = x * 1.44269504088896341f;
  vf n = __builtin_convertvector(__builtin_convertvector(t + (t < 0.0f ? vf{} - 0.5f : vf{} + 0.5f), vi), vf);
  vf r = Fma(-n, Splat(0.693359375f), x);
  r = Fma(-n, Splat(-2.12194440e-4f), r);
  vf p = vf{} + 1.9875691500e-4f;
  p = Fma(p, r, Splat(1.3981999507e-3f));
  p = Fma(p, r, Splat(8.3334519073e-3f));
  p = Fma(p, r, Splat(4.1665795894e-2f));
  p = Fma(p, r, Splat(1.6666665459e-1f));
  p = Fma(p, r, Splat(5.0000001201e-1f));
  p = Fma(p * r, r, r) + 1.0f;
  vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  __builtin_memcpy(&scale, &bits, sizeof(vf));
  return underflow ? vf{} : p * scale;
}

// A logical 16-lane group (kG native vectors) -> one native vector: the levels of the tree of halves
// wider than a native vector (lane l + lane l + 8, and l + l + 4 with 4 lanes), as vertical adds.
inline vf Fold(const vf* s) {
  if constexpr (kG == 1) return s[0];
  else if constexpr (kG == 2) return s[0] + s[1];
  else return (s[0] + s[2]) + (s[1] + s[3]);
}

// The rest of the tree on one native vector: lane l + lane l + kLanes / 2, ..., lane 0 + lane 1.
inline float HSumNative(vf x) {
  float a[kLanes];
  __builtin_memcpy(a, &x, sizeof(vf));
  for (int h = kLanes / 2; h >= 1; h /= 2)
    for (int l = 0; l < h; ++l) a[l] = a[l] + a[l + h];
  return a[0];
}

// Sum of a logical 16-lane group as a tree of halves (a chain of 16 scalar adds was the bottleneck).
inline float HSum16(const vf* s) { return HSumNative(Fold(s)); }

// One level of the transposed tree: a and b each hold kLanes / (2H) segments of 2H lanes (one key per
// segment); the result holds their 2 * kLanes / (2H) segments of H lanes, lane l + lane l + H of each.
constexpr int Src(int i, int h, bool hi) {
  return (i >= kLanes / 2 ? kLanes : 0) + (i % (kLanes / 2)) / h * 2 * h + i % (kLanes / 2) % h + (hi ? h : 0);
}

template <int H, size_t... I>
inline vf Level(vf a, vf b, std::index_sequence<I...>) {
  return __builtin_shufflevector(a, b, Src(I, H, false)...) + __builtin_shufflevector(a, b, Src(I, H, true)...);
}

// kLanes folded accumulators (one per key) -> s[0] with lane j = the in-vector tree sum of s[j] (the
// same tree as HSumNative, several keys side by side: fewer shuffles than one sum per key).
template <int H = kLanes / 2>
inline void ReduceKeys(vf* s) {
  if constexpr (H >= 1) {
    for (int i = 0; i < H; ++i) s[i] = Level<H>(s[2 * i], s[2 * i + 1], std::make_index_sequence<kLanes>());
    ReduceKeys<H / 2>(s);
  }
}

template <typename T>
inline float Dot(const float* a, const T* b, int64_t d) {
  vf s[kG] = {};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    for (int g = 0; g < kG; ++g) s[g] = Fma(Load(a + i + g * kLanes), LoadAs(b + i + g * kLanes), s[g]);
  float out = HSum16(s);
  for (; i < d; ++i) out = Fma(a[i], static_cast<float>(b[i]), out);
  return out;
}

// Keys (or values) by index: rows of a contiguous array, or a list of pointers (a token's path).
template <typename T>
struct Rows {
  const T* base;
  int64_t stride;
  const T* operator()(int64_t j) const { return base + j * stride; }
};
struct RowList {
  const float* const* p;
  const float* operator()(int64_t j) const { return p[j]; }
};

// Score tiles: kRB query rows x kJB keys, each pair a logical 16-lane accumulator (kG vectors), the
// keys (or rows, whichever are fewer) held in registers while the others stream.
constexpr int kRB = 3;
constexpr int TileKeys() {
  int jb = kLanes;
  while (jb > 1 && kRB * jb * kG + std::min(kRB, jb) + 1 > kRegisters) jb /= 2;
  return jb;
}
constexpr int kJB = TileKeys();  // AVX-512 8 (24 accumulators), AVX2 2 (12), NEON 2 (24), generic 1 (12)

template <int D, int RB, int JB, typename T>
inline void ScoreTile(const float* const* q, const T* const* k, vf (*part)[kLanes], int jj) {
  vf acc[RB][JB][kG] = {};
  for (int e = 0; e < D; e += 16) {
    for (int g = 0; g < kG; ++g) {
      const int o = e + g * kLanes;
      if constexpr (JB <= RB) {
        vf kv[JB];
        for (int j = 0; j < JB; ++j) kv[j] = LoadAs(k[j] + o);
        for (int r = 0; r < RB; ++r) {
          const vf qv = Load(q[r] + o);
          for (int j = 0; j < JB; ++j) acc[r][j][g] = Fma(qv, kv[j], acc[r][j][g]);
        }
      } else {
        vf qv[RB];
        for (int r = 0; r < RB; ++r) qv[r] = Load(q[r] + o);
        for (int j = 0; j < JB; ++j) {
          const vf kv = LoadAs(k[j] + o);
          for (int r = 0; r < RB; ++r) acc[r][j][g] = Fma(qv[r], kv, acc[r][j][g]);
        }
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < JB; ++j) part[r][jj + j] = Fold(acc[r][j]);
}

// Scores of RB query rows against n keys, kLanes keys per output vector (written whole: out rows need
// room up to n rounded up to kLanes). Every score is the same chain whatever the other rows and keys
// are: a T-node pass and a one-token step give bitwise-equal scores.
template <int D, int RB, typename T, typename Keys>
void ScoresBlock(const float* const* q, float* const* out, Keys keys, int64_t n) {
  vf part[RB][kLanes];
  const T* kp[kJB];
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
    const int m = static_cast<int>(std::min<int64_t>(kLanes, n - j0));
    int jj = 0;
    for (; jj + kJB <= m; jj += kJB) {
      for (int j = 0; j < kJB; ++j) kp[j] = keys(j0 + jj + j);
      ScoreTile<D, RB, kJB, T>(q, kp, part, jj);
    }
    for (; jj < m; ++jj) {
      kp[0] = keys(j0 + jj);
      ScoreTile<D, RB, 1, T>(q, kp, part, jj);
    }
    for (; jj < kLanes; ++jj)
      for (int r = 0; r < RB; ++r) part[r][jj] = vf{};
    for (int r = 0; r < RB; ++r) {
      ReduceKeys(part[r]);
      Store(out[r] + j0, part[r][0]);
    }
  }
}

template <int D, typename T, typename Keys>
void Scores(const float* const* q, float* const* out, int64_t rows, Keys keys, int64_t n) {
  int64_t r = 0;
  for (; r + kRB <= rows; r += kRB) ScoresBlock<D, kRB, T>(q + r, out + r, keys, n);
  if (rows - r == 2) ScoresBlock<D, 2, T>(q + r, out + r, keys, n);
  else if (rows - r == 1) ScoresBlock<D, 1, T>(q + r, out + r, keys, n);
}

// Value tiles: kRG rows x kDC vectors of the value dimension in registers (plus the kDC values of the
// key and one broadcast weight). AVX-512 keeps 4 x 4 (d = 64) and 2 x 8 (d = 128); AVX2 2 x 4.
template <int D>
constexpr int ValueCols() { return std::min(D / kLanes, kRegisters / 4); }
template <int D>
constexpr int ValueRows() { return std::max(1, std::min(4, (kRegisters - 1 - ValueCols<D>()) / ValueCols<D>())); }

// acc[r][c0 ..] (+)= sum_j w[r][j] * vals(j)[c0 ..] for RG rows: per element the chain over j of
// fused multiply-adds from 0 (or onto what acc holds: continuing the chain of an earlier call).
template <int DC, int RG, typename T, typename Vals>
inline void ValuesTile(const float* const* w, Vals vals, int64_t n, int64_t c0, float* const* acc, bool onto) {
  vf a[RG][DC];
  for (int r = 0; r < RG; ++r)
    for (int c = 0; c < DC; ++c) a[r][c] = onto ? Load(acc[r] + c0 + c * kLanes) : vf{};
  for (int64_t j = 0; j < n; ++j) {
    const T* vj = vals(j) + c0;
    vf vv[DC];
    for (int c = 0; c < DC; ++c) vv[c] = LoadAs(vj + c * kLanes);
    for (int r = 0; r < RG; ++r) {
      const vf wr = Splat(w[r][j]);
      for (int c = 0; c < DC; ++c) a[r][c] = Fma(wr, vv[c], a[r][c]);
    }
  }
  for (int r = 0; r < RG; ++r)
    for (int c = 0; c < DC; ++c) Store(acc[r] + c0 + c * kLanes, a[r][c]);
}

template <int D, typename T, typename Vals>
void Values(const float* const* w, float* const* acc, int64_t rows, Vals vals, int64_t n, bool onto) {
  constexpr int DC = ValueCols<D>(), RG = ValueRows<D>();
  int64_t r = 0;
  for (; r + RG <= rows; r += RG)
    for (int c0 = 0; c0 < D; c0 += DC * kLanes) ValuesTile<DC, RG, T>(w + r, vals, n, c0, acc + r, onto);
  for (; r < rows; ++r)
    for (int c0 = 0; c0 < D; c0 += DC * kLanes) ValuesTile<DC, 1, T>(w + r, vals, n, c0, acc + r, onto);
}

// The max of p[0 .. n) as the chain `mx = std::max(mx, p[j])` from kNegInf computes it: lane-wise then
// across lanes (the same value: a nonzero maximum has one bit pattern), the chain itself when the
// maximum is zero (whose sign would depend on the order).
inline float RowMax(const float* p, int64_t n) {
  vf mv = vf{} + kNegInf;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const vf x = Load(p + j);
    mv = mv < x ? x : mv;
  }
  float lanes[kLanes];
  __builtin_memcpy(lanes, &mv, sizeof(vf));
  float mx = kNegInf;
  for (int l = 0; l < kLanes; ++l) mx = std::max(mx, lanes[l]);
  for (; j < n; ++j) mx = std::max(mx, p[j]);
  if (mx == 0.0f) {
    mx = kNegInf;
    for (j = 0; j < n; ++j) mx = std::max(mx, p[j]);
  }
  return mx;
}

// Softmax numerators of each row in place (scores -> exp(score - max)), their max and sum (a logical
// 16-lane sum over the row, summed by the tree of halves).
void ExpRows(float* scores, int64_t n_pad, int64_t n, int64_t rows, float* m_out, float* l_out) {
  for (int64_t r = 0; r < rows; ++r) {
    float* p = scores + r * n_pad;
    const float mx = RowMax(p, n);
    for (int64_t j = n; j < n_pad; ++j) p[j] = kNegInf;
    vf sum[kG] = {};
    for (int64_t j = 0; j < n; j += 16) {
      for (int g = 0; g < kG; ++g) {
        vf x = Exp(Load(p + j + g * kLanes) - mx);
        Store(p + j + g * kLanes, x);
        sum[g] += x;
      }
    }
    m_out[r] = mx;
    l_out[r] = HSum16(sum);
  }
}

struct Item {
  int64_t head;   // b * K + k
  int64_t start;  // first slot of the chunk
  int64_t len;    // slots in the chunk
};

template <typename T>
struct Problem {
  const float* q;
  const T* k;
  const T* v;
  int64_t r, s, d;
  std::vector<Item> items;
  float* part;  // per item: R maxes, R sums, R x D accumulators
  int64_t part_size;
};

// One chunk of one kv head: scores, their max, exp, sums and the weighted sum of values.
template <int D, typename T>
void RunItemBlocked(const Problem<T>& pb, const float* q, const T* k, const T* v, int64_t n, int64_t n_pad,
                    float* scores, float* m_out, float* l_out, float* acc) {
  const int64_t r_n = pb.r;
  std::vector<const float*> rows(r_n);
  std::vector<float*> outs(r_n), accs(r_n);
  for (int64_t r = 0; r < r_n; ++r) {
    rows[r] = q + r * D;
    outs[r] = scores + r * n_pad;
    accs[r] = acc + r * D;
  }
  Scores<D, T>(rows.data(), outs.data(), r_n, Rows<T>{k, D}, n);
  ExpRows(scores, n_pad, n, r_n, m_out, l_out);
  Values<D, T>(outs.data(), accs.data(), r_n, Rows<T>{v, D}, n, false);
}

template <typename T>
void RunItem(const Problem<T>& pb, int64_t i) {
  const Item& it = pb.items[i];
  const int64_t r_n = pb.r, d = pb.d, n = it.len;
  const float* q = pb.q + it.head * r_n * d;
  const T* k = pb.k + (it.head * pb.s + it.start) * d;
  const T* v = pb.v + (it.head * pb.s + it.start) * d;
  float* m_out = pb.part + i * pb.part_size;
  float* l_out = m_out + r_n;
  float* acc = l_out + r_n;
  const int64_t n_pad = (n + 15) / 16 * 16;
  std::unique_ptr<float[]> scores(new float[r_n * n_pad]);  // [R, n_pad]
  if (d == 64) return RunItemBlocked<64>(pb, q, k, v, n, n_pad, scores.get(), m_out, l_out, acc);  // SmolLM2
  if (d == 128) return RunItemBlocked<128>(pb, q, k, v, n, n_pad, scores.get(), m_out, l_out, acc);  // Qwen2.5
  for (int64_t j = 0; j < n; ++j) {  // any head size: keys outer, each key read once for every row
    const T* kj = k + j * d;
    for (int64_t r = 0; r < r_n; ++r) scores[r * n_pad + j] = Dot(q + r * d, kj, d);
  }
  ExpRows(scores.get(), n_pad, n, r_n, m_out, l_out);
  std::fill(acc, acc + r_n * d, 0.0f);
  for (int64_t j = 0; j < n; ++j) {
    const T* vj = v + j * d;
    for (int64_t r = 0; r < r_n; ++r) {
      const float w = scores[r * n_pad + j];
      float* a = acc + r * d;
      for (int64_t e = 0; e < d; ++e) a[e] = Fma(w, static_cast<float>(vj[e]), a[e]);
    }
  }
}

// A problem's items shared between the calling thread and XLA's intra-op pool: each thread takes the
// next item until none is left; the caller returns when all are done.
template <typename P, void (*RunOne)(const P&, int64_t)>
struct PoolCall {
  P pb;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    const int64_t n = static_cast<int64_t>(pb.items.size());
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      RunOne(pb, i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Pool: XLA's ffi::ThreadPool, or anything with num_threads() and Schedule(task) (the self-test's serial one).
template <typename Pool, typename C>
void RunOnPool(Pool& pool, const std::shared_ptr<C>& call) {
  const int64_t n_items = static_cast<int64_t>(call->pb.items.size());
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n_items - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([call] { call->Run(); });
  call->Run();
  while (call->done.load(std::memory_order_acquire) < n_items) hsdjax_simd::CpuRelax();
}

template <typename T, typename Pool>
void CacheAttentionCore(Pool& pool, const float* q, const T* cache_k, const T* cache_v, const int32_t* lens,
                        int64_t b_n, int64_t kh, int64_t r_n, int64_t d, int64_t s, float* m_out, float* l_out,
                        float* acc_out) {
  auto call = std::make_shared<PoolCall<Problem<T>, RunItem<T>>>();
  Problem<T>& pb = call->pb;
  pb.q = q;
  pb.k = cache_k;
  pb.v = cache_v;
  pb.r = r_n;
  pb.s = s;
  pb.d = d;
  std::vector<int64_t> first(b_n * kh + 1, 0);  // items of head h: [first[h], first[h + 1])
  for (int64_t b = 0; b < b_n; ++b) {
    const int64_t len = std::clamp<int64_t>(lens[b], 0, s);
    for (int64_t k = 0; k < kh; ++k) {
      for (int64_t start = 0; start < len; start += kChunk) {
        pb.items.push_back(Item{b * kh + k, start, std::min(kChunk, len - start)});
      }
      first[b * kh + k + 1] = static_cast<int64_t>(pb.items.size());
    }
  }
  pb.part_size = r_n * (2 + d);
  std::vector<float> part(pb.items.size() * pb.part_size);
  pb.part = part.data();
  RunOnPool(pool, call);

  // merge each head's chunks in order
  for (int64_t h = 0; h < b_n * kh; ++h) {
    for (int64_t r = 0; r < r_n; ++r) {
      float mx = kNegInf;
      for (int64_t i = first[h]; i < first[h + 1]; ++i) mx = std::max(mx, part[i * pb.part_size + r]);
      float sum = 0.0f;
      float* a = acc_out + (h * r_n + r) * d;
      std::fill(a, a + d, 0.0f);
      for (int64_t i = first[h]; i < first[h + 1]; ++i) {
        const float* pi = part.data() + i * pb.part_size;
        const float alpha = std::exp(pi[r] - mx);
        sum = Fma(alpha, pi[r_n + r], sum);
        const float* ai = pi + 2 * r_n + r * d;
        for (int64_t e = 0; e < d; ++e) a[e] = Fma(alpha, ai[e], a[e]);
      }
      m_out[h * r_n + r] = mx;
      l_out[h * r_n + r] = sum;
    }
  }
}

template <typename T, ffi::DataType DT>
ffi::Error CacheAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<DT> cache_k,
                          ffi::Buffer<DT> cache_v, ffi::Buffer<ffi::S32> lens, ffi::ResultBuffer<ffi::F32> m,
                          ffi::ResultBuffer<ffi::F32> l, ffi::ResultBuffer<ffi::F32> acc) {
  auto qd = q.dimensions();
  auto kd = cache_k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || qd[0] != kd[0] || qd[1] != kd[1] || qd[3] != kd[3] ||
      static_cast<int64_t>(lens.element_count()) != qd[0]) {
    return ffi::Error::InvalidArgument("hsdjax cache attention: expects q [B, K, R, D], cache [B, K, S, D], lens [B]");
  }
  CacheAttentionCore<T>(pool, q.typed_data(), reinterpret_cast<const T*>(cache_k.typed_data()),
                        reinterpret_cast<const T*>(cache_v.typed_data()), lens.typed_data(), qd[0], qd[1], qd[2],
                        qd[3], kd[2], m->typed_data(), l->typed_data(), acc->typed_data());
  return ffi::Error::Success();
}


// ------------------------------------------------------------------------------------------------
// Position-ordered attention over the cache and a pass's new tokens, in one kernel.
//
//   q [B, K, R, D] float32, pre-scaled, R = G x T (row g * T + t: query head g of new token t)
//   cache_k, cache_v [B, K, S, D] float32 or float16 (two handlers; float16 is widened as it is read);
//   lens [B] int32 (the cached prefix L of each row)
//   new_k, new_v [B, K, T, D] float32; anc [B, T, T] int32 (anc[t][e]: the new token at depth e on
//   token t's path, its own index at e = depth[t]); depth [B, T] int32
//   -> l [B, K, R], acc [B, K, R, D]: softmax sum and weighted values (output = acc / l)
//
// New token t sits at position L + depth[t] and attends to positions 0 .. L + depth[t]: the cache below
// L, then its path. Keys are walked by *position* in fixed 256-position chunks whatever their source,
// so a token's attention is the same chain of operations in a one-token step (where its path is in the
// cache) and in a T-token tree pass (where it is not): bitwise-equal results, the property that makes
// speculative output independent of float rounding. With a float16 cache the model rounds the new
// tokens' keys and values to float16 before the pass (what the cache will hold), and widening is exact,
// so the property holds there too.
template <typename T>
struct TreeProblem {
  const float* q;   // [B, T, H, D], pre-scaled (H = K kv heads x G)
  const T* k;       // cache [B, K, S, D]
  const T* v;
  const float* nk;  // the pass's keys and values [B, T, K, D]
  const float* nv;
  const int32_t* anc;
  const int32_t* depth;
  const int32_t* lens;
  int64_t kh, g, t, s, d;
  struct Chunk {
    int64_t head, start;  // head = b * K + k, start = first position of the chunk
    int64_t slot;         // its partial softmax state in `part`
    int64_t t0, t1;       // the new tokens [t0, t1) whose rows this item computes
  };
  std::vector<Chunk> items;
  float* part;               // per chunk: R maxes, R sums, R x D accumulators (row r = g * T + t)
  int64_t part_size;

  const float* QueryRow(int64_t b, int64_t k, int64_t r) const {  // row r = g * T + t of kv head k
    const int64_t gi = r / t, ti = r % t;
    return q + ((b * t + ti) * (kh * g) + k * g + gi) * d;
  }
  const float* NewRow(const float* base, int64_t b, int64_t k, int64_t u) const {
    return base + ((b * t + u) * kh + k) * d;
  }
};

void TreeRowGeneric(const float* q, const float* const* keys, const float* const* vals, int64_t n, int64_t n_pad,
                    int64_t d, float* scores, float* m_out, float* l_out, float* acc) {
  for (int64_t j = 0; j < n; ++j) scores[j] = Dot(q, keys[j], d);
  ExpRows(scores, n_pad, n, 1, m_out, l_out);
  std::fill(acc, acc + d, 0.0f);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t e = 0; e < d; ++e) acc[e] = Fma(scores[j], vals[j][e], acc[e]);
}

// Keys (or values) of cache positions start .. start + n as float32 rows: the cache itself when it is
// float32, else widened into `scratch` (exact).
inline const float* CacheRows(const float* c, int64_t start, int64_t, int64_t d, float*) { return c + start * d; }
inline const float* CacheRows(const hsdjax_simd::half* c, int64_t start, int64_t n, int64_t d, float* scratch) {
  const hsdjax_simd::half* src = c + start * d;
  int64_t i = 0;
  for (; i + kLanes <= n * d; i += kLanes) Store(scratch + i, LoadAs(src + i));
  for (; i < n * d; ++i) scratch[i] = static_cast<float>(src[i]);
  return scratch;
}

// One chunk of one kv head, head sizes 64 / 128 (register-blocked). Every row (query head x new token)
// sees the chunk's cached positions: their scores, and later their weighted values, are computed for
// all rows together (each key and value read once per tile of rows); each token then adds its own
// path's positions (keys and values from the pass) to its rows. Per row the operations are those of a
// one-token step whatever the other rows are (scores are independent dot products; the softmax and the
// chain over positions run in position order), so a tree pass equals one-token steps bit for bit.
template <int D, typename T>
void RunTreeChunk(const TreeProblem<T>& pb, int64_t i) {
  constexpr int64_t kStride = kChunk + 16;  // a row's scores: the chunk, and room for a 16-wide store
  const auto& it = pb.items[i];
  const int64_t b = it.head / pb.kh, kv = it.head % pb.kh, t_n = pb.t, r_n = pb.g * t_n, d = D;
  const int64_t len = pb.lens[b], t0 = it.t0, t1 = it.t1, rows = t1 - t0;
  const T* ck = pb.k + it.head * pb.s * d;
  const T* cv = pb.v + it.head * pb.s * d;
  float* m_out = pb.part + it.slot * pb.part_size;
  float* l_out = m_out + r_n;
  float* acc_out = l_out + r_n;
  const int64_t cached = std::clamp<int64_t>(len - it.start, 0, kChunk);  // chunk positions in the cache
  // scores of this item's rows, query head g's tokens [t0, t1) at w + (g * rows + t - t0) * kStride
  std::unique_ptr<float[]> w(new float[pb.g * rows * kStride + 16]);
  auto row_of = [&](int64_t g, int64_t t) { return w.get() + (g * rows + t - t0) * kStride; };
  std::vector<const float*> qs(pb.g * rows);  // the item's rows, (g, t) at g * rows + t - t0
  std::vector<float*> ws(pb.g * rows), accs(pb.g * rows);
  for (int64_t g = 0; g < pb.g; ++g) {
    for (int64_t t = t0; t < t1; ++t) {
      qs[g * rows + t - t0] = pb.QueryRow(b, kv, g * t_n + t);
      ws[g * rows + t - t0] = row_of(g, t);
      accs[g * rows + t - t0] = acc_out + (g * t_n + t) * d;
    }
  }
  if (cached > 0) Scores<D, T>(qs.data(), ws.data(), pb.g * rows, Rows<T>{ck + it.start * d, d}, cached);
  const float* keys[kChunk];
  const float* vals[kChunk];
  std::vector<const float*> tq(pb.g);  // one token's rows
  std::vector<float*> tw(pb.g), tacc(pb.g);
  std::vector<int64_t> seen(t_n);  // positions of the chunk each token sees
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t dep = pb.depth[b * t_n + t];
    const int32_t* path = pb.anc + (b * t_n + t) * t_n;
    const int64_t n = std::max<int64_t>(std::min<int64_t>(it.start + kChunk, len + dep + 1) - it.start, 0);
    const int64_t own = n - cached;  // the token's path positions in this chunk
    for (int64_t j = 0; j < own; ++j) {
      const int64_t u = path[it.start + cached + j - len];
      keys[j] = pb.NewRow(pb.nk, b, kv, u);
    }
    seen[t] = n;
    if (own > 0) {  // after the cached scores (the stores end before cached + own + 16 <= kStride)
      for (int64_t g = 0; g < pb.g; ++g) {
        tq[g] = qs[g * rows + t - t0];
        tw[g] = ws[g * rows + t - t0] + cached;
      }
      Scores<D, float>(tq.data(), tw.data(), pb.g, RowList{keys}, own);
    }
    for (int64_t g = 0; g < pb.g; ++g) {
      const int64_t r = g * t_n + t;
      if (n > 0) {
        ExpRows(row_of(g, t), (n + 15) / 16 * 16, n, 1, m_out + r, l_out + r);
      } else {
        m_out[r] = kNegInf;
        l_out[r] = 0.0f;
      }
    }
  }
  // zeros when none is cached
  Values<D, T>(ws.data(), accs.data(), pb.g * rows, Rows<T>{cv + it.start * d, d}, cached, false);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t own = seen[t] - cached;
    if (own <= 0) continue;
    const int32_t* path = pb.anc + (b * t_n + t) * t_n;
    for (int64_t j = 0; j < own; ++j) vals[j] = pb.NewRow(pb.nv, b, kv, path[it.start + cached + j - len]);
    for (int64_t g = 0; g < pb.g; ++g) {
      tw[g] = ws[g * rows + t - t0] + cached;
      tacc[g] = accs[g * rows + t - t0];
    }
    Values<D, float>(tw.data(), tacc.data(), pb.g, RowList{vals}, own, true);  // continues the chains
  }
}

// Any head size: each token walks its keys by position, the cache's and then its path's.
template <typename T>
void RunTreeChunkGeneric(const TreeProblem<T>& pb, int64_t i) {
  const auto& it = pb.items[i];
  const int64_t b = it.head / pb.kh, kv = it.head % pb.kh, t_n = pb.t, d = pb.d;
  const int64_t len = pb.lens[b];
  const T* ck = pb.k + it.head * pb.s * d;
  const T* cv = pb.v + it.head * pb.s * d;
  float* m_out = pb.part + it.slot * pb.part_size;
  float* l_out = m_out + pb.g * t_n;
  float* acc_out = l_out + pb.g * t_n;
  const int64_t cached = std::clamp<int64_t>(len - it.start, 0, kChunk);
  std::unique_ptr<float[]> scratch(sizeof(T) == sizeof(float) ? nullptr : new float[2 * cached * d]);
  const float* ck_rows = CacheRows(ck, it.start, cached, d, scratch.get());
  const float* cv_rows = CacheRows(cv, it.start, cached, d, scratch.get() + cached * d);
  const float* keys[kChunk];
  const float* vals[kChunk];
  float scores[kChunk];
  for (int64_t t = it.t0; t < it.t1; ++t) {
    const int64_t dep = pb.depth[b * t_n + t];
    const int32_t* path = pb.anc + (b * t_n + t) * t_n;
    const int64_t n = std::min<int64_t>(it.start + kChunk, len + dep + 1) - it.start;  // positions it sees
    for (int64_t j = 0; j < n; ++j) {
      const int64_t pos = it.start + j;
      keys[j] = pos < len ? ck_rows + j * d : pb.NewRow(pb.nk, b, kv, path[pos - len]);
      vals[j] = pos < len ? cv_rows + j * d : pb.NewRow(pb.nv, b, kv, path[pos - len]);
    }
    for (int64_t g = 0; g < pb.g; ++g) {
      const int64_t r = g * t_n + t;
      if (n <= 0) {
        m_out[r] = kNegInf;
        l_out[r] = 0.0f;
        std::fill(acc_out + r * d, acc_out + (r + 1) * d, 0.0f);
        continue;
      }
      TreeRowGeneric(pb.QueryRow(b, kv, r), keys, vals, n, (n + 15) / 16 * 16, d, scores, m_out + r, l_out + r,
                     acc_out + r * d);
    }
  }
}

template <typename T>
void RunTreeItem(const TreeProblem<T>& pb, int64_t i) {
  if (pb.d == 64) RunTreeChunk<64>(pb, i);
  else if (pb.d == 128) RunTreeChunk<128>(pb, i);
  else RunTreeChunkGeneric(pb, i);
}


template <typename T, typename Pool>
void TreeAttentionCore(Pool& pool, const float* q, const T* cache_k, const T* cache_v, const int32_t* lens,
                       const float* new_k, const float* new_v, const int32_t* anc, const int32_t* depth, int64_t b_n,
                       int64_t t_n, int64_t h_n, int64_t d, int64_t kh, int64_t s, float* out) {
  auto call = std::make_shared<PoolCall<TreeProblem<T>, RunTreeItem<T>>>();
  TreeProblem<T>& pb = call->pb;
  pb.q = q;
  pb.k = cache_k;
  pb.v = cache_v;
  pb.nk = new_k;
  pb.nv = new_v;
  pb.anc = anc;
  pb.depth = depth;
  std::vector<int32_t> clamped(b_n);
  for (int64_t b = 0; b < b_n; ++b) clamped[b] = std::clamp<int32_t>(lens[b], 0, s);
  pb.lens = clamped.data();
  pb.kh = kh;
  pb.g = h_n / kh;
  pb.t = t_n;
  pb.s = s;
  pb.d = d;
  const int64_t r_n = pb.g * t_n;
  std::vector<int64_t> first(b_n * kh + 1, 0);  // the chunks (slots) of head h: [first[h], first[h + 1])
  std::vector<std::pair<int64_t, int64_t>> chunks;  // (head, start) per slot
  for (int64_t b = 0; b < b_n; ++b) {
    int64_t deepest = 0;
    for (int64_t t = 0; t < t_n; ++t) deepest = std::max<int64_t>(deepest, pb.depth[b * t_n + t]);
    const int64_t end = clamped[b] + deepest + 1;
    for (int64_t k = 0; k < kh; ++k) {
      for (int64_t start = 0; start < end; start += kChunk) chunks.emplace_back(b * kh + k, start);
      first[b * kh + k + 1] = static_cast<int64_t>(chunks.size());
    }
  }
  // Few chunks (a short context) would leave threads idle or unevenly loaded (3 kv heads on 2 cores):
  // then each chunk's tokens are split into ranges, one item each (their rows are disjoint).
  const int64_t workers = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t splits = std::clamp<int64_t>((2 * workers + static_cast<int64_t>(chunks.size()) - 1) /
                                                 std::max<int64_t>(static_cast<int64_t>(chunks.size()), 1), 1, t_n);
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c)
    for (int64_t p = 0; p < splits; ++p)
      pb.items.push_back({chunks[c].first, chunks[c].second, c, t_n * p / splits, t_n * (p + 1) / splits});
  pb.part_size = r_n * (2 + d);
  std::vector<float> part(chunks.size() * pb.part_size);
  pb.part = part.data();
  RunOnPool(pool, call);

  for (int64_t h = 0; h < b_n * kh; ++h) {  // merge each row's chunks in position order
    const int64_t b = h / kh, kv = h % kh;
    for (int64_t r = 0; r < r_n; ++r) {
      float mx = kNegInf;
      for (int64_t i = first[h]; i < first[h + 1]; ++i) mx = std::max(mx, part[i * pb.part_size + r]);
      float sum = 0.0f;
      float a[256];
      std::fill(a, a + d, 0.0f);
      for (int64_t i = first[h]; i < first[h + 1]; ++i) {
        const float* pi = part.data() + i * pb.part_size;
        if (pi[r_n + r] == 0.0f) continue;  // no key of this row in the chunk
        const float alpha = std::exp(pi[r] - mx);
        sum = Fma(alpha, pi[r_n + r], sum);
        const float* ai = pi + 2 * r_n + r * d;
        for (int64_t e = 0; e < d; ++e) a[e] = Fma(alpha, ai[e], a[e]);
      }
      float* o = out + ((b * t_n + r % t_n) * h_n + kv * pb.g + r / t_n) * d;
      for (int64_t e = 0; e < d; ++e) o[e] = a[e] / sum;
    }
  }
}

// The cache is [P, K, S, D] or a stack of caches over layers [L, P, K, S, D] of which `layer` is read in
// place (the scanned layer loop passes the whole stack and its index). Query row b reads cache row b; the
// cache may hold more rows than the batch (P >= B: a row pool whose rows past B are free).
template <typename T, ffi::DataType DT>
ffi::Error TreeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<DT> cache_k,
                         ffi::Buffer<DT> cache_v, ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::F32> new_k,
                         ffi::Buffer<ffi::F32> new_v, ffi::Buffer<ffi::S32> anc, ffi::Buffer<ffi::S32> depth,
                         ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto full = cache_k.dimensions();
  auto nd = new_k.dimensions();
  const int64_t at = layer.element_count() == 1 ? hsdjax_simd::LayerOffset(full, 4, layer.typed_data()[0]) : -1;
  const size_t r = full.size() == 5 ? 1 : 0;
  const int64_t kd[4] = {full[r], full[r + 1], full[r + 2], full[r + 3]};
  if (qd.size() != 4 || at < 0 || cache_v.dimensions().size() != full.size() || qd[0] > kd[0] || nd[2] != kd[1] ||
      qd[3] != kd[3] || nd[0] != qd[0] || nd[1] != qd[1] || nd[3] != qd[3] || qd[2] % nd[2] != 0 ||
      cache_v.element_count() != cache_k.element_count() ||
      static_cast<int64_t>(lens.element_count()) != qd[0] ||
      static_cast<int64_t>(anc.element_count()) != nd[0] * nd[1] * nd[1] ||
      static_cast<int64_t>(depth.element_count()) != nd[0] * nd[1]) {
    return ffi::Error::InvalidArgument(
        "hsdjax tree attention: expects q [B, T, H, D], cache [(L,) P >= B, K, S, D], lens [B], new [B, T, K, D], "
        "anc [B, T, T], depth [B, T] and a layer in range");
  }
  const int64_t t_n = qd[1], d = qd[3];
  if (t_n > kChunk) return ffi::Error::InvalidArgument("hsdjax tree attention: at most 256 new tokens");
  if (d > 256) return ffi::Error::InvalidArgument("hsdjax tree attention: head size at most 256");
  TreeAttentionCore<T>(pool, q.typed_data(), reinterpret_cast<const T*>(cache_k.typed_data()) + at,
                       reinterpret_cast<const T*>(cache_v.typed_data()) + at, lens.typed_data(), new_k.typed_data(),
                       new_v.typed_data(), anc.typed_data(), depth.typed_data(), qd[0], t_n, qd[2], d, kd[1], kd[2],
                       out->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxCacheAttention, (CacheAttention<float, ffi::F32>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxCacheAttentionF16, (CacheAttention<hsdjax_simd::half, ffi::F16>),
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::F16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

#define HSDJAX_TREE_ATTENTION_BINDING(DT)   \
  ffi::Ffi::Bind()                           \
      .Ctx<ffi::ThreadPool>()                \
      .Arg<ffi::Buffer<ffi::F32>>()          \
      .Arg<ffi::Buffer<DT>>()                \
      .Arg<ffi::Buffer<DT>>()                \
      .Arg<ffi::Buffer<ffi::S32>>()          \
      .Arg<ffi::Buffer<ffi::F32>>()          \
      .Arg<ffi::Buffer<ffi::F32>>()          \
      .Arg<ffi::Buffer<ffi::S32>>()          \
      .Arg<ffi::Buffer<ffi::S32>>()          \
      .Arg<ffi::Buffer<ffi::S32>>()          \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxTreeAttention, (TreeAttention<float, ffi::F32>),
                              HSDJAX_TREE_ATTENTION_BINDING(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxTreeAttentionF16, (TreeAttention<hsdjax_simd::half, ffi::F16>),
                              HSDJAX_TREE_ATTENTION_BINDING(ffi::F16));
