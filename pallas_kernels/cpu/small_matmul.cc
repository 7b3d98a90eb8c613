// Small-batch matmul for XLA:CPU, called through the XLA FFI: y[M, N] = x[M, K] @ w[K, N],
// x float32, w bfloat16 or float32 ([in, out], the model's layout), float32 accumulation.
//
// Why a custom call: a decode step of a few rows is a chain of matrix-vector products that
// only has to stream each weight once, but XLA:CPU runs a bf16 dot with M = 1 ~5x slower than
// the f32 one (it has no bf16 matrix-vector path) and reaches ~17 GB/s on f32. Here every
// weight byte is read once per call (bf16: half the bytes of f32), on the calling thread and
// the crew's helpers (crew.h): bf16 in bands of output columns, each task walking K with its
// accumulators in registers; large f32 layers in slabs of K rows, each task reading its rows
// front to back (sequential streams: ~40 GB/s here against ~21 for column bands).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "bf16.h"
#include "crew.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Rows per pass over the weights: a call with more rows reads them again per pass.
constexpr int64_t kMaxRows = 4;
// Weight rows a tile prefetches ahead of the one it reads: each row of a tile is a short
// run (0.5-1 KB) far from the next (a row of w), which the hardware prefetchers follow badly.
constexpr int64_t kPrefetchRows = 8;
// Below this many weight elements a call runs on the calling thread alone.
constexpr int64_t kMinParallelWeights = int64_t{1} << 16;
// From this many f32 weight elements on, a call splits K into slabs (see Slab); smaller
// ones run column bands (the slabs' partial sums would cost more than they save).
constexpr int64_t kMinSlabWeights = int64_t{1} << 18;

