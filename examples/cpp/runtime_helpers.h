// What both examples share: the device (--device cpu|cuda) and the runtime's CUDA part, host memory for the tensors
// they create and their copies to and from the device, the VM's start on a device, and an export's weights outside
// its library, loaded by the runtime's tensor cache.
#pragma once

#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/function.h>

#include <dlfcn.h>

#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#ifndef TVMFUSE_TVM_LIB_DIR
#define TVMFUSE_TVM_LIB_DIR ""  // the Makefile sets it: the folder of the wheel's libtvm_runtime.so
#endif

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

// The device a --device option names: cpu, or cuda (GPU 0).
inline DLDevice ParseDevice(const std::string& name) {
  if (name == "cpu") return DLDevice{kDLCPU, 0};
  if (name == "cuda") return DLDevice{kDLCUDA, 0};
  throw std::invalid_argument("--device " + name + ": cpu or cuda");
}

// Before a CUDA export is loaded: the runtime's CUDA part (the CUDA device API and module loader), which the wheel
// ships as a library of its own beside libtvm_runtime.so (Python's `import tvm` loads it the same way).
inline void LoadDeviceRuntime(DLDevice dev) {
  if (dev.device_type != kDLCUDA) return;
  std::string path = std::string(TVMFUSE_TVM_LIB_DIR) + "/libtvm_runtime_cuda.so";
  if (dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL) == nullptr) {
    throw std::runtime_error("cannot load " + path + " (the TVM runtime's CUDA part): " + dlerror());
  }
}

// The Relax VM of `vm_module` started on `dev`, with the CPU as its host where `dev` is a GPU (as Python's
// relax.VirtualMachine does).
inline void StartVM(const tvm::ffi::Module& vm_module, DLDevice dev) {
  tvm::ffi::Function init = vm_module->GetFunction("vm_initialization").value();
  if (dev.device_type == kDLCPU) {
    init(static_cast<int>(kDLCPU), 0, kPooledAllocator);
  } else {
    init(static_cast<int>(dev.device_type), dev.device_id, kPooledAllocator, static_cast<int>(kDLCPU), 0,
         kPooledAllocator);
  }
}

// `host` (a CPU tensor) on `dev`: itself on the CPU, else a device copy.
inline tvm::ffi::Tensor ToDevice(const tvm::ffi::Tensor& host, DLDevice dev) {
  if (dev.device_type == kDLCPU) return host;
  tvm::ffi::Tensor t = tvm::ffi::Function::GetGlobalRequired("runtime.TVMTensorAllocWithScope")(
                           tvm::ffi::Shape(host.shape()), host.dtype(), dev, tvm::ffi::Optional<tvm::ffi::String>())
                           .cast<tvm::ffi::Tensor>();
  tvm::ffi::Function::GetGlobalRequired("runtime.TVMTensorCopyFromTo")(host, t);
  return t;
}

// `t` on the CPU: itself there, else a host copy (which waits for the device).
inline tvm::ffi::Tensor ToHost(const tvm::ffi::Tensor& t) {
  if (t.device().device_type == kDLCPU) return t;
  std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
  tvm::ffi::Tensor host = tvm::ffi::Tensor::FromNDAlloc(CPUAlloc(), tvm::ffi::ShapeView(shape.data(), shape.size()),
                                                        t.dtype(), DLDevice{kDLCPU, 0});
  tvm::ffi::Function::GetGlobalRequired("runtime.TVMTensorCopyFromTo")(t, host);
  return host;
}

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
