// Ragged paged attention for XLA:CPU, called through the XLA FFI.
//
// Two entry points, each for float32 or bfloat16 pages (head-major [NB, KVH, BS, D]; bf16
// widened to f32 as it is loaded, so a bf16 pool moves half the bytes for the same float32
// arithmetic), float32 queries and outputs, block tables [S, MB] and context lengths [S].
// Padded: the contract of pallas_kernels/paged_attention/reference.py, queries and
// positions [S, Q, ...]. Ragged: the step's own flat tokens
// [T, H, D], row s owning the run [starts[s], starts[s] + counts[s]), so a step mixing
// prefill chunks with decode rows neither copies queries into [S, Q] nor attends for
// padding cells. Why a custom call: XLA:CPU cannot read pages through a block table without
// first copying them (a gather) and has no fused online softmax, so its best paged form still
// moves every K/V byte three times. Here each task (a row's query cells, a range of KV heads)
// reads its pages in place, once, for all of its cells and GQA heads, with an online softmax.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "crew.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// A finite "minus infinity" (as the reference's MASKED): the library is built with
// -ffast-math, which assumes no infinities.
constexpr float kMasked = -1e30f;

// Below this many (query cell x visible key x head x head_dim) products a call runs on the
// calling thread: 64k products take ~10-30 us on one core, about what a hand-off to the
// crew's helpers costs when they have gone to sleep.
constexpr int64_t kMinParallelWork = int64_t{1} << 16;

// Page elements: float, or bfloat16 (bf16.h).
using metrale::Bf16;
using metrale::ToFloat;
#if defined(__AVX2__) || defined(__AVX512F__)
using metrale::WidenPairs;
#endif


#ifdef __AVX2__
inline float ReduceAdd(__m256 s) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
  return _mm_cvtss_f32(h);
}
#endif

// q . k over D floats.
inline float Dot(const float* q, const float* k, int64_t D) {
#ifdef __AVX512F__
  if (D % 32 == 0) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 32) {
      s0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), _mm512_loadu_ps(k + i), s0);
      s1 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i + 16), _mm512_loadu_ps(k + i + 16), s1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
  }
#endif
#ifdef __AVX2__
  if (D % 16 == 0) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 16) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(k + i + 8), s1);
    }
    return ReduceAdd(_mm256_add_ps(s0, s1));
  }
#endif
  float dot = 0.f;
#pragma omp simd reduction(+ : dot)
  for (int64_t i = 0; i < D; ++i) dot += q[i] * k[i];
  return dot;
}

// acc[i] = acc[i] * corr + sum_t w[t] * v[t, i]: each 16- or 8-wide slice of acc stays in a
// register while the block's values stream past it.
inline void ScaleAccumulate(float* acc, float corr, const float* w, const float* v, int64_t n,
                            int64_t D) {
#ifdef __AVX512F__
  if (D % 16 == 0) {
    const __m512 c = _mm512_set1_ps(corr);
    for (int64_t i = 0; i < D; i += 16) {
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + i), c);
      for (int64_t t = 0; t < n; ++t)
        a = _mm512_fmadd_ps(_mm512_set1_ps(w[t]), _mm512_loadu_ps(v + t * D + i), a);
      _mm512_storeu_ps(acc + i, a);
    }
    return;
  }
