// What both examples share: host memory for the tensors they create, and the VM's allocator kind.
#pragma once

#include <tvm/ffi/container/tensor.h>

#include <cstdlib>
#include <new>

namespace tvmfuse_example {

constexpr int kPooledAllocator = 2;  // tvm.runtime.vm.VirtualMachine.POOLED_ALLOCATOR

// Host memory for input tensors (ffi::Tensor::FromNDAlloc calls these).
struct CPUAlloc {
  void AllocData(DLTensor* t) {
    t->data = std::aligned_alloc(64, (tvm::ffi::GetDataSize(*t) + 63) / 64 * 64);
    if (t->data == nullptr) throw std::bad_alloc();
  }
  void FreeData(DLTensor* t) { std::free(t->data); }
};

}  // namespace tvmfuse_example
