// bf16 matmul on AMX tiles for XLA:CPU, called through the XLA FFI: y[M, N] = x[M, K] @ w[K, N],
// x and w bfloat16 (w in the model's [in, out] layout), float32 accumulation, y float32 or
// bfloat16 (rounded to nearest even, as XLA's convert).
//
// Why a custom call: XLA:CPU runs bf16 dots through YNNPACK at 180-690 GFLOP/s here (M = 64
// to 512 rows of a 49M Llama's layers), where the processor's AMX units reach 2-3x that:
// torch's oneDNN does. A decode step of 64 rows and a 512-token prefill chunk are both
// mostly such dots.
//
// A task owns a slab of kSlabCols output columns: it packs the slab of w into the tiles'
// pair-interleaved ("VNNI") order, K rows in pairs [k, k+1] side by side (PackSlab), into a
// buffer of its thread that stays in L1/L2, then for each 32-row block of x accumulates a
// 32 x 32 block of y in four tile registers over K, 32 at a time, slab panel by panel. So w
// is read from memory once a call, and packed while it is still in cache: packing all of w
// first, then multiplying, took 14-18% longer (a chain of a 49M Llama's layers, 64 to 1024
// rows, weights out of cache).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BW__) && \
    defined(__AVX512BF16__)
#define METRALE_AMX 1
#include <immintrin.h>
#endif

#include "crew.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Columns of w a task packs and multiplies: 128 x K bf16 (128 KB at K = 512) stays in L2,
// and a 512-wide layer still makes 4 tasks for the crew (256: the same; 512: 1.5x slower).
constexpr int64_t kSlabCols = 128;
constexpr int64_t kBlock = 32;  // rows and columns of y one tile block holds (2 x 2 tiles)

#ifdef METRALE_AMX

// The tile configuration (palette 1): tiles 0-3 hold y's 16 x 16 float blocks, 4-5 x's two
// 16-row slices (16 rows x 32 bf16), 6-7 w's two 16-column slices (16 pairs of K x 16 x 2).
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

const TileConfig& Config() {
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
      c.rows[t] = 16;
      c.colsb[t] = 64;
    }
    return c;
  }();
  return config;
}

// Linux hands out AMX state only to processes that ask for it (arch_prctl).
bool RequestAmx() {
  constexpr int kReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Columns [c0, c0 + width) of w, every pair of rows, into packed[k_pad / 2][width][2]
// (width a multiple of 32; zeros past K and N). Rows of a slab are `kAhead` pairs ahead
// prefetched: the slab's pieces of each row are short, far apart runs.
void PackSlab(const uint16_t* w, int64_t K, int64_t N, int64_t k_pad, int64_t c0,
              int64_t width, uint16_t* packed) {
  alignas(64) static const uint16_t kLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37,
                                               6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43,
                                               12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t kHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53,
                                               22, 54, 23, 55, 24, 56, 25, 57, 26, 58, 27, 59,
                                               28, 60, 29, 61, 30, 62, 31, 63};
  constexpr int64_t kAhead = 8;
  const __m512i lo = _mm512_load_si512(kLo), hi = _mm512_load_si512(kHi);
  for (int64_t p = 0; p < k_pad / 2; ++p) {
    const int64_t k = 2 * p;
    if (k + 2 * kAhead + 1 < K)
      for (int64_t n = 0; n < width; n += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(w + (k + 2 * kAhead) * N + c0 + n),
                     _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w + (k + 2 * kAhead + 1) * N + c0 + n),
                     _MM_HINT_T0);
      }
    uint16_t* out = packed + p * width * 2;
    for (int64_t n = 0; n < width; n += 32) {
      const int64_t cols = std::clamp<int64_t>(N - c0 - n, 0, 32);
      const __mmask32 mask = cols >= 32 ? ~__mmask32{0} : ((__mmask32{1} << cols) - 1);
      const __m512i r0 = k < K ? _mm512_maskz_loadu_epi16(mask, w + k * N + c0 + n)
                               : _mm512_setzero_si512();
      const __m512i r1 = k + 1 < K ? _mm512_maskz_loadu_epi16(mask, w + (k + 1) * N + c0 + n)
                                   : _mm512_setzero_si512();
      _mm512_storeu_si512(out + 2 * n, _mm512_permutex2var_epi16(r0, lo, r1));
      _mm512_storeu_si512(out + 2 * n + 32, _mm512_permutex2var_epi16(r0, hi, r1));
    }
  }
}

inline void StoreRow(const float* src, float* dst, __mmask16 mask) {
  _mm512_mask_storeu_ps(dst, mask, _mm512_loadu_ps(src));
}
inline void StoreRow(const float* src, uint16_t* dst, __mmask16 mask) {
  const __m256bh b = _mm512_cvtneps_pbh(_mm512_loadu_ps(src));
  __m256i bits;
  std::memcpy(&bits, &b, sizeof bits);
  _mm256_mask_storeu_epi16(dst, mask, bits);
}