#endif
#ifdef __AVX2__
  if (D % 8 == 0) {
    const __m256 c = _mm256_set1_ps(corr);
    int64_t i = 0;
    // Eight slices at a time, each in a register across the block's rows: eight independent
    // chains of adds where one slice at a time was a single chain n long (the same order per
    // element, so the same sums). On a Zen 3, 64 rows x 200 keys with the pages out of cache:
    // 1.4x a layer, to the speed of a plain read of the same bytes.
    for (; i + 64 <= D; i += 64) {
      __m256 a[8];
      for (int j = 0; j < 8; ++j) a[j] = _mm256_mul_ps(_mm256_loadu_ps(acc + i + 8 * j), c);
      for (int64_t t = 0; t < n; ++t) {
        const __m256 wt = _mm256_set1_ps(w[t]);
        const float* vt = v + t * D + i;
        for (int j = 0; j < 8; ++j) a[j] = _mm256_fmadd_ps(wt, _mm256_loadu_ps(vt + 8 * j), a[j]);
      }
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(acc + i + 8 * j, a[j]);
    }
    for (; i < D; i += 8) {
      __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + i), c);
      for (int64_t t = 0; t < n; ++t)
        a = _mm256_fmadd_ps(_mm256_set1_ps(w[t]), _mm256_loadu_ps(v + t * D + i), a);
      _mm256_storeu_ps(acc + i, a);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < D; ++i) acc[i] *= corr;
  for (int64_t t = 0; t < n; ++t)
#pragma omp simd
    for (int64_t i = 0; i < D; ++i) acc[i] += w[t] * v[t * D + i];
}

// bf16 pages are read as pairs: each 32-bit lane of a load holds elements (2i, 2i + 1),
// the even one widened being the lane shifted left by 16 and the odd one the lane with its
// low half cleared, so no shuffle is needed, against q and the accumulator kept split into
// halves (`e[i] = x[2i]` then `o[i] = x[2i + 1]`; SplitPairs / JoinPairs). Needs an even D.
inline void SplitPairs(const float* x, int64_t D, float* split) {
  for (int64_t i = 0; i < D / 2; ++i) {
    split[i] = x[2 * i];
    split[D / 2 + i] = x[2 * i + 1];
  }
}

inline void JoinPairs(const float* split, int64_t D, float scale, float* x) {
  for (int64_t i = 0; i < D / 2; ++i) {
    x[2 * i] = split[i] * scale;
    x[2 * i + 1] = split[D / 2 + i] * scale;
  }
}


// q . k with q pair-split.
inline float Dot(const float* q, const Bf16* k, int64_t D) {
  const float* qo = q + D / 2;
#ifdef __AVX512F__
  if (D % 32 == 0) {
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    for (int64_t i = 0; i < D; i += 32) {
      __m512 even, odd;
      WidenPairs(k + i, even, odd);
      s0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + i / 2), even, s0);
      s1 = _mm512_fmadd_ps(_mm512_loadu_ps(qo + i / 2), odd, s1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
  }
#endif
#ifdef __AVX2__
  if (D % 16 == 0) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 16) {
      __m256 even, odd;
      WidenPairs(k + i, even, odd);
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i / 2), even, s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qo + i / 2), odd, s1);
    }
    return ReduceAdd(_mm256_add_ps(s0, s1));
  }
#endif
  float dot = 0.f;
  for (int64_t i = 0; i < D / 2; ++i)
    dot += q[i] * ToFloat(k[2 * i]) + qo[i] * ToFloat(k[2 * i + 1]);
  return dot;
}

