// Matmul over weights packed in column blocks, for the rows of a decode step (XLA:CPU,
// through the XLA FFI): y[M, NB * 32] = x[M, K] @ w, w packed once at load time
// (packed_matmul.py):
//   float32:  packed[b, k, c]          = w[k, 32 b + c]          [NB, K, 32]
//   bfloat16: packed[b, p, 2 c + j]    = w[2 p + j, 32 b + c]    [NB, K / 2, 64]
// float32 accumulation; bf16 weights take bf16 rows (the model's activations in bf16).
//
// Why a layout of its own: a decode step only has to stream each weight once, and how fast
// it does depends on the order of the reads. In the model's [K, N] layout a task owning a
// band of columns reads a short run of every row (strided: ~20 GB/s on two Zen 4 cores),
// and a task owning a slab of rows keeps partial sums in memory (~25 GB/s). A column block
// here is one contiguous run of K * 32 weights whose 32 sums per row stay in registers: one
// sequential stream per task, nothing to add up afterwards (~37 GB/s, what a plain read of
// the same bytes reaches). More rows read a block again from cache, not from memory, so
// the kernel beats XLA's dot up to ~100 rows here. The bf16 pairs of k sit side by side,
// the operand order of AVX512-BF16's dot product (vdpbf16ps: 32 products an instruction).
// Without AVX-512 (AVX2 + FMA: Zen 2/3) the same loops run on 8-lane vectors in 16
// registers: float32 six rows over half a block a pass, bf16 two rows over the whole block,
// the bf16 pairs widened by a shift and a mask.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define METRALE_PACKED_AVX2 1  // the 8-lane path: AVX2 + FMA, no AVX-512 (Zen 2/3, ...)
#endif

#include "bf16.h"
#include "crew.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;  // output columns per block
// Rows per pass over a block (W: the weights' element type): their sums take 16 of the 32
// vector registers (AVX-512). On AVX2's 16: float32 passes take six rows over each half of a
// block (12 sums, 2 weight vectors, 1 broadcast), bf16 ones two rows over the whole block
// (8 sums; each pair widens into two vectors).
template <typename W>
constexpr int MaxRows() {
#ifdef METRALE_PACKED_AVX2
  return std::is_same_v<W, float> ? 6 : 2;
#else
  return 8;
#endif
}
// Below this many weight elements a call runs on the calling thread alone.
constexpr int64_t kMinParallelWeights = int64_t{1} << 16;

using metrale::Bf16;
using metrale::ToFloat;

#ifdef __AVX512F__
// A block's 32 sums of each of ROWS rows, into rows of y (row stride N).
template <int ROWS>
void StoreSums(const __m512 (&acc)[ROWS][2], float* y, int64_t N) {
  for (int r = 0; r < ROWS; ++r) {
    _mm512_storeu_ps(y + r * N, acc[r][0]);
    _mm512_storeu_ps(y + r * N + 16, acc[r][1]);
  }
}
#endif

#ifdef METRALE_PACKED_AVX2
// A block's 32 sums of each of ROWS rows (four 8-lane vectors a row), into rows of y.
template <int ROWS>
void StoreSums8(const __m256 (&acc)[ROWS][4], float* y, int64_t N) {
  for (int r = 0; r < ROWS; ++r)
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(y + r * N + 8 * v, acc[r][v]);
}

