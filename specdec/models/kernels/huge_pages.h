// Packed weights on 2 MiB pages, shared by specdec's linear kernels.
//
// A decode step streams every weight once; on 4 KiB pages that is a TLB miss every 4 KiB (this machine's kernel
// gives anonymous memory huge pages only where asked: transparent_hugepage = madvise). Measured (same process,
// interleaved A/B, shuffled order): one 512 MiB int8 matrix-vector product read 3–28% faster; the 1.5B's float32
// products at 1 / 4 / 8 / 16 rows took 0.95 / 0.89 / 0.88 / 0.94 of their time on 4 KiB pages in fast memory and
// 0.92–1.01 in slow memory; its int8 products (with int8_linear.cpp's prefetch retuned for them) 0.74–0.90 in fast
// memory and 0.84–0.99 in slow.
#pragma once
#include <torch/extension.h>
#include <sys/mman.h>
#include <cstdint>
#include <new>

namespace specdec {

constexpr size_t kHugePage = size_t{2} << 20;

// zeros of `sizes` and `dtype`: from 2 MiB up, a fresh mapping aligned to 2 MiB and advised for huge pages before
// its first touch (memory the allocator hands back was touched on small pages already: in a model's packing, a
// third of it); a tail short of a whole huge page, and any range the kernel refuses, stays on small pages. Smaller
// tensors come from PyTorch's allocator.
inline torch::Tensor zeros_on_huge_pages(at::IntArrayRef sizes, at::ScalarType dtype) {
  const auto options = torch::TensorOptions().dtype(dtype);
  size_t bytes = c10::elementSize(dtype);
  for (const int64_t size : sizes) bytes *= static_cast<size_t>(size);
  if (bytes < kHugePage) return torch::zeros(sizes, options);
  const size_t length = (bytes + 4095) / 4096 * 4096;
  void* mapped = mmap(nullptr, length + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) throw std::bad_alloc();
  char* const first = static_cast<char*>(mapped);
  const uintptr_t offset = (kHugePage - reinterpret_cast<uintptr_t>(first) % kHugePage) % kHugePage;
  char* const aligned = first + offset;
  if (offset) munmap(first, offset);
  munmap(aligned + length, kHugePage - offset);
  madvise(aligned, length, MADV_HUGEPAGE);  // advice only: refused, the pages are small ones
  // a fresh anonymous mapping reads as zeros
  return torch::from_blob(aligned, sizes, [length](void* p) { munmap(p, length); }, options);
}

}  // namespace specdec
