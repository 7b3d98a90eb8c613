// Ragged paged attention for XLA:CPU, called through the XLA FFI.
//
// Same contract as pallas_kernels/paged_attention/reference.py (float32): queries [S, Q, H, D],
// head-major pages [NB, KVH, BS, D], block tables [S, MB], context lengths [S], query
// positions [S, Q]. Why a custom call: XLA:CPU cannot read pages through a block table without
// first copying them (a gather) and has no fused online softmax, so its best paged form still
// moves every K/V byte three times. Here each (row, KV head) task reads its pages in place,
// once, for all of its query cells and GQA heads, with an online softmax.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// A finite "minus infinity" (as the reference's MASKED): the library is built with
// -ffast-math, which assumes no infinities.
constexpr float kMasked = -1e30f;

// Below this many (query cell x visible key x head x head_dim) products a call runs on the
// calling thread: handing a task to a pool thread costs ~10 us on an idle machine and
// milliseconds on a busy 2-core one (measured at batch 1: 2-3 ms per call, more than the
// whole attention), while 1M products take ~0.1-0.3 ms on one core.
constexpr int64_t kMinParallelWork = int64_t{1} << 20;

// q . k over D floats.
inline float Dot(const float* q, const float* k, int64_t D) {
#ifdef __AVX2__
  if (D % 16 == 0) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 16) {
      s0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), s0);
      s1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(k + i + 8), s1);
    }
    const __m256 s = _mm256_add_ps(s0, s1);
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
    return _mm_cvtss_f32(h);
  }
#endif
  float dot = 0.f;
#pragma omp simd reduction(+ : dot)
  for (int64_t i = 0; i < D; ++i) dot += q[i] * k[i];
  return dot;
}

