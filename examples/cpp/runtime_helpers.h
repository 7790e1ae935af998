// What both examples share: host memory for the tensors they create, the VM's allocator kind, and an export's
// weights outside its library, loaded by the runtime's tensor cache.
#pragma once

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

#include <cstdlib>
#include <new>
#include <string>
#include <vector>

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

// The export's weights, read by the runtime's tensor cache from `dir` (tensor-cache.json + params_shard_*.bin), in
// the order `main` takes them after its inputs (param_0, param_1, ...).
inline std::vector<tvm::ffi::Tensor> LoadWeights(const std::string& dir, DLDevice dev) {
  tvm::ffi::Function::GetGlobalRequired("vm.builtin.tensor_cache.load")(dir, static_cast<int>(dev.device_type),
                                                                        dev.device_id);
  auto params = tvm::ffi::Function::GetGlobalRequired("vm.builtin.param_array_from_cache")(std::string("param"), -1)
                    .cast<tvm::ffi::Array<tvm::ffi::Tensor>>();
  tvm::ffi::Function::GetGlobalRequired("vm.builtin.tensor_cache.clear")();  // the tensors stay alive in `params`
  return std::vector<tvm::ffi::Tensor>(params.begin(), params.end());
}

}  // namespace tvmfuse_example