// A float32 block for ROWS rows: one chain per row and vector, as on AVX-512, so a row's
// sums are the same in any batch, and the same whichever of the two tilings below ran them.
// One or two rows: the whole block a pass (four chains a row: enough to stream one row's
// weights from memory). More: one half (16 columns) at a time, six rows keeping 12 sums in
// registers: 12 FMAs per 2 weight loads and 6 broadcasts, where two rows over the whole
// block did 8 per 4 and 2 (one Zen 3 core, 64 rows x [512, 3072]: ~52 against ~36 GFLOP/s).
template <int ROWS>
void Block8(const float* x, int64_t K, const float* blk, float* y, int64_t N) {
  if constexpr (ROWS <= 2) {
    __m256 acc[ROWS][4];
    for (auto& row : acc)
      for (auto& v : row) v = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      __m256 w[4];
      for (int v = 0; v < 4; ++v) w[v] = _mm256_loadu_ps(blk + k * kBlock + 8 * v);
      for (int r = 0; r < ROWS; ++r) {
        const __m256 xr = _mm256_set1_ps(x[r * K + k]);
        for (int v = 0; v < 4; ++v) acc[r][v] = _mm256_fmadd_ps(xr, w[v], acc[r][v]);
      }
    }
    StoreSums8<ROWS>(acc, y, N);
  } else {
    for (int h = 0; h < kBlock; h += 16) {
      __m256 acc[ROWS][2];
      for (auto& row : acc) row[0] = row[1] = _mm256_setzero_ps();
      for (int64_t k = 0; k < K; ++k) {
        const __m256 w0 = _mm256_loadu_ps(blk + k * kBlock + h);
        const __m256 w1 = _mm256_loadu_ps(blk + k * kBlock + h + 8);
        for (int r = 0; r < ROWS; ++r) {
          const __m256 xr = _mm256_set1_ps(x[r * K + k]);
          acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
        }
      }
      for (int r = 0; r < ROWS; ++r) {
        _mm256_storeu_ps(y + r * N + h, acc[r][0]);
        _mm256_storeu_ps(y + r * N + h + 8, acc[r][1]);
      }
    }
  }
}

// The same for bf16, which AVX2 has no arithmetic for: widen (bf16.h's WidenPairs). Eight
// 32-bit lanes of a packed row hold (w[2p, c], w[2p+1, c]) for 8 columns. Each product of
// two bf16 values is exact in float32.
template <int ROWS>
void Block8(const Bf16* x, int64_t K, const Bf16* blk, float* y, int64_t N) {
  __m256 acc[ROWS][4];
  for (auto& row : acc)
    for (auto& v : row) v = _mm256_setzero_ps();
  for (int64_t p = 0; p < K / 2; ++p) {
    __m256 x0[ROWS], x1[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      x0[r] = _mm256_set1_ps(ToFloat(x[r * K + 2 * p]));
      x1[r] = _mm256_set1_ps(ToFloat(x[r * K + 2 * p + 1]));
    }
    const Bf16* pair_row = blk + p * 2 * kBlock;
    for (int v = 0; v < 4; ++v) {
      __m256 w0, w1;
      metrale::WidenPairs(pair_row + 16 * v, w0, w1);
      for (int r = 0; r < ROWS; ++r) {
        acc[r][v] = _mm256_fmadd_ps(x0[r], w0, acc[r][v]);
        acc[r][v] = _mm256_fmadd_ps(x1[r], w1, acc[r][v]);
      }
    }
  }
  StoreSums8<ROWS>(acc, y, N);
}
#endif

// One block of 32 columns for ROWS rows, float32 weights: blk is [K, 32]. One chain of
// accumulators per row and vector, whatever ROWS is: a row's sums come out the same in
// any batch (even one chain per vector streams ~90 GB/s from cache, far above memory).
template <int ROWS>
void Block(const float* x, int64_t K, const float* blk, float* y, int64_t N) {
#ifdef __AVX512F__
  __m512 acc[ROWS][2];
  for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(blk + k * kBlock);
    const __m512 w1 = _mm512_loadu_ps(blk + k * kBlock + 16);
    for (int r = 0; r < ROWS; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xr, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xr, w1, acc[r][1]);
    }
  }
  StoreSums<ROWS>(acc, y, N);
#elif defined(METRALE_PACKED_AVX2)
  Block8<ROWS>(x, K, blk, y, N);
#else
  for (int r = 0; r < ROWS; ++r) {
    float out[kBlock] = {};
    for (int64_t k = 0; k < K; ++k)
      for (int c = 0; c < kBlock; ++c) out[c] += x[r * K + k] * blk[k * kBlock + c];
    std::memcpy(y + r * N, out, sizeof out);
  }