// ScaleAccumulate with acc pair-split.
inline void ScaleAccumulate(float* acc, float corr, const float* w, const Bf16* v, int64_t n,
                            int64_t D) {
  float* acc_o = acc + D / 2;
#ifdef __AVX512F__
  if (D % 32 == 0) {
    const __m512 c = _mm512_set1_ps(corr);
    for (int64_t i = 0; i < D; i += 32) {
      __m512 a = _mm512_mul_ps(_mm512_loadu_ps(acc + i / 2), c);
      __m512 b = _mm512_mul_ps(_mm512_loadu_ps(acc_o + i / 2), c);
      for (int64_t t = 0; t < n; ++t) {
        __m512 even, odd;
        WidenPairs(v + t * D + i, even, odd);
        const __m512 wt = _mm512_set1_ps(w[t]);
        a = _mm512_fmadd_ps(wt, even, a);
        b = _mm512_fmadd_ps(wt, odd, b);
      }
      _mm512_storeu_ps(acc + i / 2, a);
      _mm512_storeu_ps(acc_o + i / 2, b);
    }
    return;
  }
#endif
#ifdef __AVX2__
  if (D % 16 == 0) {
    const __m256 c = _mm256_set1_ps(corr);
    for (int64_t i = 0; i < D; i += 16) {
      __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + i / 2), c);
      __m256 b = _mm256_mul_ps(_mm256_loadu_ps(acc_o + i / 2), c);
      for (int64_t t = 0; t < n; ++t) {
        __m256 even, odd;
        WidenPairs(v + t * D + i, even, odd);
        const __m256 wt = _mm256_set1_ps(w[t]);
        a = _mm256_fmadd_ps(wt, even, a);
        b = _mm256_fmadd_ps(wt, odd, b);
      }
      _mm256_storeu_ps(acc + i / 2, a);
      _mm256_storeu_ps(acc_o + i / 2, b);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < D; ++i) acc[i] *= corr;
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < D / 2; ++i) {
      acc[i] += w[t] * ToFloat(v[t * D + 2 * i]);
      acc_o[i] += w[t] * ToFloat(v[t * D + 2 * i + 1]);
    }
}

struct Dims {
  int64_t H, D, KVH, BS, MB;
};

// Pull `elems` elements towards the cache. The next block's pages of a head are pulled a
// row at a time while this block's rows are visited (VisitBlock): blocks sit at random
// places in the pool, where the hardware prefetcher cannot guess, and pulling a whole block
// at once stalled on the full fill buffers (half the kernel's time in a decode step; spread
// out: 1.53 -> 1.17 ms a layer for 64 rows x 193 bf16 keys with the pages out of cache).
template <typename P>
inline void Prefetch(const P* base, int64_t elems) {
  constexpr int64_t kLine = 64 / sizeof(P);
  for (int64_t i = 0; i < elems; i += kLine) __builtin_prefetch(base + i, 0, 1);
}

// The online-softmax update of one query head over one block's keys [t0, t1); `k_next` and
// `v_next` (or null) are the head's pages in the row's next block, to prefetch.
template <typename P>
inline void VisitBlock(const float* qv, const P* kb, const P* vb, const P* k_next,
                       const P* v_next, int64_t t0, int64_t t1, int64_t D, float scale,
                       float soft_cap, float* p, float& mx, float& sum, float* acc) {
  float bmax = kMasked;
  for (int64_t t = t0; t < t1; ++t) {
    if (k_next != nullptr) {  // row t of this head's next pages, spread over the visit
      Prefetch(k_next + t * D, D);
      Prefetch(v_next + t * D, D);
    }
    float dot = Dot(qv, kb + t * D, D) * scale;
    if (soft_cap > 0.f) dot = soft_cap * std::tanh(dot / soft_cap);
    p[t] = dot;
    bmax = std::max(bmax, dot);
  }
  const float mnew = std::max(mx, bmax);
  const float corr = std::exp(mx - mnew);  // 0 on the first block: mx is kMasked
#pragma omp simd
  for (int64_t t = t0; t < t1; ++t) p[t] = std::exp(p[t] - mnew);
  sum *= corr;
  for (int64_t t = t0; t < t1; ++t) sum += p[t];
  ScaleAccumulate(acc, corr, p + t0, vb + t0 * D, t1 - t0, D);
  mx = mnew;
}

