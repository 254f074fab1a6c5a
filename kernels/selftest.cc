// A standalone check of hsdjax's CPU kernels without XLA or Python (the kernels' own sources are
// included, so it runs wherever they compile: natively, for another -march, or for aarch64 under a
// user-mode emulator). On inputs made by a fixed integer generator (the same on every machine):
//   - every matmul format (float32, bfloat16, 4-bit and 8-bit compressed panels) at several row counts
//     must equal, bit for bit, a scalar reference chain of fused multiply-adds over k (std::fma), and
//     each row must be the same whatever the row count (a tree pass equals one-token steps); the same
//     for the integer-activation products (int16x, int8x) against their scalar references, and the
//     int8 screen of an 8-bit head must pick the float32 argmax;
//   - the cache and tree attention kernels must match a double-precision reference within 1e-5;
// and every output is hashed (FNV-1a over the bytes) and printed, so builds for different instruction
// sets can be compared: equal hashes mean bitwise-equal results across them.
// Usage: selftest            prints "<name> <hash>" lines, then "selftest: N passed, M failed"
//        selftest bench M K N BITS   times the single-threaded product (microseconds, median of 25)
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cpu_attention.cc"
#include "cpu_matmul.cc"

namespace selftest {

uint64_t state = 0x9E3779B97F4A7C15ull;
void Seed(uint64_t seed) { state = 0x9E3779B97F4A7C15ull ^ (seed * 0xBF58476D1CE4E5B9ull); }  // per group of checks
uint32_t Next() {
  state ^= state << 13;
  state ^= state >> 7;
  state ^= state << 17;
  return static_cast<uint32_t>(state >> 11);
}
float Uniform() { return static_cast<float>(static_cast<int>(Next() % 20001) - 10000) / 8192.0f; }

uint64_t Hash(const void* p, size_t n, uint64_t h = 1469598103934665603ull) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

int passed = 0, failed = 0;
void Check(bool ok, const std::string& what) {
  if (ok) {
    ++passed;
  } else {
    ++failed;
    std::printf("FAILED %s\n", what.c_str());
  }
}

// A random panel set of the given format and its float32 weights w[n][k] (column-major per output).
struct Weights {
  int bits;
  int64_t k, n;
  std::vector<uint8_t> bytes;  // what the kernel reads
  std::vector<float> w;        // w[col * k + kk]
  int64_t panel_bytes;
};

Weights Make(int bits, int64_t k, int64_t n) {
  Weights out{bits, k, n, {}, std::vector<float>(n * k), 0};
  const int64_t panels = n / kPanel;
  if (bits == 32 || bits == 16) {
    out.panel_bytes = k * kPanel * bits / 8;
    out.bytes.resize(panels * out.panel_bytes);
    for (int64_t p = 0; p < panels; ++p)
      for (int64_t kk = 0; kk < k; ++kk)
        for (int64_t j = 0; j < kPanel; ++j) {
          float v = Uniform();
          if (bits == 16) {
            uint32_t b;
            std::memcpy(&b, &v, 4);
            b &= 0xFFFF0000u;
            std::memcpy(&v, &b, 4);
            const uint16_t h = static_cast<uint16_t>(b >> 16);
            std::memcpy(out.bytes.data() + p * out.panel_bytes + (kk * kPanel + j) * 2, &h, 2);
          } else {
            std::memcpy(out.bytes.data() + p * out.panel_bytes + (kk * kPanel + j) * 4, &v, 4);
          }
          out.w[(p * kPanel + j) * k + kk] = v;
        }
    return out;
  }
  const int64_t rows = bits == 4 ? Format<4>::kRows : Format<8>::kRows;
  const int64_t block = bits == 4 ? Format<4>::kBlockBytes : Format<8>::kBlockBytes;
  const int64_t header = bits == 4 ? Format<4>::kHeader : Format<8>::kHeader;
  out.panel_bytes = k / rows * block;
  out.bytes.resize(panels * out.panel_bytes);
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t b = 0; b < k / rows; ++b) {
      uint8_t* blk = out.bytes.data() + p * out.panel_bytes + b * block;
      float scale[kPanel], offset[kPanel];
      for (int64_t j = 0; j < kPanel; ++j) {
        uint32_t s = (0x3C000000u + (Next() % 0x800000u)) & ~15u;  // scales with 4 low zero bits: exact products
        std::memcpy(&scale[j], &s, 4);
        offset[j] = bits == 4 ? Uniform() / 16.0f : 0.0f;
      }
      std::memcpy(blk, scale, 128);
      if (bits == 4) std::memcpy(blk + 128, offset, 128);
      for (int64_t kk = 0; kk < rows; ++kk)
        for (int64_t j = 0; j < kPanel; ++j) {
          int code;
          if (bits == 4) {
            code = static_cast<int>(Next() % 16);
            uint8_t& byte = blk[header + kk * 16 + j % 16];
            byte = j < 16 ? static_cast<uint8_t>((byte & 0xF0) | code) : static_cast<uint8_t>((byte & 0x0F) | (code << 4));
          } else {
            code = static_cast<int>(Next() % 255) - 127;
            blk[header + kk * 32 + j] = static_cast<uint8_t>(static_cast<int8_t>(code));
          }
          out.w[(p * kPanel + j) * k + b * rows + kk] = std::fma(static_cast<float>(code), scale[j], offset[j]);
        }
    }
  return out;
}

