// A standalone check of hsdjax's CPU kernels without XLA or Python (the kernels' own sources are
// included, so it runs wherever they compile: natively, for another -march, or for aarch64 under a
// user-mode emulator). On inputs made by a fixed integer generator (the same on every machine):
//   - every matmul format (float32, bfloat16, 4-bit and 8-bit compressed panels) at several row counts
//     must equal, bit for bit, a scalar reference chain of fused multiply-adds over k (std::fma), and
//     each row must be the same whatever the row count (a tree pass equals one-token steps);
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
      for (int64_t m : {1, 2, 3, 5, 8, 9, 19}) {
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
  std::printf("selftest: %d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