// One task: `cells` consecutive query cells of one row (`q`/`out` point at the first cell's
// [H, D], `pos` at its position), KV heads [h0, h1), every query head of those groups. Heads
// are the inner loop so a block's pages for the whole head range are read as one contiguous
// run ([kv_heads, block_size, head_dim] is contiguous per block).
template <typename P>
void AttendCells(const Dims& d, const int32_t* table, int64_t ctx, const float* q,
                 const int32_t* pos, int64_t cells, int64_t h0, int64_t h1, const P* kp,
                 const P* vp, float scale, float soft_cap, int32_t window, float* out) {
  const int64_t G = d.H / d.KVH, D = d.D, BS = d.BS, page = BS * D;
  const int64_t heads = (h1 - h0) * G;
  // bf16 pages: q and acc pair-split (see Dot), for heads [h0, h1) only.
  constexpr bool kPairs = std::is_same_v<P, Bf16>;
  std::vector<float> m(heads), l(heads), acc(heads * D), p(BS), qsplit(kPairs ? heads * D : 0);
  for (int64_t c = 0; c < cells; ++c) {
    const int64_t at = pos[c];
    const int64_t end = std::min<int64_t>(ctx, at + 1);  // keys [first, end) are visible
    const int64_t first = window > 0 ? std::max<int64_t>(0, at - window + 1) : 0;
    std::fill(m.begin(), m.end(), kMasked);
    std::fill(l.begin(), l.end(), 0.f);
    std::fill(acc.begin(), acc.end(), 0.f);
    // This cell's query heads of [h0, h1).
    const float* qcell = q + (c * d.H + h0 * G) * D;
    if constexpr (kPairs) {
      for (int64_t j = 0; j < heads; ++j) SplitPairs(qcell + j * D, D, qsplit.data() + j * D);
      qcell = qsplit.data();
    }
    const int64_t b_end = std::min<int64_t>((end + BS - 1) / BS, d.MB);
    for (int64_t b = first / BS; b < b_end; ++b) {
      const int64_t block = table[b];
      const int64_t t0 = std::max<int64_t>(first - b * BS, 0);
      const int64_t t1 = std::min<int64_t>(end - b * BS, BS);
      if (t1 <= t0) continue;
      const int64_t next = b + 1 < b_end ? table[b + 1] : -1;
      for (int64_t h = h0; h < h1; ++h) {
        const P* kb = kp + (block * d.KVH + h) * page;
        const P* vb = vp + (block * d.KVH + h) * page;
        const P* kn = next < 0 ? nullptr : kp + (next * d.KVH + h) * page;
        const P* vn = next < 0 ? nullptr : vp + (next * d.KVH + h) * page;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t j = (h - h0) * G + g;
          // The next block is prefetched once per head, not once per query head of it.
          VisitBlock(qcell + j * D, kb, vb, g == 0 ? kn : nullptr, vn, t0, t1, D, scale,
                     soft_cap, p.data(), m[j], l[j], acc.data() + j * D);
        }
      }
    }
    for (int64_t j = 0; j < heads; ++j) {
      float* o = out + (c * d.H + h0 * G + j) * D;
      const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;  // a cell that sees nothing: zeros
      if constexpr (kPairs) {
        JoinPairs(acc.data() + j * D, D, inv, o);
      } else {
        for (int64_t i = 0; i < D; ++i) o[i] = acc[j * D + i] * inv;
      }
    }
  }
}

// A unit of work: query cells [c0, c1) of row s, KV heads [h0, h1).
struct Task {
  int64_t s, c0, c1, h0, h1;
};

// Below this many query cells per task a long chunk is not split further: each task re-reads
// the row's pages, so splitting only pays when there are threads to spare.
constexpr int64_t kCellsPerTask = 32;

// Tasks for rows with `cells[s]` query cells: a row is split into cell ranges and head ranges
// only as far as the threads need; `work` sums cells x visible keys (the parallel gate).
std::vector<Task> MakeTasks(const Dims& d, int64_t S, const int64_t* cells,
                            const int32_t* lens, int64_t threads, int64_t& work) {
  int64_t busy = 0;
  work = 0;
  for (int64_t s = 0; s < S; ++s) {
    if (cells[s] > 0 && lens[s] > 0) ++busy;
    work += cells[s] * std::max<int64_t>(lens[s], 0);
  }
  work *= d.H * d.D;
  const int64_t splits =
      std::min<int64_t>(d.KVH, std::max<int64_t>(1, 2 * threads / std::max<int64_t>(busy, 1)));
  const int64_t per_split = (d.KVH + splits - 1) / splits;
  std::vector<Task> tasks;
  for (int64_t s = 0; s < S; ++s) {
    if (cells[s] <= 0) continue;
    // Rows with no context (padding) still run, writing zeros, so every cell is defined.
    const int64_t step = cells[s] > 2 * kCellsPerTask && threads > 1 ? kCellsPerTask : cells[s];
    for (int64_t c0 = 0; c0 < cells[s]; c0 += step)
      for (int64_t h0 = 0; h0 < d.KVH; h0 += per_split)
        tasks.push_back({s, c0, std::min(cells[s], c0 + step), h0,
                         std::min(d.KVH, h0 + per_split)});
  }
  return tasks;
}