std::vector<float> Product(const Weights& wt, const std::vector<float>& x, int64_t m) {
  std::vector<float> y(m * wt.n, -1.0f);
  Work w{x.data(), m, wt.k, wt.bytes.data(), wt.panel_bytes, wt.bits, 0, wt.n / kPanel, y.data(), wt.n};
  Panels(w);
  return y;
}

void MatmulChecks() {
  Seed(1);
  const int64_t shapes[][2] = {{64, 64}, {96, 32}, {576, 96}, {1536, 64}};
  for (int bits : {32, 16, 4, 8}) {
    for (const auto& s : shapes) {
      const int64_t k = s[0], n = s[1];
      if (bits == 8 && k % 16) continue;
      const Weights wt = Make(bits, k, n);
      const int64_t m_max = 19;
      std::vector<float> x(m_max * k);
      for (float& v : x) v = Uniform();
      std::vector<float> ref(m_max * n);  // one chain over k per output, from zero
      for (int64_t r = 0; r < m_max; ++r)
        for (int64_t c = 0; c < n; ++c) {
          float acc = 0.0f;
          for (int64_t kk = 0; kk < k; ++kk) {  // fused where the instruction set fuses (kFused)
            if (hsdjax_simd::kFused) {
              acc = std::fma(x[r * k + kk], wt.w[c * k + kk], acc);
            } else {
              const volatile float product = x[r * k + kk] * wt.w[c * k + kk];
              acc = acc + product;
            }
          }
          ref[r * n + c] = acc;
        }
      const std::string name = "matmul bits=" + std::to_string(bits) + " k=" + std::to_string(k) + " n=" + std::to_string(n);
      for (int64_t m : {1, 2, 3, 4, 5, 6, 8, 9, 19}) {
        const std::vector<float> y = Product(wt, x, m);
        const bool same = std::memcmp(y.data(), ref.data(), m * n * 4) == 0;
        Check(same, name + " m=" + std::to_string(m) + " equals the scalar fma chain bit for bit");
      }
      std::printf("%s %016llx\n", name.c_str(), static_cast<unsigned long long>(Hash(ref.data(), ref.size() * 4)));
    }
  }
}