using metrale::ToFloat;

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
  constexpr int kLines = VECS * 16 * sizeof(W) / 64;
  for (int64_t k = 0; k < K; ++k, row += N) {
    if (k + kPrefetchRows < K) {
      const char* ahead = reinterpret_cast<const char*>(row + kPrefetchRows * N);
      for (int l = 0; l < kLines; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
    }
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

// Weight rows [k0, k1), every column, into part[ROWS, N] (+=): each weight row is read
// front to back, so a task's reads are one sequential run the prefetchers follow at full
// speed; the partial sums stay in L1/L2.
template <int ROWS, typename W>
void Slab(const float* x, int64_t K, const W* w, int64_t N, int64_t k0, int64_t k1,
          float* part) {
  // kWeightRows rows of w at a time: each partial sum is loaded and stored once per group
  // (two rows at a time: 38 GB/s on a 49M f32 Llama's MLP; four: 42).
  constexpr int kWeightRows = 4;
  const int64_t vec_end = N - N % 16;
  int64_t k = k0;
  for (; k + kWeightRows <= k1; k += kWeightRows) {
    const W* wk = w + k * N;
    __m512 xs[kWeightRows][ROWS];
    for (int i = 0; i < kWeightRows; ++i)
      for (int r = 0; r < ROWS; ++r) xs[i][r] = _mm512_set1_ps(x[r * K + k + i]);
    for (int64_t n = 0; n < vec_end; n += 16) {
      __m512 ws[kWeightRows];
      for (int i = 0; i < kWeightRows; ++i) ws[i] = Load16(wk + i * N + n);
      for (int r = 0; r < ROWS; ++r) {
        float* out = part + r * N + n;
        __m512 acc = _mm512_loadu_ps(out);
        for (int i = 0; i < kWeightRows; ++i) acc = _mm512_fmadd_ps(xs[i][r], ws[i], acc);
        _mm512_storeu_ps(out, acc);
      }
    }
    for (int64_t n = vec_end; n < N; ++n)
      for (int r = 0; r < ROWS; ++r)
        for (int i = 0; i < kWeightRows; ++i)
          part[r * N + n] += x[r * K + k + i] * ToFloat(wk[i * N + n]);
  }
  for (; k < k1; ++k)
    for (int64_t n = 0; n < N; ++n)
      for (int r = 0; r < ROWS; ++r) part[r * N + n] += x[r * K + k] * ToFloat(w[k * N + n]);
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

#ifdef __AVX512F__
// The calling thread's buffer for the slabs' partial sums, grown as needed: a fresh one per
// call would be mapped and faulted in again for wide layers (an lm_head's 8 x 32 KB).
float* PartsBuffer(int64_t elems) {
  thread_local std::unique_ptr<float[]> buffer;
  thread_local int64_t capacity = 0;
  if (capacity < elems) {
    buffer.reset(new float[elems]);
    capacity = elems;
  }
  return buffer.get();
}

// f32 weights: tasks own K slabs and sum into partials of their own, added up in task order
// afterwards, so the result never depends on which thread ran which task.
void SlabMatmul(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y) {
  metrale::Crew& crew = metrale::Crew::Get();
  // ~4 slabs per thread: a helper that joins late still finds work.
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(crew.threads() * 4, K / 16));
  for (int64_t r0 = 0; r0 < M; r0 += kMaxRows) {
    const int64_t rows = std::min(kMaxRows, M - r0);
    const int64_t size = rows * N;
    float* parts = PartsBuffer(tasks * size);
    const float* xr = x + r0 * K;
    crew.Run(tasks, [&](int64_t t) {
      float* part = parts + t * size;
      std::fill(part, part + size, 0.f);
      const int64_t k0 = K * t / tasks, k1 = K * (t + 1) / tasks;
      if (rows == 1) Slab<1>(xr, K, w, N, k0, k1, part);
      else if (rows == 2) Slab<2>(xr, K, w, N, k0, k1, part);
      else if (rows == 3) Slab<3>(xr, K, w, N, k0, k1, part);
      else Slab<4>(xr, K, w, N, k0, k1, part);
    });
    float* yr = y + r0 * N;
    std::copy(parts, parts + size, yr);
    for (int64_t t = 1; t < tasks; ++t) {
      const float* part = parts + t * size;
      for (int64_t i = 0; i < size; ++i) yr[i] += part[i];
    }
  }
}
#endif

template <typename W>
ffi::Error MatmulImpl(const float* x, int64_t M, int64_t K, const W* w, int64_t N,
                      float* y) {
#ifdef __AVX512F__
  if constexpr (std::is_same_v<W, float>) {
    if (K * N >= kMinSlabWeights) {
      SlabMatmul(x, M, K, w, N, y);
      return ffi::Error::Success();
    }
  }
#endif
  // Bands of 256 columns (a whole number of every tile width): ~4 per thread on wide
  // layers, so a thread that starts late still finds work.
  constexpr int64_t kBand = 256;
  const int64_t bands = (N + kBand - 1) / kBand;
  auto band = [&](int64_t b) { Band(x, M, K, w, N, b * kBand, std::min(N, (b + 1) * kBand), y); };
  if (K * N < kMinParallelWeights) {
    for (int64_t b = 0; b < bands; ++b) band(b);
  } else {
    metrale::Crew::Get().Run(bands, band);
  }
  return ffi::Error::Success();
}

template <ffi::DataType WT>
ffi::Error Matmul(ffi::Buffer<ffi::F32> x, ffi::Buffer<WT> w,
                  ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("small matmul: x [M, K] and w [K, N] expected");
  using Elem = std::conditional_t<WT == ffi::F32, float, uint16_t>;
  return MatmulImpl(x.typed_data(), xd[0], xd[1],
                    reinterpret_cast<const Elem*>(w.untyped_data()), wd[1],
                    y->typed_data());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MetraleSmallMatmulF32, Matmul<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MetraleSmallMatmulBf16, Matmul<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Whether float32 weights run on a vector path here: without AVX-512 they take the plain
// loop, which streams a 49M Llama's f32 weights at half the speed of XLA's own dot on an
// AVX2 Zen 3 (25 against 12 ms), so small_matmul.py leaves them to XLA there.
extern "C" int MetraleSmallMatmulF32Fast() {
#ifdef __AVX512F__
  return 1;
#else
  return 0;
#endif
}