// Runs `tasks` on the calling thread and, when the work is big enough, the crew's helpers
// (crew.h), which take the next task from a shared counter (rows differ widely in cost: a
// prefill chunk beside decode rows).
template <typename Fn>
void RunTasks(int64_t count, int64_t work, Fn&& fn) {
  if (work < kMinParallelWork) {
    for (int64_t t = 0; t < count; ++t) fn(t);
    return;
  }
  metrale::Crew::Get().Run(count, std::forward<Fn>(fn));
}

constexpr const char* kOddBf16 = "paged attention: bf16 pages need an even head_dim";

// The C++ element of a page buffer of dtype PT.
template <ffi::DataType PT>
using PageElem = std::conditional_t<PT == ffi::F32, float, Bf16>;

template <ffi::DataType PT>
const PageElem<PT>* Pages(const ffi::Buffer<PT>& pages) {
  return reinterpret_cast<const PageElem<PT>*>(pages.untyped_data());
}

// Padded layout: queries [S, Q, H, D], positions [S, Q], output [S, Q, H, D].
template <ffi::DataType PT>
ffi::Error PagedAttentionImpl(ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<PT> k_pages, ffi::Buffer<PT> v_pages,
                              ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lens,
                              ffi::Buffer<ffi::S32> qpos, float scale, float soft_cap,
                              int32_t window, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k_pages.dimensions(), td = tables.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("paged attention: bad ranks");
  const int64_t S = qd[0], Q = qd[1];
  const Dims d{qd[2], qd[3], kd[1], kd[2], td[1]};
  if (PT == ffi::BF16 && d.D % 2) return ffi::Error::InvalidArgument(kOddBf16);
  const float* qp = q.typed_data();
  const int32_t* tp = tables.typed_data();
  const int32_t* lp = lens.typed_data();
  const int32_t* pp = qpos.typed_data();
  float* op = out->typed_data();
  const int64_t cell = d.H * d.D;
  std::vector<int64_t> cells(S, Q);
  int64_t work = 0;
  const auto tasks = MakeTasks(d, S, cells.data(), lp, metrale::Crew::Get().threads(), work);
  RunTasks(tasks.size(), work, [&](int64_t i) {
    const Task& t = tasks[i];
    const int64_t first = t.s * Q + t.c0;
    AttendCells(d, tp + t.s * d.MB, lp[t.s], qp + first * cell, pp + first, t.c1 - t.c0, t.h0,
                t.h1, Pages(k_pages), Pages(v_pages), scale, soft_cap, window,
                op + first * cell);
  });
  return ffi::Error::Success();
}