// int16x (4-bit panels): x quantized to int16 per 32 k; per block y = fma(offset, sum(q) * scale, y), then
// y = fma(d * scale, float(sum(q * code)), y), the integer sums exact.
void Int16xChecks() {
  Seed(2);
  if (!kHaveInt16x) {
    std::printf("int16x: not in this build\n");
    return;
  }
  for (int64_t k : {64, 576}) {
    const int64_t n = 64, m_max = 9;
    const Weights wt = Make(4, k, n);
    std::vector<float> x(m_max * k);
    for (float& v : x) v = Uniform();
    std::vector<uint32_t> xw(m_max * k / 2);
    std::vector<float> sq(m_max * k / 32), xs(m_max * k / 32);
    QuantizeActivations16(x.data(), m_max, k, xw.data(), sq.data(), xs.data());
    const int16_t* q = reinterpret_cast<const int16_t*>(xw.data());
    std::vector<float> ref(m_max * n);
    for (int64_t r = 0; r < m_max; ++r)
      for (int64_t c = 0; c < n; ++c) {
        const int64_t p = c / kPanel, j = c % kPanel;
        float acc = 0.0f;
        for (int64_t b = 0; b < k / 32; ++b) {
          const uint8_t* blk = wt.bytes.data() + p * wt.panel_bytes + b * Format<4>::kBlockBytes;
          float d, o;
          std::memcpy(&d, blk + 4 * j, 4);
          std::memcpy(&o, blk + 128 + 4 * j, 4);
          int32_t isum = 0;
          for (int64_t kk = 0; kk < 32; ++kk) {
            const uint8_t byte = blk[Format<4>::kHeader + kk * 16 + j % 16];
            isum += (j < 16 ? byte & 15 : byte >> 4) * q[r * k + 32 * b + kk];
          }
          const float scale = sq[r * (k / 32) + b];
          acc = std::fma(o, xs[r * (k / 32) + b], acc);
          acc = std::fma(d * scale, static_cast<float>(isum), acc);
        }
        ref[r * n + c] = acc;
      }
    for (int64_t m : {1, 2, 3, 8, 9}) {
      std::vector<float> y(m * n, -1.0f);
      Work w{x.data(), m, k, wt.bytes.data(), wt.panel_bytes, 4, 0, n / kPanel, y.data(), n};
      w.xw = xw.data();
      w.sq = sq.data();
      w.xs = xs.data();
      Panels(w);
      Check(std::memcmp(y.data(), ref.data(), m * n * 4) == 0,
            "int16x k=" + std::to_string(k) + " m=" + std::to_string(m) + " equals its scalar reference bit for bit");
    }
    std::printf("matmul int16x k=%lld %016llx\n", static_cast<long long>(k),
                static_cast<unsigned long long>(Hash(ref.data(), ref.size() * 4)));
  }
}

// int8x (4- and 8-bit panels): x quantized to int8 per 32 k; per block of a 4-bit panel
// y = fma(offset, sum(q) * scale, y), then (both) y = fma(d * scale, float(sum(q * code)), y), the
// integer sums exact (VNNI's four-k dot products or the pair tiles' two-k ones give the same sums).
void Int8xChecks() {
  Seed(3);
  if (!kHaveInt8x) {
    std::printf("int8x: not in this build\n");
    return;
  }
  for (int bits : {4, 8}) {
    for (int64_t k : {64, 576}) {
      const int64_t n = 64, m_max = 9;
      const Weights wt = Make(bits, k, n);
      std::vector<float> x(m_max * k);
      for (float& v : x) v = Uniform();
      std::vector<uint32_t> xq(m_max * k / 4);
      std::vector<float> sq(m_max * k / 32), xs(m_max * k / 32);
      QuantizeActivations(x.data(), m_max, k, xq.data(), sq.data(), xs.data());
      const int8_t* q = reinterpret_cast<const int8_t*>(xq.data());
      const int64_t rows = bits == 4 ? Format<4>::kRows : Format<8>::kRows;
      const int64_t block = bits == 4 ? Format<4>::kBlockBytes : Format<8>::kBlockBytes;
      const int64_t header = bits == 4 ? Format<4>::kHeader : Format<8>::kHeader;
      std::vector<float> ref(m_max * n);
      for (int64_t r = 0; r < m_max; ++r)
        for (int64_t c = 0; c < n; ++c) {
          const int64_t p = c / kPanel, j = c % kPanel;
          float acc = 0.0f;
          for (int64_t b = 0; b < k / rows; ++b) {
            const uint8_t* blk = wt.bytes.data() + p * wt.panel_bytes + b * block;
            float d;
            std::memcpy(&d, blk + 4 * j, 4);
            int32_t isum = 0;
            for (int64_t kk = 0; kk < rows; ++kk) {
              const int code = bits == 4 ? (j < 16 ? blk[header + kk * 16 + j % 16] & 15 : blk[header + kk * 16 + j % 16] >> 4)
                                         : static_cast<int8_t>(blk[header + kk * 32 + j]);
              isum += code * q[r * k + rows * b + kk];
            }
            const int64_t xb = bits == 4 ? b : b / 2;
            const float scale = sq[r * (k / 32) + xb];
            if (bits == 4) {
              float o;
              std::memcpy(&o, blk + 128 + 4 * j, 4);
              acc = std::fma(o, xs[r * (k / 32) + xb], acc);
            }
            acc = std::fma(d * scale, static_cast<float>(isum), acc);
          }
          ref[r * n + c] = acc;
        }
      for (int64_t m : {1, 2, 3, 8, 9}) {
        std::vector<float> y(m * n, -1.0f);
        Work w{x.data(), m, k, wt.bytes.data(), wt.panel_bytes, bits, 0, n / kPanel, y.data(), n};
        w.xq = xq.data();
        w.sq = sq.data();
        w.xs = xs.data();
        Panels(w);
        Check(std::memcmp(y.data(), ref.data(), m * n * 4) == 0, "int8x bits=" + std::to_string(bits) + " k=" +
              std::to_string(k) + " m=" + std::to_string(m) + " equals its scalar reference bit for bit");
      }
      std::printf("matmul int8x bits=%d k=%lld %016llx\n", bits, static_cast<long long>(k),
                  static_cast<unsigned long long>(Hash(ref.data(), ref.size() * 4)));
    }
  }
}

