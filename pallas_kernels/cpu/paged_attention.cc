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

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// A finite "minus infinity" (as the reference's MASKED): the library is built with
// -ffast-math, which assumes no infinities.
constexpr float kMasked = -1e30f;

struct Dims {
  int64_t S, Q, H, D, NB, KVH, BS, MB;
};

// One task: row s, KV head h, every query cell and every query head of h's group.
void AttendRowHead(const Dims& d, int64_t s, int64_t h, const float* q, const float* kp,
                   const float* vp, const int32_t* tables, const int32_t* lens,
                   const int32_t* qpos, float scale, float soft_cap, int32_t window,
                   float* out) {
  const int64_t G = d.H / d.KVH, D = d.D, BS = d.BS;
  const int64_t ctx = lens[s];
  std::vector<float> m(d.Q * G), l(d.Q * G), acc(d.Q * G * D), p(BS);
  for (int64_t c = 0; c < d.Q; ++c) {
    const int64_t pos = qpos[s * d.Q + c];
    const int64_t end = std::min<int64_t>(ctx, pos + 1);  // keys [first, end) are visible
    const int64_t first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t head = h * G + g, cell = c * G + g;
      const float* qv = q + ((s * d.Q + c) * d.H + head) * D;
      float mx = kMasked, sum = 0.f;
      float* a = acc.data() + cell * D;
      std::fill(a, a + D, 0.f);
      for (int64_t b = first / BS; b * BS < end && b < d.MB; ++b) {
        const int64_t block = tables[s * d.MB + b];
        const float* kb = kp + (block * d.KVH + h) * BS * D;
        const float* vb = vp + (block * d.KVH + h) * BS * D;
        const int64_t t0 = std::max<int64_t>(first - b * BS, 0);
        const int64_t t1 = std::min<int64_t>(end - b * BS, BS);
        if (t1 <= t0) continue;
        float bmax = kMasked;
        for (int64_t t = t0; t < t1; ++t) {
          const float* kt = kb + t * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t i = 0; i < D; ++i) dot += qv[i] * kt[i];
          dot *= scale;
          if (soft_cap > 0.f) dot = soft_cap * std::tanh(dot / soft_cap);
          p[t] = dot;
          bmax = std::max(bmax, dot);
        }
        const float mnew = std::max(mx, bmax);
        const float corr = std::exp(mx - mnew);  // 0 on the first block: mx is kMasked
        // A separate loop of exps, which the compiler vectorizes (libmvec).
#pragma omp simd
        for (int64_t t = t0; t < t1; ++t) p[t] = std::exp(p[t] - mnew);
        sum *= corr;
#pragma omp simd
        for (int64_t i = 0; i < D; ++i) a[i] *= corr;
        for (int64_t t = t0; t < t1; ++t) {
          const float w = p[t];
          sum += w;
          const float* vt = vb + t * D;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) a[i] += w * vt[i];
        }
        mx = mnew;
      }
      float* o = out + ((s * d.Q + c) * d.H + head) * D;
      const float inv = sum > 0.f ? 1.f / sum : 0.f;  // a cell that sees nothing: zeros
      for (int64_t i = 0; i < D; ++i) o[i] = a[i] * inv;
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
  const int64_t tasks = d.S * d.KVH;
  // Rows with no context (padding) still write zeros, so every output cell is defined.
  auto run = [=](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t)
      AttendRowHead(d, t / d.KVH, t % d.KVH, qp, kp, vp, tp, lp, pp, scale, soft_cap, window,
                    op);
  };
  const int64_t workers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), tasks);
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