#endif
}

#if defined(__AVX512BF16__)
// The bf16 pair (x[2p], x[2p+1]) in every lane: vdpbf16ps's other operand.
inline __m512bh PairOf(const Bf16* x, int64_t p) {
  uint32_t pair;
  std::memcpy(&pair, x + 2 * p, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
}

// Accumulator lane c of a block gets w[2p, c] x[2p] + w[2p+1, c] x[2p+1] per pair p.
template <int ROWS>
void DotPair(const Bf16* x, int64_t K, const Bf16* pair_row, int64_t p, __m512 (&acc)[ROWS][2]) {
  const __m512bh w0 = (__m512bh)_mm512_loadu_si512(pair_row);
  const __m512bh w1 = (__m512bh)_mm512_loadu_si512(pair_row + 32);
  for (int r = 0; r < ROWS; ++r) {
    const __m512bh xr = PairOf(x + r * K, p);
    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xr, w0);
    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xr, w1);
  }
}
#endif

// The same for bf16 weights and rows: blk is [K / 2, 64].
template <int ROWS>
void Block(const Bf16* x, int64_t K, const Bf16* blk, float* y, int64_t N) {
  const int64_t pairs = K / 2;
#if defined(__AVX512BF16__)
  __m512 acc[ROWS][2];  // as for float32: one chain per row and vector
  for (auto& row : acc) row[0] = row[1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) DotPair<ROWS>(x, K, blk + p * 2 * kBlock, p, acc);
  StoreSums<ROWS>(acc, y, N);
#elif defined(METRALE_PACKED_AVX2)
  Block8<ROWS>(x, K, blk, y, N);
#else
  for (int r = 0; r < ROWS; ++r) {
    float out[kBlock] = {};
    for (int64_t q = 0; q < pairs; ++q)
      for (int c = 0; c < kBlock; ++c)
        for (int j = 0; j < 2; ++j)
          out[c] += ToFloat(x[r * K + 2 * q + j]) * ToFloat(blk[q * 2 * kBlock + 2 * c + j]);
    std::memcpy(y + r * N, out, sizeof out);
  }
#endif
}

// Block<rows> for a count known only at run time (1..ROWS).
template <int ROWS, typename X, typename W>
void BlockOf(int64_t rows, const X* x, int64_t K, const W* blk, float* y, int64_t N) {
  if constexpr (ROWS > 1) {
    if (rows < ROWS) return BlockOf<ROWS - 1>(rows, x, K, blk, y, N);
  }
  Block<ROWS>(x, K, blk, y, N);
}

// Blocks [b0, b1) of all M rows: each block is read from memory once, then again from cache
// for every further MaxRows rows.
template <typename X, typename W>
void Blocks(const X* x, int64_t M, int64_t K, const W* packed, int64_t N, int64_t b0,
            int64_t b1, float* y) {
  constexpr int kRows = MaxRows<W>();
  for (int64_t b = b0; b < b1; ++b) {
    for (int64_t r0 = 0; r0 < M; r0 += kRows)
      BlockOf<kRows>(std::min<int64_t>(kRows, M - r0), x + r0 * K, K, packed + b * K * kBlock,
                     y + r0 * N + b * kBlock, N);
  }
}

template <typename X, typename W>
void PackedMatmul(const X* x, int64_t M, int64_t K, const W* packed, int64_t blocks,
                  float* y) {
  const int64_t N = blocks * kBlock;
  metrale::Crew& crew = metrale::Crew::Get();
  // ~4 runs of blocks per thread, so a helper that joins late still finds work; each task
  // writes its own columns, so the result never depends on which thread ran which.
  const int64_t tasks = K * N * M < kMinParallelWeights
                            ? 1 : std::min<int64_t>(blocks, crew.threads() * 4);
  crew.Run(tasks, [&](int64_t t) {
    Blocks(x, M, K, packed, N, blocks * t / tasks, blocks * (t + 1) / tasks, y);
  });
}

