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
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include <immintrin.h>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
typedef int32_t i16x32 __attribute__((vector_size(64)));
constexpr int64_t kChunk = 256;
constexpr float kNegInf = -1e30f;

// exp(x) for 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r, 2^n from the
// exponent bits (relative error ~2e-7; inputs below -87 give 0).
inline v16 Exp(v16 x) {
  const auto underflow = x < -87.0f;
  x = underflow ? v16{} - 87.0f : x;
  x = x > 88.0f ? v16{} + 88.0f : x;
  v16 t = x * 1.44269504088896341f;
  v16 n = __builtin_convertvector(__builtin_convertvector(t + (t < 0.0f ? v16{} - 0.5f : v16{} + 0.5f), i16x32), v16);
  v16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  v16 p = v16{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  i16x32 bits = (__builtin_convertvector(n, i16x32) + 127) << 23;
  v16 scale;
  __builtin_memcpy(&scale, &bits, 64);
  return underflow ? v16{} : p * scale;
}

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// Sum of 16 lanes as a tree of halves (a chain of 16 scalar adds was the kernel's bottleneck).
inline float HSum(v16 s) {
  v8 a = __builtin_shufflevector(s, s, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(s, s, 8, 9, 10, 11, 12, 13, 14, 15);
  v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

typedef _Float16 h16 __attribute__((vector_size(32)));

inline v16 Load(const float* p) {
  v16 x;
  __builtin_memcpy(&x, p, 64);
  return x;
}

// 16 halves widened to float32 (exact). GCC's generic vector conversion widens lane by lane, so the
// instructions are asked for by name where the CPU has them.
inline v16 Load(const _Float16* p) {
#if defined(__AVX512F__)
  return (v16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)));
  v16 x;
  __builtin_memcpy(&x, &lo, 32);
  __builtin_memcpy(reinterpret_cast<char*>(&x) + 32, &hi, 32);
  return x;
#else
  h16 x;
  __builtin_memcpy(&x, p, 32);
  return __builtin_convertvector(x, v16);
#endif
}

inline void Store(float* p, v16 x) { __builtin_memcpy(p, &x, 64); }

template <typename T>
inline float Dot(const float* a, const T* b, int64_t d) {
  v16 s{};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) s += Load(a + i) * Load(b + i);
  float out = HSum(s);
  for (; i < d; ++i) out += a[i] * static_cast<float>(b[i]);
  return out;
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

// 16 dot-product accumulators -> one vector of their 16 sums (lane j = sum of s[j]), by halving: each
// level adds the two halves of a pair of vectors side by side (45 shuffles and adds instead of 16
// horizontal sums).
inline v16 Reduce16(v16* s) {
  v16 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i) {
    t[i] = __builtin_shufflevector(s[2 * i], s[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(s[2 * i], s[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {
    u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(t[2 * i], t[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; ++i) {
    w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(u[2 * i], u[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(w[0], w[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(w[0], w[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// Scores of one query row against n keys, 16 keys per step with the row in registers (DV = d / 16
// vectors). Every score is the same chain whatever the other rows are: a T-node pass and a one-token
// step give bitwise-equal scores.
template <int DV, typename T>
void ScoresRow(const float* q, const T* k, int64_t n, float* out) {
  v16 qv[DV];
  for (int e = 0; e < DV; ++e) qv[e] = Load(q + 16 * e);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    v16 s[16];
    for (int j = 0; j < 16; ++j) {
      v16 acc{};
      if (j < m) {
        const T* kj = k + (j0 + j) * DV * 16;
        for (int e = 0; e < DV; ++e) acc += qv[e] * Load(kj + 16 * e);
      }
      s[j] = acc;
    }
    Store(out + j0, Reduce16(s));
  }
}

// acc[r] = sum_j w[r, j] * v[j] for RG rows at once, accumulators in registers.
template <int DV, int RG, typename T>
void WeightedValues(const float* w, int64_t w_stride, const T* v, int64_t n, float* acc) {
  v16 a[RG][DV] = {};
  for (int64_t j = 0; j < n; ++j) {
    v16 vj[DV];
    for (int e = 0; e < DV; ++e) vj[e] = Load(v + j * DV * 16 + 16 * e);
    for (int r = 0; r < RG; ++r) {
      const float wr = w[r * w_stride + j];
      for (int e = 0; e < DV; ++e) a[r][e] += wr * vj[e];
    }
  }
  for (int r = 0; r < RG; ++r)
    for (int e = 0; e < DV; ++e) Store(acc + r * DV * 16 + 16 * e, a[r][e]);
}

template <int DV, typename T>
void WeightedValuesRows(const float* w, int64_t w_stride, const T* v, int64_t n, int64_t rows, float* acc) {
  constexpr int RG = DV <= 4 ? 4 : 2;  // RG x DV accumulators stay within the 32 vector registers
  int64_t r = 0;
  for (; r + RG <= rows; r += RG) WeightedValues<DV, RG, T>(w + r * w_stride, w_stride, v, n, acc + r * DV * 16);
  for (; r < rows; ++r) WeightedValues<DV, 1, T>(w + r * w_stride, w_stride, v, n, acc + r * DV * 16);
}

// Softmax numerators of each row in place (scores -> exp(score - max)), their max and sum.
void ExpRows(float* scores, int64_t n_pad, int64_t n, int64_t rows, float* m_out, float* l_out) {
  for (int64_t r = 0; r < rows; ++r) {
    float* p = scores + r * n_pad;
    float mx = kNegInf;
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, p[j]);
    for (int64_t j = n; j < n_pad; ++j) p[j] = kNegInf;
    v16 sum{};
    for (int64_t j = 0; j < n; j += 16) {
      v16 x = Exp(Load(p + j) - mx);
      Store(p + j, x);
      sum += x;
    }
    m_out[r] = mx;
    l_out[r] = HSum(sum);
  }
}

// One chunk of one kv head: scores, their max, exp, sums and the weighted sum of values.
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
  if (d == 64 || d == 128) {  // register-blocked paths (SmolLM2, Qwen2.5)
    for (int64_t r = 0; r < r_n; ++r) {
      if (d == 64) ScoresRow<4>(q + r * d, k, n, scores.get() + r * n_pad);
      else ScoresRow<8>(q + r * d, k, n, scores.get() + r * n_pad);
    }
    ExpRows(scores.get(), n_pad, n, r_n, m_out, l_out);
    if (d == 64) WeightedValuesRows<4>(scores.get(), n_pad, v, n, r_n, acc);
    else WeightedValuesRows<8>(scores.get(), n_pad, v, n, r_n, acc);
    return;
  }
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
      for (int64_t e = 0; e < d; ++e) a[e] += w * static_cast<float>(vj[e]);
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

template <typename C>
void RunOnPool(ffi::ThreadPool& pool, const std::shared_ptr<C>& call) {
  const int64_t n_items = static_cast<int64_t>(call->pb.items.size());
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, n_items - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([call] { call->Run(); });
  call->Run();
  while (call->done.load(std::memory_order_acquire) < n_items) __builtin_ia32_pause();
}

template <typename T, ffi::DataType DT>
ffi::Error CacheAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<DT> cache_k,
                          ffi::Buffer<DT> cache_v, ffi::Buffer<ffi::S32> lens, ffi::ResultBuffer<ffi::F32> m,
                          ffi::ResultBuffer<ffi::F32> l, ffi::ResultBuffer<ffi::F32> acc) {
  auto qd = q.dimensions();
  auto kd = cache_k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || qd[0] != kd[0] || qd[1] != kd[1] || qd[3] != kd[3] ||
      lens.element_count() != qd[0]) {
    return ffi::Error::InvalidArgument("hsdjax cache attention: expects q [B, K, R, D], cache [B, K, S, D], lens [B]");
  }
  const int64_t b_n = qd[0], kh = qd[1], r_n = qd[2], d = qd[3], s = kd[2];
  auto call = std::make_shared<PoolCall<Problem<T>, RunItem<T>>>();
  Problem<T>& pb = call->pb;
  pb.q = q.typed_data();
  pb.k = reinterpret_cast<const T*>(cache_k.typed_data());
  pb.v = reinterpret_cast<const T*>(cache_v.typed_data());
  pb.r = r_n;
  pb.s = s;
  pb.d = d;
  std::vector<int64_t> first(b_n * kh + 1, 0);  // items of head h: [first[h], first[h + 1])
  for (int64_t b = 0; b < b_n; ++b) {
    const int64_t len = std::clamp<int64_t>(lens.typed_data()[b], 0, s);
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
      float* a = acc->typed_data() + (h * r_n + r) * d;
      std::fill(a, a + d, 0.0f);
      for (int64_t i = first[h]; i < first[h + 1]; ++i) {
        const float* pi = part.data() + i * pb.part_size;
        const float alpha = std::exp(pi[r] - mx);
        sum += alpha * pi[r_n + r];
        const float* ai = pi + 2 * r_n + r * d;
        for (int64_t e = 0; e < d; ++e) a[e] += alpha * ai[e];
      }
      m->typed_data()[h * r_n + r] = mx;
      l->typed_data()[h * r_n + r] = sum;
    }
  }
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

template <int DV>
void TreeScoresRow(const float* q, const float* const* keys, int64_t n, float* out) {
  v16 qv[DV];
  for (int e = 0; e < DV; ++e) qv[e] = Load(q + 16 * e);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    v16 s[16];
    for (int j = 0; j < 16; ++j) {
      v16 acc{};
      if (j < m) {
        const float* kj = keys[j0 + j];
        for (int e = 0; e < DV; ++e) acc += qv[e] * Load(kj + 16 * e);
      }
      s[j] = acc;
    }
    Store(out + j0, Reduce16(s));
  }
}

// acc += sum_j w[j] * vals[j], continuing the chain over j that WeightedValues began (same operations).
template <int DV>
void TreeValuesRowOnto(const float* w, const float* const* vals, int64_t n, float* acc) {
  v16 a[DV];
  for (int e = 0; e < DV; ++e) a[e] = Load(acc + 16 * e);
  for (int64_t j = 0; j < n; ++j) {
    const float wj = w[j];
    for (int e = 0; e < DV; ++e) a[e] += wj * Load(vals[j] + 16 * e);
  }
  for (int e = 0; e < DV; ++e) Store(acc + 16 * e, a[e]);
}

void TreeRowGeneric(const float* q, const float* const* keys, const float* const* vals, int64_t n, int64_t n_pad,
                    int64_t d, float* scores, float* m_out, float* l_out, float* acc) {
  for (int64_t j = 0; j < n; ++j) scores[j] = Dot(q, keys[j], d);
  ExpRows(scores, n_pad, n, 1, m_out, l_out);
  std::fill(acc, acc + d, 0.0f);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t e = 0; e < d; ++e) acc[e] += scores[j] * vals[j][e];
}

// Keys (or values) of cache positions start .. start + n as float32 rows: the cache itself when it is
// float32, else widened into `scratch` (exact).
inline const float* CacheRows(const float* c, int64_t start, int64_t, int64_t d, float*) { return c + start * d; }
inline const float* CacheRows(const _Float16* c, int64_t start, int64_t n, int64_t d, float* scratch) {
  const _Float16* src = c + start * d;
  int64_t i = 0;
  for (; i + 16 <= n * d; i += 16) Store(scratch + i, Load(src + i));
  for (; i < n * d; ++i) scratch[i] = static_cast<float>(src[i]);
  return scratch;
}

// One chunk of one kv head, head sizes 64 / 128 (register-blocked). Every row (query head x new token)
// sees the chunk's cached positions: their scores, and later their weighted values, are computed for
// all rows together (each key and value read once per call); each token then adds its own path's
// positions (keys and values from the pass) to its rows. Per row the operations are those of a
// one-token step whatever the other rows are (scores are independent dot products; the softmax and the
// chain over positions run in position order), so a tree pass equals one-token steps bit for bit.
template <int DV, typename T>
void RunTreeChunk(const TreeProblem<T>& pb, int64_t i) {
  constexpr int64_t kStride = kChunk + 16;  // a row's scores: the chunk, and room for a 16-wide store
  const auto& it = pb.items[i];
  const int64_t b = it.head / pb.kh, kv = it.head % pb.kh, t_n = pb.t, r_n = pb.g * t_n, d = pb.d;
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
  for (int64_t g = 0; g < pb.g && cached > 0; ++g)
    for (int64_t t = t0; t < t1; ++t) ScoresRow<DV>(pb.QueryRow(b, kv, g * t_n + t), ck + it.start * d, cached, row_of(g, t));
  const float* keys[kChunk];
  const float* vals[kChunk];
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
    for (int64_t g = 0; g < pb.g; ++g) {
      const int64_t r = g * t_n + t;
      float* row = row_of(g, t);
      // after the cached scores (its 16-wide stores end before cached + own + 16 <= kStride)
      if (own > 0) TreeScoresRow<DV>(pb.QueryRow(b, kv, r), keys, own, row + cached);
      if (n > 0) {
        ExpRows(row, (n + 15) / 16 * 16, n, 1, m_out + r, l_out + r);
      } else {
        m_out[r] = kNegInf;
        l_out[r] = 0.0f;
      }
    }
  }
  for (int64_t g = 0; g < pb.g; ++g)  // zeros when none is cached
    WeightedValuesRows<DV>(row_of(g, t0), kStride, cv + it.start * d, cached, rows, acc_out + (g * t_n + t0) * d);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t own = seen[t] - cached;
    if (own <= 0) continue;
    const int32_t* path = pb.anc + (b * t_n + t) * t_n;
    for (int64_t j = 0; j < own; ++j) vals[j] = pb.NewRow(pb.nv, b, kv, path[it.start + cached + j - len]);
    for (int64_t g = 0; g < pb.g; ++g) {
      const int64_t r = g * t_n + t;
      TreeValuesRowOnto<DV>(row_of(g, t) + cached, vals, own, acc_out + r * d);
    }
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
  if (pb.d == 64) RunTreeChunk<4>(pb, i);
  else if (pb.d == 128) RunTreeChunk<8>(pb, i);
  else RunTreeChunkGeneric(pb, i);
}


template <typename T, ffi::DataType DT>
ffi::Error TreeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<DT> cache_k,
                         ffi::Buffer<DT> cache_v, ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::F32> new_k,
                         ffi::Buffer<ffi::F32> new_v, ffi::Buffer<ffi::S32> anc, ffi::Buffer<ffi::S32> depth,
                         ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions();
  auto kd = cache_k.dimensions();
  auto nd = new_k.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || nd.size() != 4 || qd[0] != kd[0] || nd[2] != kd[1] || qd[3] != kd[3] ||
      nd[0] != qd[0] || nd[1] != qd[1] || nd[3] != qd[3] || qd[2] % nd[2] != 0 || lens.element_count() != qd[0] ||
      anc.element_count() != nd[0] * nd[1] * nd[1] || depth.element_count() != nd[0] * nd[1]) {
    return ffi::Error::InvalidArgument(
        "hsdjax tree attention: expects q [B, T, H, D], cache [B, K, S, D], lens [B], new [B, T, K, D], "
        "anc [B, T, T], depth [B, T]");
  }
  const int64_t b_n = qd[0], t_n = qd[1], h_n = qd[2], d = qd[3], kh = kd[1], s = kd[2];
  if (t_n > kChunk) return ffi::Error::InvalidArgument("hsdjax tree attention: at most 256 new tokens");
  if (d > 256) return ffi::Error::InvalidArgument("hsdjax tree attention: head size at most 256");
  auto call = std::make_shared<PoolCall<TreeProblem<T>, RunTreeItem<T>>>();
  TreeProblem<T>& pb = call->pb;
  pb.q = q.typed_data();
  pb.k = reinterpret_cast<const T*>(cache_k.typed_data());
  pb.v = reinterpret_cast<const T*>(cache_v.typed_data());
  pb.nk = new_k.typed_data();
  pb.nv = new_v.typed_data();
  pb.anc = anc.typed_data();
  pb.depth = depth.typed_data();
  std::vector<int32_t> clamped(b_n);
  for (int64_t b = 0; b < b_n; ++b) clamped[b] = std::clamp<int32_t>(lens.typed_data()[b], 0, s);
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
        sum += alpha * pi[r_n + r];
        const float* ai = pi + 2 * r_n + r * d;
        for (int64_t e = 0; e < d; ++e) a[e] += alpha * ai[e];
      }
      float* o = out->typed_data() + ((b * t_n + r % t_n) * h_n + kv * pb.g + r / t_n) * d;
      for (int64_t e = 0; e < d; ++e) o[e] = a[e] / sum;
    }
  }
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxCacheAttentionF16, (CacheAttention<_Float16, ffi::F16>),
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
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxTreeAttention, (TreeAttention<float, ffi::F32>),
                              HSDJAX_TREE_ATTENTION_BINDING(ffi::F32));
XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxTreeAttentionF16, (TreeAttention<_Float16, ffi::F16>),
                              HSDJAX_TREE_ATTENTION_BINDING(ffi::F16));
