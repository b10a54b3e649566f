// An array of zeros whose pages the process has not touched yet (target "tokenmill_lazy_zeros"):
// the KV cache. XLA fills a jnp.zeros result page by page, so a cache of several GiB cost seconds
// at start-up (12-18 s for 6 GiB in a sandboxed VM, where first touches are slow). Here the whole
// pages of the fresh output buffer are handed back to the kernel with MADV_DONTNEED, which makes
// them read as zeros and costs a page only when something first writes it; the partial pages at
// either end are cleared by hand. Where madvise refuses, the buffer is cleared with memset.
// tokenmill/ops/cpu/lazy_zeros.py is its Python side.

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error LazyZerosImpl(ffi::Result<ffi::AnyBuffer> out) {
  char* const begin = static_cast<char*>(out->untyped_data());
  char* const end = begin + out->size_bytes();
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  char* const first = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(begin) + page - 1) / page * page);
  char* const last = reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(end) / page * page);
  if (first < last && madvise(first, size_t(last - first), MADV_DONTNEED) == 0) {
    std::memset(begin, 0, size_t(first - begin));
    std::memset(last, 0, size_t(end - last));
  } else {
    std::memset(begin, 0, size_t(end - begin));
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TokenmillLazyZeros, LazyZerosImpl, ffi::Ffi::Bind().Ret<ffi::AnyBuffer>());