// acc[i] = acc[i] * corr + sum_t w[t] * v[t, i]: each 8-wide slice of acc stays in a register
// while the block's values stream past it.
inline void ScaleAccumulate(float* acc, float corr, const float* w, const float* v, int64_t n,
                            int64_t D) {
#ifdef __AVX2__
  if (D % 8 == 0) {
    const __m256 c = _mm256_set1_ps(corr);
    for (int64_t i = 0; i < D; i += 8) {
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

struct Dims {
  int64_t S, Q, H, D, NB, KVH, BS, MB;
};

// Pull the next block's pages for heads [h0, h1) towards the cache while this one is used:
// blocks sit at random places in the pool, where the hardware prefetcher cannot guess.
inline void Prefetch(const float* base, int64_t floats) {
  for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(base + i, 0, 1);
}

// The online-softmax update of one query head over one block's keys [t0, t1).
inline void VisitBlock(const float* qv, const float* kb, const float* vb, int64_t t0,
                       int64_t t1, int64_t D, float scale, float soft_cap, float* p, float& mx,
                       float& sum, float* acc) {
  float bmax = kMasked;
  for (int64_t t = t0; t < t1; ++t) {
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

// One task: row s, KV heads [h0, h1), every query cell and every query head of those groups.
// Heads are the inner loop so a block's pages for the whole head range are read as one
// contiguous run ([kv_heads, block_size, head_dim] is contiguous per block).
void AttendRow(const Dims& d, int64_t s, int64_t h0, int64_t h1, const float* q,
               const float* kp, const float* vp, const int32_t* tables, const int32_t* lens,
               const int32_t* qpos, float scale, float soft_cap, int32_t window, float* out) {
  const int64_t G = d.H / d.KVH, D = d.D, BS = d.BS, page = BS * D;
  const int64_t heads = (h1 - h0) * G, ctx = lens[s];
  std::vector<float> m(heads), l(heads), acc(heads * D), p(BS);
  for (int64_t c = 0; c < d.Q; ++c) {
    const int64_t pos = qpos[s * d.Q + c];
    const int64_t end = std::min<int64_t>(ctx, pos + 1);  // keys [first, end) are visible
    const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    std::fill(m.begin(), m.end(), kMasked);
    std::fill(l.begin(), l.end(), 0.f);
    std::fill(acc.begin(), acc.end(), 0.f);
    const float* qrow = q + (s * d.Q + c) * d.H * D;
    const int64_t b_end = std::min<int64_t>((end + BS - 1) / BS, d.MB);
    for (int64_t b = first / BS; b < b_end; ++b) {
      const int64_t block = tables[s * d.MB + b];
      if (b + 1 < b_end) {
        const int64_t next = (tables[s * d.MB + b + 1] * d.KVH + h0) * page;
        Prefetch(kp + next, (h1 - h0) * page);
        Prefetch(vp + next, (h1 - h0) * page);
      }
      const int64_t t0 = std::max<int64_t>(first - b * BS, 0);
      const int64_t t1 = std::min<int64_t>(end - b * BS, BS);
      if (t1 <= t0) continue;
      for (int64_t h = h0; h < h1; ++h) {
        const float* kb = kp + (block * d.KVH + h) * page;
        const float* vb = vp + (block * d.KVH + h) * page;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t j = (h - h0) * G + g;
          VisitBlock(qrow + (h * G + g) * D, kb, vb, t0, t1, D, scale, soft_cap, p.data(),
                     m[j], l[j], acc.data() + j * D);
        }
      }
    }
    for (int64_t j = 0; j < heads; ++j) {
      float* o = out + ((s * d.Q + c) * d.H + h0 * G + j) * D;
      const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;  // a cell that sees nothing: zeros
      for (int64_t i = 0; i < D; ++i) o[i] = acc[j * D + i] * inv;
    }
  }
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::F32> k_pages, ffi::Buffer<ffi::F32> v_pages,
                              ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lens,
                              ffi::Buffer<ffi::S32> qpos, float scale, float soft_cap,
                              int32_t window, ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k_pages.dimensions(), td = tables.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || td.size() != 2)
    return ffi::Error::InvalidArgument("paged attention: bad ranks");
  const Dims d{qd[0], qd[1], qd[2], qd[3], kd[0], kd[1], kd[2], td[1]};
  const float* qp = q.typed_data();
  const float* kp = k_pages.typed_data();
  const float* vp = v_pages.typed_data();
  const int32_t* tp = tables.typed_data();
  const int32_t* lp = lens.typed_data();
  const int32_t* pp = qpos.typed_data();
  float* op = out->typed_data();
  // Tasks are rows, split into head ranges only when there are too few rows for the threads.
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  const int64_t splits = std::min<int64_t>(d.KVH, std::max<int64_t>(1, 2 * threads / d.S));
  const int64_t per_split = (d.KVH + splits - 1) / splits;
  const int64_t tasks = d.S * splits;
  // Rows with no context (padding) still write zeros, so every output cell is defined.
  auto run = [=](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t s = t / splits, h0 = (t % splits) * per_split;
      const int64_t h1 = std::min<int64_t>(h0 + per_split, d.KVH);
      if (h0 < h1)
        AttendRow(d, s, h0, h1, qp, kp, vp, tp, lp, pp, scale, soft_cap, window, op);
    }
  };
  int64_t work = 0;
  for (int64_t s = 0; s < d.S; ++s) work += std::max<int64_t>(lp[s], 0);
  work *= d.Q * d.H * d.D;
  const int64_t workers = work < kMinParallelWork ? 1 : std::min<int64_t>(threads, tasks);
  if (workers <= 1) {
    run(0, tasks);
    return ffi::Error::Success();
  }
  std::mutex mu;
  std::condition_variable cv;
  int64_t pending = workers - 1;
  const int64_t per = (tasks + workers - 1) / workers;
  for (int64_t w = 1; w < workers; ++w) {
    const int64_t lo = w * per, hi = std::min(tasks, lo + per);
    pool.Schedule([&, lo, hi] {
      run(lo, hi);
      std::lock_guard<std::mutex> lock(mu);
      if (--pending == 0) cv.notify_one();
    });
  }
  run(0, std::min(tasks, per));
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return pending == 0; });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MetralePagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("window")
                                  .Ret<ffi::Buffer<ffi::F32>>());
