// The KV write for bfloat16 pools on XLA:CPU, called through the XLA FFI: each token's K/V
// rows [T, KVH, D] into its slot (block * BS + offset) of head-major pages [NB, KVH, BS, D],
// in place (the pages are aliased to the results).
//
// Why a custom call: XLA:CPU has no bf16 scatter; it widens the whole pool to f32, scatters
// and narrows it back (20 ms a layer for a 16 MB pool against 0.07 ms for the same write into
// f32 pages), and a scatter on the pool's bits as u16 still copies it through its bitcasts.
// A row copy per (token, head) is all the write is.
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error WriteKvPages(ffi::Buffer<ffi::BF16> k_pages, ffi::Buffer<ffi::BF16> v_pages,
                        ffi::Buffer<ffi::BF16> k, ffi::Buffer<ffi::BF16> v,
                        ffi::Buffer<ffi::S32> slots, ffi::ResultBuffer<ffi::BF16> k_out,
                        ffi::ResultBuffer<ffi::BF16> v_out) {
  const auto pd = k_pages.dimensions(), kd = k.dimensions();
  if (pd.size() != 4 || kd.size() != 3 || kd[1] != pd[1] || kd[2] != pd[3] ||
      v.dimensions().size() != 3 || v.dimensions()[0] != kd[0] ||
      slots.dimensions().size() != 1 || slots.dimensions()[0] != kd[0])
    return ffi::Error::InvalidArgument(
        "kv write: pages [NB, KVH, BS, D], k and v [T, KVH, D], slots [T] expected");
  const int64_t NB = pd[0], KVH = pd[1], BS = pd[2], D = pd[3], T = kd[0];
  const int32_t* sp = slots.typed_data();
  for (int64_t t = 0; t < T; ++t)
    if (sp[t] < 0 || sp[t] >= NB * BS)
      return ffi::Error::InvalidArgument("kv write: a slot lies outside the pool");
  const int64_t bytes = D * sizeof(uint16_t);
  const int64_t pool = NB * KVH * BS * bytes;
  auto write = [&](const ffi::Buffer<ffi::BF16>& pages, const ffi::Buffer<ffi::BF16>& rows,
                   ffi::Result<ffi::Buffer<ffi::BF16>>& out) {
    auto* dst = static_cast<char*>(out->untyped_data());
    // The results alias the pages; should XLA ever hand over a fresh buffer, fill it first.
    if (dst != pages.untyped_data()) std::memcpy(dst, pages.untyped_data(), pool);
    const auto* src = static_cast<const char*>(rows.untyped_data());
    for (int64_t t = 0; t < T; ++t) {
      const int64_t block = sp[t] / BS, offset = sp[t] % BS;
      for (int64_t h = 0; h < KVH; ++h)
        std::memcpy(dst + ((block * KVH + h) * BS + offset) * bytes,
                    src + (t * KVH + h) * bytes, bytes);
    }
  };
  write(k_pages, k, k_out);
  write(v_pages, v, v_out);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(MetraleWriteKvPagesBf16, WriteKvPages,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::BF16>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>()
                                  .Ret<ffi::Buffer<ffi::BF16>>());