// The screened argmax of an 8-bit head equals the argmax (first largest) of its float32 chains, for
// random rows, rows whose logits nearly tie (x scaled far down) and rows with a NaN.
void ScreenChecks() {
  Seed(4);
  if (!kHaveInt8x) {
    std::printf("screened argmax: not in this build\n");
    return;
  }
  const int64_t k = 576, n = 4096, m = 9, panels = n / kPanel;
  const Weights wt = Make(8, k, n);
  std::vector<float> colabs(panels * (k / 32) * kPanel, 0.0f);
  for (int64_t c = 0; c < n; ++c)
    for (int64_t kk = 0; kk < k; ++kk)
      colabs[((c / kPanel) * (k / 32) + kk / 32) * kPanel + c % kPanel] += std::fabs(wt.w[c * k + kk]);
  std::vector<float> x(m * k);
  for (float& v : x) v = Uniform();
  for (int64_t i = 0; i < k; ++i) x[3 * k + i] *= 1e-6f;  // nearly tied logits
  x[7 * k + 5] = std::nanf("");
  const std::vector<float> y = Product(wt, x, m);
  std::vector<int32_t> want(m), got(m, -1);
  for (int64_t r = 0; r < m; ++r) {
    int64_t best = 0;
    for (int64_t c = 1; c < n; ++c) {
      if (std::isnan(y[r * n + best])) break;
      if (std::isnan(y[r * n + c]) || y[r * n + c] > y[r * n + best]) best = c;
    }
    want[r] = static_cast<int32_t>(best);
  }
  ScreenArgmax(x.data(), m, k, wt.bytes.data(), panels, colabs.data(), got.data(), [](const Work& w) { Panels(w); });
  for (int64_t r = 0; r < m; ++r)
    Check(got[r] == want[r], "screened argmax row " + std::to_string(r) + " is the float32 argmax (" +
          std::to_string(got[r]) + " vs " + std::to_string(want[r]) + ")");
  std::printf("matmul screened argmax %016llx\n", static_cast<unsigned long long>(Hash(got.data(), m * 4)));
}

// ---- attention -------------------------------------------------------------------------------------

struct SerialPool {  // no helper threads: the calling thread runs every item
  int64_t num_threads() const { return 0; }
  template <typename F>
  void Schedule(F&&) {}
};

template <typename T>
T Stored(float v) { return static_cast<T>(v); }