// Rows [m0, m1) x columns [n0, n0 + 32) of y. `x` is [rows >= m1 rounded up to 32, k_pad]
// with row stride `lda` elements (zero-padded past M and K where it had to be); `packed` is
// w in pairs (PackPairs), [k_pad / 2, n_pad, 2].
template <typename Y>
void Panel(const uint16_t* x, int64_t lda, int64_t m0, int64_t m1, const uint16_t* packed,
           int64_t n_pad, int64_t k_pad, Y* y, int64_t M, int64_t N, int64_t n0,
           int64_t packed_n0 = 0) {
  alignas(64) float block[kBlock * kBlock];
  const int64_t cols = std::min<int64_t>(32, N - n0);
  const __mmask16 mask0 = cols >= 16 ? 0xffff : __mmask16((1u << cols) - 1);
  const __mmask16 mask1 = cols >= 32 ? 0xffff : cols <= 16 ? 0 : __mmask16((1u << (cols - 16)) - 1);
  const int64_t stride_x = lda * 2, stride_w = n_pad * 4;
  for (int64_t m = m0; m < m1; m += kBlock) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* x0 = x + m * lda;
    const uint16_t* x1 = x0 + 16 * lda;
    for (int64_t k = 0; k < k_pad; k += 32) {
      _tile_loadd(4, x0 + k, stride_x);
      _tile_loadd(5, x1 + k, stride_x);
      const uint16_t* b = packed + (k / 2) * n_pad * 2 + (n0 - packed_n0) * 2;
      _tile_loadd(6, b, stride_w);
      _tile_loadd(7, b + 32, stride_w);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    constexpr int64_t kRowBytes = kBlock * sizeof(float);
    _tile_stored(0, block, kRowBytes);
    _tile_stored(1, block + 16, kRowBytes);
    _tile_stored(2, block + 16 * kBlock, kRowBytes);
    _tile_stored(3, block + 16 * kBlock + 16, kRowBytes);
    const int64_t rows = std::min<int64_t>(kBlock, M - m);
    for (int64_t r = 0; r < rows; ++r) {
      Y* out = y + (m + r) * N + n0;
      StoreRow(block + r * kBlock, out, mask0);
      if (mask1) StoreRow(block + r * kBlock + 16, out + 16, mask1);
    }
  }
}

// The running thread's buffer for a packed slab of w, grown as needed: a thread runs one task
// at a time, whichever call it belongs to.
uint16_t* PackBuffer(int64_t elems) {
  thread_local std::unique_ptr<uint16_t[]> buffer;
  thread_local int64_t capacity = 0;
  if (capacity < elems) {
    buffer.reset(new uint16_t[elems + 32]);
    capacity = elems;
  }
  const auto at = (reinterpret_cast<uintptr_t>(buffer.get()) + 63) & ~uintptr_t{63};
  return reinterpret_cast<uint16_t*>(at);
}

template <typename Y>
void AmxMatmul(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, Y* y) {
  const int64_t k_pad = (K + 31) / 32 * 32;
  const int64_t n_pad = (N + 31) / 32 * 32;
  const int64_t m_pad = (M + kBlock - 1) / kBlock * kBlock;
  // Tile loads read whole 32-row, 32-column blocks of x: pad a copy when x is ragged.
  std::unique_ptr<uint16_t[]> padded;
  const uint16_t* xa = x;
  int64_t lda = K;
  if (m_pad != M || k_pad != K) {
    padded.reset(new uint16_t[m_pad * k_pad]());
    for (int64_t r = 0; r < M; ++r) std::memcpy(&padded[r * k_pad], x + r * K, K * 2);
    xa = padded.get();
    lda = k_pad;
  }
  // Each task packs a slab of kSlabCols columns of w into its thread's buffer and multiplies
  // every row of x against it while it is in cache.
  const int64_t slabs = (n_pad + kSlabCols - 1) / kSlabCols;
  metrale::Crew::Get().Run(slabs, [&](int64_t t) {
    const int64_t c0 = t * kSlabCols, width = std::min(kSlabCols, n_pad - c0);
    uint16_t* slab = PackBuffer(k_pad * kSlabCols);
    PackSlab(w, K, N, k_pad, c0, width, slab);
    _tile_loadconfig(&Config());
    for (int64_t n0 = c0; n0 < c0 + width; n0 += 32)
      Panel(xa, lda, 0, M, slab, width, k_pad, y, M, N, n0, c0);
    _tile_release();
  });
}

#endif  // METRALE_AMX

template <ffi::DataType YT>
ffi::Error Matmul(ffi::Buffer<ffi::BF16> x, ffi::Buffer<ffi::BF16> w,
                  ffi::ResultBuffer<YT> y) {
  const auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0])
    return ffi::Error::InvalidArgument("amx matmul: x [M, K] and w [K, N] expected");
#ifdef METRALE_AMX
  using Y = std::conditional_t<YT == ffi::F32, float, uint16_t>;
  AmxMatmul(reinterpret_cast<const uint16_t*>(x.untyped_data()), xd[0], xd[1],
            reinterpret_cast<const uint16_t*>(w.untyped_data()), wd[1],
            reinterpret_cast<Y*>(y->untyped_data()));
  return ffi::Error::Success();
#else
  return ffi::Error::Internal("amx matmul: the library was built without AMX");
#endif
}

}  // namespace

// 1 when this process may use the AMX tiles (built for them, and granted by the kernel).
extern "C" int MetraleAmxReady() {
#ifdef METRALE_AMX
  static const bool ready = RequestAmx();
  return ready ? 1 : 0;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(MetraleAmxMatmulF32, Matmul<ffi::F32>,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MetraleAmxMatmulBf16, Matmul<ffi::BF16>,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