// Ragged layout: queries [T, H, D] flat, row s owning tokens [starts[s], starts[s] +
// counts[s]); positions [T]; output [T, H, D], zeros for tokens no row owns (padding).
template <ffi::DataType PT>
ffi::Error RaggedPagedAttentionImpl(ffi::Buffer<ffi::F32> q,
                                    ffi::Buffer<PT> k_pages,
                                    ffi::Buffer<PT> v_pages,
                                    ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lens,
                                    ffi::Buffer<ffi::S32> positions,
                                    ffi::Buffer<ffi::S32> starts, ffi::Buffer<ffi::S32> counts,
                                    float scale, float soft_cap, int32_t window,
                                    ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k_pages.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("ragged paged attention: bad ranks");
  const int64_t T = qd[0], S = td[0];
  const Dims d{qd[1], qd[2], kd[1], kd[2], td[1]};
  if (PT == ffi::BF16 && d.D % 2) return ffi::Error::InvalidArgument(kOddBf16);
  const int32_t* sp = starts.typed_data();
  const int32_t* cp = counts.typed_data();
  const int64_t cell = d.H * d.D;
  float* op = out->typed_data();
  std::vector<int64_t> cells(S);
  std::vector<char> owned(T, 0);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t lo = std::clamp<int64_t>(sp[s], 0, T);
    cells[s] = std::clamp<int64_t>(cp[s], 0, T - lo);
    std::fill(owned.begin() + lo, owned.begin() + lo + cells[s], 1);
  }
  for (int64_t t = 0; t < T; ++t)
    if (!owned[t]) std::fill(op + t * cell, op + (t + 1) * cell, 0.f);
  const int32_t* lp = lens.typed_data();
  int64_t work = 0;
  const auto tasks = MakeTasks(d, S, cells.data(), lp, metrale::Crew::Get().threads(), work);
  RunTasks(tasks.size(), work, [&](int64_t i) {
    const Task& t = tasks[i];
    const int64_t first = std::clamp<int64_t>(sp[t.s], 0, T) + t.c0;
    AttendCells(d, tables.typed_data() + t.s * d.MB, lp[t.s], q.typed_data() + first * cell,
                positions.typed_data() + first, t.c1 - t.c0, t.h0, t.h1,
                Pages(k_pages), Pages(v_pages), scale, soft_cap, window,
                op + first * cell);
  });
  return ffi::Error::Success();
}

}  // namespace

#define METRALE_PAGED_ATTENTION(name, PT)                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, PagedAttentionImpl<PT>,      \
                                ffi::Ffi::Bind()                   \
                                    .Arg<ffi::Buffer<ffi::F32>>()  \
                                    .Arg<ffi::Buffer<PT>>()        \
                                    .Arg<ffi::Buffer<PT>>()        \
                                    .Arg<ffi::Buffer<ffi::S32>>()  \
                                    .Arg<ffi::Buffer<ffi::S32>>()  \
                                    .Arg<ffi::Buffer<ffi::S32>>()  \
                                    .Attr<float>("scale")          \
                                    .Attr<float>("soft_cap")       \
                                    .Attr<int32_t>("window")       \
                                    .Ret<ffi::Buffer<ffi::F32>>())

#define METRALE_RAGGED_PAGED_ATTENTION(name, PT)                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, RaggedPagedAttentionImpl<PT>, \
                                ffi::Ffi::Bind()                    \
                                    .Arg<ffi::Buffer<ffi::F32>>()   \
                                    .Arg<ffi::Buffer<PT>>()         \
                                    .Arg<ffi::Buffer<PT>>()         \
                                    .Arg<ffi::Buffer<ffi::S32>>()   \
                                    .Arg<ffi::Buffer<ffi::S32>>()   \
                                    .Arg<ffi::Buffer<ffi::S32>>()   \
                                    .Arg<ffi::Buffer<ffi::S32>>()   \
                                    .Arg<ffi::Buffer<ffi::S32>>()   \
                                    .Attr<float>("scale")           \
                                    .Attr<float>("soft_cap")        \
                                    .Attr<int32_t>("window")        \
                                    .Ret<ffi::Buffer<ffi::F32>>())

METRALE_PAGED_ATTENTION(MetralePagedAttention, ffi::F32);
METRALE_PAGED_ATTENTION(MetralePagedAttentionBf16, ffi::BF16);
METRALE_RAGGED_PAGED_ATTENTION(MetraleRaggedPagedAttention, ffi::F32);
METRALE_RAGGED_PAGED_ATTENTION(MetraleRaggedPagedAttentionBf16, ffi::BF16);