// A random tree pass over a cache: each row of q (pre-scaled) against the cache below lens[b] and its
// path; checks the kernel against a double-precision softmax, and each new token's row against a
// one-token step whose cache holds the token's path (bit for bit).
template <typename T>
void TreeAttentionCase(int64_t d, int64_t len, int64_t t_n, const char* cache_name) {
  const int64_t kh = 2, g = 3, h_n = kh * g, s = len + t_n + 1;
  std::vector<float> q(t_n * h_n * d), nk(t_n * kh * d), nv(t_n * kh * d);
  for (float& v : q) v = Uniform() / 4;
  std::vector<T> ck(kh * s * d), cv(kh * s * d);
  for (auto& v : ck) v = Stored<T>(Uniform());
  for (auto& v : cv) v = Stored<T>(Uniform());
  for (float& v : nk) v = static_cast<float>(Stored<T>(Uniform()));  // as the cache will hold them
  for (float& v : nv) v = static_cast<float>(Stored<T>(Uniform()));
  std::vector<int32_t> parent(t_n), depth(t_n), anc(t_n * t_n, 0);
  for (int64_t t = 0; t < t_n; ++t) {  // node 0 the root; others hang below an earlier node
    parent[t] = t == 0 ? -1 : static_cast<int32_t>(Next() % t);
    depth[t] = t == 0 ? 0 : depth[parent[t]] + 1;
    for (int64_t u = t; u >= 0; u = parent[u]) anc[t * t_n + depth[u]] = static_cast<int32_t>(u);
  }
  const int32_t lens[1] = {static_cast<int32_t>(len)};
  std::vector<float> out(t_n * h_n * d);
  SerialPool pool;
  TreeAttentionCore<T>(pool, q.data(), ck.data(), cv.data(), lens, nk.data(), nv.data(), anc.data(), depth.data(), 1,
                       t_n, h_n, d, kh, s, out.data());
  const std::string name = std::string("attention tree ") + cache_name + " d=" + std::to_string(d) +
                           " len=" + std::to_string(len) + " t=" + std::to_string(t_n);
  double worst = 0.0;
  bool steps_equal = true;
  for (int64_t t = 0; t < t_n; ++t) {
    for (int64_t kv = 0; kv < kh; ++kv) {
      // keys and values this token sees, in position order
      std::vector<const T*> keys;
      std::vector<const float*> new_keys, new_vals;
      for (int64_t e = 0; e <= depth[t]; ++e) {
        new_keys.push_back(nk.data() + (anc[t * t_n + e] * kh + kv) * d);
        new_vals.push_back(nv.data() + (anc[t * t_n + e] * kh + kv) * d);
      }
      for (int64_t gi = 0; gi < g; ++gi) {
        const float* qr = q.data() + (t * h_n + kv * g + gi) * d;
        std::vector<double> sc;
        for (int64_t j = 0; j < len; ++j) {
          double acc = 0;
          for (int64_t e = 0; e < d; ++e) acc += double(qr[e]) * double(static_cast<float>(ck[(kv * s + j) * d + e]));
          sc.push_back(acc);
        }
        for (const float* kj : new_keys) {
          double acc = 0;
          for (int64_t e = 0; e < d; ++e) acc += double(qr[e]) * double(kj[e]);
          sc.push_back(acc);
        }
        double mx = sc[0], sum = 0;
        for (double v : sc) mx = std::max(mx, v);
        for (double& v : sc) sum += (v = std::exp(v - mx));
        for (int64_t e = 0; e < d; ++e) {
          double o = 0;
          for (int64_t j = 0; j < len; ++j) o += sc[j] * double(static_cast<float>(cv[(kv * s + j) * d + e]));
          for (size_t j = 0; j < new_vals.size(); ++j) o += sc[len + j] * double(new_vals[j][e]);
          worst = std::max(worst, std::fabs(o / sum - out[(t * h_n + kv * g + gi) * d + e]));
        }
      }
    }
    // the same token as a one-token step: its ancestors are in the cache, in depth order
    const int64_t len1 = len + depth[t];
    std::vector<T> ck1(kh * (len1 + 1) * d), cv1(kh * (len1 + 1) * d);
    for (int64_t kv = 0; kv < kh; ++kv) {
      for (int64_t j = 0; j < len1; ++j)
        for (int64_t e = 0; e < d; ++e) {
          const bool cached = j < len;
          const int64_t u = cached ? 0 : anc[t * t_n + (j - len)];
          ck1[(kv * (len1 + 1) + j) * d + e] = cached ? ck[(kv * s + j) * d + e] : Stored<T>(nk[(u * kh + kv) * d + e]);
          cv1[(kv * (len1 + 1) + j) * d + e] = cached ? cv[(kv * s + j) * d + e] : Stored<T>(nv[(u * kh + kv) * d + e]);
        }
    }
    const int32_t lens1[1] = {static_cast<int32_t>(len1)}, anc1[1] = {0}, depth1[1] = {0};
    std::vector<float> out1(h_n * d);
    TreeAttentionCore<T>(pool, q.data() + t * h_n * d, ck1.data(), cv1.data(), lens1, nk.data() + t * kh * d,
                         nv.data() + t * kh * d, anc1, depth1, 1, 1, h_n, d, kh, len1 + 1, out1.data());
    steps_equal &= std::memcmp(out1.data(), out.data() + t * h_n * d, h_n * d * 4) == 0;
  }
  Check(worst < 1e-5, name + " matches the double-precision softmax (max error " + std::to_string(worst) + ")");
  Check(steps_equal, name + ": every token's row equals its one-token step bit for bit");
  std::printf("%s %016llx\n", name.c_str(), static_cast<unsigned long long>(Hash(out.data(), out.size() * 4)));
}

