// Load a tvmfuse export (model.so) with the TVM C++ runtime, run its Relax VM `main`, print outputs.
//
//   run_model MODEL.so [--device cpu|cuda] [--weights DIR] INPUT.bin DIMS [INPUT.bin DIMS ...]
//
// --device: where the export runs, its manifest's target (cpu, the default, for llvm; cuda): the inputs are copied
// there and the outputs back.
// --weights DIR: an export whose weights are outside the library (manifest "weights": "tvm-tensor-cache"; DIR is
// its weights/ folder): the TVM runtime's tensor cache loads them (vm.builtin.tensor_cache.load) and they are
// passed to `main` after the inputs, in the order param_0, param_1, ... (check their sha256 against the
// manifest before trusting them: tvmfuse.load does).
//
// Each input is a raw little-endian float32 file; DIMS is its shape, e.g. 4,32 (the manifest's "inputs"
// list gives names, order, shapes and dtypes; this runner feeds float32: exports built without --io-dtype).
// For each output it prints:   output I shape [D0, D1] dtype float32
//                              first v0 v1 ... (up to 8 values)
//                              sum S abs_sum A
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>

#include "runtime_helpers.h"

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

using tvmfuse_example::CPUAlloc;
using tvmfuse_example::LoadDeviceRuntime;
using tvmfuse_example::LoadWeights;
using tvmfuse_example::ParseDevice;
using tvmfuse_example::StartVM;
using tvmfuse_example::ToDevice;
using tvmfuse_example::ToHost;

std::vector<int64_t> ParseDims(const std::string& text) {
  std::vector<int64_t> dims;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    int64_t d = std::stoll(item);
    if (d <= 0) throw std::runtime_error("dims must be positive: " + text);
    dims.push_back(d);
  }
  if (dims.empty()) throw std::runtime_error("no dims in " + text);
  return dims;
}

tvm::ffi::Tensor ReadInput(const std::string& path, const std::vector<int64_t>& dims, DLDevice dev) {
  int64_t count = 1;
  for (int64_t d : dims) count *= d;
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw std::runtime_error("cannot open " + path);
  std::streamsize size = f.tellg();
  if (size != static_cast<std::streamsize>(count * sizeof(float))) {
    throw std::runtime_error(path + ": " + std::to_string(size) + " bytes, the shape needs " +
                             std::to_string(count * sizeof(float)) + " (float32)");
  }
  tvm::ffi::Tensor tensor = tvm::ffi::Tensor::FromNDAlloc(
      CPUAlloc(), tvm::ffi::ShapeView(dims.data(), dims.size()), DLDataType{kDLFloat, 32, 1}, DLDevice{kDLCPU, 0});
  f.seekg(0);
  f.read(static_cast<char*>(tensor.data_ptr()), size);  // little-endian float32, as the file is
  return ToDevice(tensor, dev);
}

void PrintTensor(int index, const tvm::ffi::Tensor& device_tensor) {
  tvm::ffi::Tensor t = ToHost(device_tensor);
  DLDataType dt = t.dtype();
  if (dt.code != kDLFloat || dt.bits != 32 || dt.lanes != 1) {
    throw std::runtime_error("output " + std::to_string(index) + " is not float32");
  }
  int64_t count = 1;
  std::cout << "output " << index << " shape [";
  for (int i = 0; i < t.ndim(); ++i) {
    std::cout << (i ? ", " : "") << t.shape()[i];
    count *= t.shape()[i];
  }
  std::cout << "] dtype float32\n";
  if (t.device().device_type != kDLCPU || !t.IsContiguous()) {
    throw std::runtime_error("output " + std::to_string(index) + " is not a contiguous CPU tensor");
  }
  std::vector<float> data(count);
  std::memcpy(data.data(), static_cast<const char*>(t.data_ptr()) + t.byte_offset(), count * sizeof(float));
  double sum = 0, abs_sum = 0;
  for (float v : data) {
    sum += v;
    abs_sum += v < 0 ? -v : v;
  }
  char buf[64];
  std::cout << "first";
  for (int64_t i = 0; i < count && i < 8; ++i) {
    std::snprintf(buf, sizeof(buf), " %.9g", data[i]);
    std::cout << buf;
  }
  std::snprintf(buf, sizeof(buf), "\nsum %.9g abs_sum %.9g\n", sum, abs_sum);
  std::cout << buf;
}

}  // namespace

int main(int argc, char** argv) {
  int first = 2;  // the first input argument, after the options
  std::string weights_dir, device = "cpu";
  while (first + 1 < argc && (std::string(argv[first]) == "--weights" || std::string(argv[first]) == "--device")) {
    (std::string(argv[first]) == "--weights" ? weights_dir : device) = argv[first + 1];
    first += 2;
  }
  if (argc < 2 || (argc - first) % 2 != 0) {
    std::cerr << "usage: " << argv[0] << " MODEL.so [--device cpu|cuda] [--weights DIR] [INPUT.bin DIMS]...   "
              << "(DIMS like 4,32; float32 files)\n";
    return 2;
  }
  try {
    DLDevice dev = ParseDevice(device);
    LoadDeviceRuntime(dev);
    tvm::ffi::Module lib = tvm::ffi::Module::LoadFromFile(argv[1]);
    // The Relax VM: the executable inside the library, started on the device, then `main`.
    tvm::ffi::Module vm = lib->GetFunction("vm_load_executable").value()().cast<tvm::ffi::Module>();
    StartVM(vm, dev);
    std::vector<tvm::ffi::Any> inputs;
    for (int i = first; i + 1 < argc; i += 2) inputs.emplace_back(ReadInput(argv[i], ParseDims(argv[i + 1]), dev));
    if (!weights_dir.empty()) {
      for (const tvm::ffi::Tensor& w : LoadWeights(weights_dir, dev)) inputs.emplace_back(w);
    }
    std::vector<tvm::ffi::AnyView> args(inputs.begin(), inputs.end());
    tvm::ffi::Any result;
    vm->GetFunction("main").value().CallPacked(args.data(), static_cast<int>(args.size()), &result);
    if (auto tensor = result.as<tvm::ffi::Tensor>()) {
      PrintTensor(0, *tensor);
    } else {
      auto outputs = result.cast<tvm::ffi::Array<tvm::ffi::Tensor>>();
      for (size_t i = 0; i < outputs.size(); ++i) PrintTensor(static_cast<int>(i), outputs[i]);
    }
  } catch (const std::invalid_argument& err) {  // a bad option value
    std::cerr << "error: " << err.what() << "\n";
    return 2;
  } catch (const std::exception& err) {
    std::cerr << "error: " << err.what() << "\n";
    return 1;
  }
  return 0;
}
