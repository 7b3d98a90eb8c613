// Small-batch matmul for XLA:CPU, called through the XLA FFI: y[M, N] = x[M, K] @ w[K, N],
// x float32, w bfloat16 or float32 ([in, out], the model's layout), float32 accumulation.
//
// Why a custom call: a decode step of a few rows is a chain of matrix-vector products that
// only has to stream each weight once, but XLA:CPU runs a bf16 dot with M = 1 ~5x slower than
// the f32 one (it has no bf16 matrix-vector path) and reaches ~17 GB/s on f32. Here a task
// owns a band of output columns and walks K once, holding its accumulators in registers, so
// every weight byte is read once per call (bf16: half the bytes of f32).
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Rows per pass over the weights: a call with more rows reads them again per pass.
constexpr int64_t kMaxRows = 4;
// Below this many weight elements a call runs on the calling thread (a pool hand-off costs
// ~10 us idle, much more on a busy 2-core machine).
constexpr int64_t kMinParallelWeights = int64_t{1} << 16;

inline float ToFloat(float w) { return w; }
inline float ToFloat(uint16_t w) {
  const uint32_t bits = uint32_t{w} << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#ifdef __AVX512F__
inline __m512 Load16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 Load16(const uint16_t* w) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// ROWS rows x VECS vectors of 16 columns, from column n0: ROWS * VECS accumulators.
template <int ROWS, int VECS, typename W>
void Tile(const float* x, int64_t K, const W* w, int64_t N, int64_t n0, float* y) {
  __m512 acc[ROWS][VECS];
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECS; ++v) acc[r][v] = _mm512_setzero_ps();
  const W* row = w + n0;
  for (int64_t k = 0; k < K; ++k, row += N) {
    __m512 wv[VECS];
    for (int v = 0; v < VECS; ++v) wv[v] = Load16(row + 16 * v);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * K + k]);
      for (int v = 0; v < VECS; ++v) acc[r][v] = _mm512_fmadd_ps(xr, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < VECS; ++v) _mm512_storeu_ps(y + r * N + n0 + 16 * v, acc[r][v]);
}
#endif

// Columns [n0, n1) of `rows` rows, any width: the plain loop (tails, other processors).
template <typename W>
void Columns(const float* x, int64_t rows, int64_t K, const W* w, int64_t N, int64_t n0,
             int64_t n1, float* y) {
  for (int64_t r = 0; r < rows; ++r) {
    float* out = y + r * N;
    std::fill(out + n0, out + n1, 0.f);
    for (int64_t k = 0; k < K; ++k) {
      const float xk = x[r * K + k];
      const W* wk = w + k * N;
      for (int64_t n = n0; n < n1; ++n) out[n] += xk * ToFloat(wk[n]);
    }
  }
}

// The columns [n0, n1) of every row, in passes of at most kMaxRows rows. Full tiles run
// the register-blocked kernel; a band is always a whole number of tile widths except at N.
template <typename W>
void Band(const float* x, int64_t M, int64_t K, const W* w, int64_t N, int64_t n0,
          int64_t n1, float* y) {
  for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
    const int64_t rows = std::min(kMaxRows, M - r0);
    const float* xr = x + r0 * K;
    float* yr = y + r0 * N;
    int64_t n = n0;
#ifdef __AVX512F__
    const int64_t width = rows == 1 ? 256 : rows == 2 ? 128 : 64;
    for (; n + width <= n1; n += width) {
      if (rows == 1) Tile<1, 16>(xr, K, w, N, n, yr);
      else if (rows == 2) Tile<2, 8>(xr, K, w, N, n, yr);
      else if (rows == 3) Tile<3, 4>(xr, K, w, N, n, yr);
      else Tile<4, 4>(xr, K, w, N, n, yr);
    }
#endif
    if (n < n1) Columns(xr, rows, K, w, N, n, n1, yr);
  }
}

// Bands on the pool's threads and this one. XLA runs independent custom calls (the q, k, v
// projections) on its pool concurrently, so every pool thread may be blocked in a call like
// this one: a caller that waited for its scheduled helpers to start would deadlock. So the
// caller drains bands itself and waits only for bands claimed by helpers that did start; a
// helper that starts after every band is claimed touches only the shared counters.
template <typename Fn>
void RunBands(ffi::ThreadPool& pool, int64_t bands, bool parallel, Fn&& fn) {
  const int64_t workers =
      parallel ? std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), bands) : 1;
  if (workers <= 1) {
    for (int64_t b = 0; b < bands; ++b) fn(b);
    return;
  }
  struct Shared {
    std::atomic<int64_t> next{0};
    int64_t done = 0;
    std::mutex mu;
    std::condition_variable cv;
  };
  auto shared = std::make_shared<Shared>();
  const std::function<void(int64_t)> call = fn;
  const std::function<void(int64_t)>* callp = &call;  // used only after claiming a band
  auto drain = [shared, callp, bands] {
    int64_t mine = 0;
    for (int64_t b = shared->next.fetch_add(1); b < bands; b = shared->next.fetch_add(1)) {
      (*callp)(b);
      ++mine;
    }
    if (mine) {
      std::lock_guard<std::mutex> lock(shared->mu);
      shared->done += mine;
      if (shared->done == bands) shared->cv.notify_all();
    }
  };
  for (int64_t w = 1; w < workers; ++w) {
    auto helper = drain;  // each helper owns a copy (the pool takes it by value)
    pool.Schedule(std::move(helper));
  }
  drain();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->cv.wait(lock, [&] { return shared->done == bands; });
}

template <typename W>
ffi::Error MatmulImpl(ffi::ThreadPool& pool, const float* x, int64_t M, int64_t K,
                      const W* w, int64_t N, float* y) {
  // Bands of 256 columns (a whole number of every tile width): ~4 per thread on wide
  // layers, so a thread that starts late still finds work.
  constexpr int64_t kBand = 256;
  const int64_t bands = (N + kBand - 1) / kBand;
  RunBands(pool, bands, K * N >= kMinParallelWeights, [&](int64_t b) {
    Band(x, M, K, w, N, b * kBand, std::min(N, (b + 1) * kBand), y);
  });
  return ffi::Error::Success();
}

template <ffi::DataType WT>
ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("small matmul: x [M, K] and w [K, N] expected");
  using Elem = std::conditional_t<WT == ffi::F32, float, uint16_t>;
  return MatmulImpl(pool, x.typed_data(), xd[0], xd[1],
                    reinterpret_cast<const Elem*>(w.untyped_data()), wd[1],
                    y->typed_data());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MetraleSmallMatmulF32, Matmul<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MetraleSmallMatmulBf16, Matmul<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