void AttentionChecks() {
  Seed(3);
  for (int64_t d : {64, 128, 48}) {
    for (int64_t len : {0, 5, 250, 300}) {
      for (int64_t t_n : {1, 3, 9}) {
        TreeAttentionCase<float>(d, len, t_n, "f32");
        TreeAttentionCase<hsdjax_simd::half>(d, len, t_n, "f16");
      }
    }
  }
  // the cache-only kernel (online-softmax state) against a double-precision one
  const int64_t kh = 2, r_n = 5, d = 64, s = 600;
  for (int64_t len : {1, 256, 513}) {
    std::vector<float> q(kh * r_n * d), ck(kh * s * d), cv(kh * s * d), m(kh * r_n), l(kh * r_n), acc(kh * r_n * d);
    for (float& v : q) v = Uniform() / 4;
    for (float& v : ck) v = Uniform();
    for (float& v : cv) v = Uniform();
    const int32_t lens[1] = {static_cast<int32_t>(len)};
    SerialPool pool;
    CacheAttentionCore<float>(pool, q.data(), ck.data(), cv.data(), lens, 1, kh, r_n, d, s, m.data(), l.data(), acc.data());
    double worst = 0;
    for (int64_t kv = 0; kv < kh; ++kv)
      for (int64_t r = 0; r < r_n; ++r) {
        std::vector<double> sc(len);
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j < len; ++j) {
          double a = 0;
          for (int64_t e = 0; e < d; ++e) a += double(q[(kv * r_n + r) * d + e]) * ck[(kv * s + j) * d + e];
          mx = std::max(mx, sc[j] = a);
        }
        for (double& v : sc) sum += (v = std::exp(v - mx));
        const int64_t row = kv * r_n + r;
        worst = std::max(worst, std::fabs(l[row] * std::exp(m[row] - mx) - sum) / sum);
        for (int64_t e = 0; e < d; ++e) {
          double o = 0;
          for (int64_t j = 0; j < len; ++j) o += sc[j] * cv[(kv * s + j) * d + e];
          worst = std::max(worst, std::fabs(acc[row * d + e] * std::exp(m[row] - mx) / sum - o / sum));
        }
      }
    const std::string name = "attention cache len=" + std::to_string(len);
    Check(worst < 1e-5, name + " matches the double-precision softmax (max error " + std::to_string(worst) + ")");
    std::vector<float> all(m);
    all.insert(all.end(), l.begin(), l.end());
    all.insert(all.end(), acc.begin(), acc.end());
    std::printf("%s %016llx\n", name.c_str(), static_cast<unsigned long long>(Hash(all.data(), all.size() * 4)));
  }
}

}  // namespace selftest

int main(int argc, char** argv) {
  using namespace selftest;
  if (argc == 6 && std::string(argv[1]) == "bench") {
    const int64_t m = std::atoll(argv[2]), k = std::atoll(argv[3]), n = std::atoll(argv[4]);
    const Weights wt = Make(std::atoi(argv[5]), k, n);
    std::vector<float> x(m * k);
    for (float& v : x) v = Uniform();
    std::vector<double> ts;
    for (int i = 0; i < 25; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      const std::vector<float> y = Product(wt, x, m);
      ts.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ts.begin(), ts.end());
    std::printf("%s m=%lld k=%lld n=%lld bits=%s: %.1f us\n", hsdjax_simd::kIsa, static_cast<long long>(m),
                static_cast<long long>(k), static_cast<long long>(n), argv[5], ts[ts.size() / 2]);
    return 0;
  }
  std::printf("instruction set %s, %d floats per vector\n", hsdjax_simd::kIsa, hsdjax_simd::kLanes);
  MatmulChecks();
  Int16xChecks();
  Int8xChecks();
  ScreenChecks();
  AttentionChecks();
  std::printf("selftest: %d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
