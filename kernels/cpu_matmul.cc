// hsdjax's CPU matmul for small M (an XLA FFI custom call; optional, built by `hsdjax cpu-matmul build`).
//
//   y[M, N] = x[M, K] @ W, with W packed in panels wp[N/32, K, 32] (float32)
//
// Every output is one multiply-add chain over k = 0 .. K-1 whatever M is, so a T-token tree pass and a
// one-token `ar` step compute bitwise-equal matmul outputs. A panel (K x 32 weights, contiguous) is read
// once for up to 8 rows of x; M > 8 sweeps it again per 8 rows. Chunks of panels are shared between
// the calling thread and XLA's own intra-op thread pool (no threads of its own).
#include <atomic>
#include <algorithm>
#include <cstdint>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

typedef float v16 __attribute__((vector_size(64)));
constexpr int64_t kPanel = 32;

template <int MT>
void Tile(const float* x, int64_t k_len, const float* wp, float* y, int64_t n) {
  v16 a0[MT], a1[MT];
  for (int m = 0; m < MT; ++m) {
    a0[m] = v16{};
    a1[m] = v16{};
  }
  for (int64_t k = 0; k < k_len; ++k) {
    v16 w0, w1;
    __builtin_memcpy(&w0, wp + k * kPanel, 64);
    __builtin_memcpy(&w1, wp + k * kPanel + 16, 64);
    for (int m = 0; m < MT; ++m) {
      const float xv = x[m * k_len + k];
      a0[m] += xv * w0;
      a1[m] += xv * w1;
    }
  }
  for (int m = 0; m < MT; ++m) {
    __builtin_memcpy(y + m * n, &a0[m], 64);
    __builtin_memcpy(y + m * n + 16, &a1[m], 64);
  }
}

struct Work {
  const float* x;
  int64_t m, k;
  const float* wp;
  int64_t p0, p1;  // panels [p0, p1)
  float* y;
  int64_t n;
};

void Panels(const Work& w) {
  for (int64_t p = w.p0; p < w.p1; ++p) {
    const float* panel = w.wp + p * w.k * kPanel;
    for (int64_t m0 = 0; m0 < w.m; m0 += 8) {
      const float* xs = w.x + m0 * w.k;
      float* ys = w.y + m0 * w.n + p * kPanel;
      switch (w.m - m0 >= 8 ? 8 : w.m - m0) {
        case 8: Tile<8>(xs, w.k, panel, ys, w.n); break;
        case 7: Tile<7>(xs, w.k, panel, ys, w.n); break;
        case 6: Tile<6>(xs, w.k, panel, ys, w.n); break;
        case 5: Tile<5>(xs, w.k, panel, ys, w.n); break;
        case 4: Tile<4>(xs, w.k, panel, ys, w.n); break;
        case 3: Tile<3>(xs, w.k, panel, ys, w.n); break;
        case 2: Tile<2>(xs, w.k, panel, ys, w.n); break;
        default: Tile<1>(xs, w.k, panel, ys, w.n); break;
      }
    }
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

ffi::Error PanelMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> wp,
                       ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = wp.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[2] != kPanel || xd[1] != wd[1]) {
    return ffi::Error::InvalidArgument("hsdjax panel matmul: expects x [M, K] and panels [N/32, K, 32]");
  }
  const int64_t m = xd[0], k = xd[1], panels = wd[0];
  Work all{x.typed_data(), m, k, wp.typed_data(), 0, panels, y->typed_data(), panels * kPanel};
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(HsdjaxPanelMatmul, PanelMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