template <ffi::DataType T>
ffi::Error Matmul(ffi::Buffer<T> x, ffi::Buffer<T> packed, ffi::ResultBuffer<ffi::F32> y) {
  using Elem = std::conditional_t<T == ffi::F32, float, Bf16>;
  constexpr int64_t kPair = T == ffi::F32 ? 1 : 2;  // k values per packed row
  const auto xd = x.dimensions(), pd = packed.dimensions();
  if (xd.size() != 2 || pd.size() != 3 || pd[1] * kPair != xd[1] ||
      pd[2] != kBlock * kPair)
    return ffi::Error::InvalidArgument(
        "packed matmul: x [M, K] and packed [N / 32, K, 32] (bf16: [N / 32, K / 2, 64]) "
        "expected");
  PackedMatmul(reinterpret_cast<const Elem*>(x.untyped_data()), xd[0], xd[1],
               reinterpret_cast<const Elem*>(packed.untyped_data()), pd[0],
               y->typed_data());
  return ffi::Error::Success();
}

// Each row RMS-normalised and scaled, in float32 as model/layers.py's RMSNorm does it
// (x * rsqrt(mean(x^2) + eps), then scale * that), rounded to the weights' dtype: the
// rows a decode step's first projection of a block reads.
template <typename X>
void NormRows(const X* x, const X* scale, int64_t M, int64_t K, float eps, X* out) {
  for (int64_t r = 0; r < M; ++r) {
    const X* row = x + r * K;
    float squares = 0.f;
    for (int64_t k = 0; k < K; ++k) squares += ToFloat(row[k]) * ToFloat(row[k]);
    const float inv = 1.f / std::sqrt(squares / static_cast<float>(K) + eps);
    for (int64_t k = 0; k < K; ++k)
      out[r * K + k] = metrale::FromFloat<X>(ToFloat(scale[k]) * (ToFloat(row[k]) * inv));
  }
}

// y = RMSNorm(x) @ w: the norm before a block's first projection folded into its call (one
// custom call where XLA ran four small fusions and a hand-off).
template <ffi::DataType T>
ffi::Error NormMatmul(ffi::Buffer<T> x, ffi::Buffer<T> scale, ffi::Buffer<T> packed, float eps,
                      ffi::ResultBuffer<ffi::F32> y) {
  using Elem = std::conditional_t<T == ffi::F32, float, Bf16>;
  constexpr int64_t kPair = T == ffi::F32 ? 1 : 2;
  const auto xd = x.dimensions(), sd = scale.dimensions(), pd = packed.dimensions();
  if (xd.size() != 2 || sd.size() != 1 || sd[0] != xd[1] || pd.size() != 3 ||
      pd[1] * kPair != xd[1] || pd[2] != kBlock * kPair)
    return ffi::Error::InvalidArgument(
        "packed norm matmul: x [M, K], scale [K] and packed [N / 32, K, 32] (bf16: "
        "[N / 32, K / 2, 64]) expected");
  thread_local std::vector<Elem> normed;
  normed.resize(xd[0] * xd[1]);
  NormRows(reinterpret_cast<const Elem*>(x.untyped_data()),
           reinterpret_cast<const Elem*>(scale.untyped_data()), xd[0], xd[1], eps,
           normed.data());
  PackedMatmul(normed.data(), xd[0], xd[1], reinterpret_cast<const Elem*>(packed.untyped_data()),
               pd[0], y->typed_data());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MetralePackedNormMatmulF32, NormMatmul<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MetralePackedNormMatmulBf16, NormMatmul<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Attr<float>("eps")
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MetralePackedMatmulF32, Matmul<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MetralePackedMatmulBf16, Matmul<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// Whether this build runs the vector path for bf16 (nonzero `bf16`) or float32 weights;
// without it the packed layout would lose to the model's (packed_matmul.py asks first).
extern "C" int MetralePackedMatmulFast(int bf16) {
#if defined(__AVX512BF16__) || defined(METRALE_PACKED_AVX2)
  return 1;
#elif defined(__AVX512F__)
  return bf16 ? 0 : 1;
#else
  return 0;
#endif
}
