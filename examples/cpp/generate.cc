// Greedy generation on a tvmfuse decoder step built with the in-place KV cache (docs/kv_cache.md), with the TVM
// C++ runtime alone: allocate the caches once, prefill the prompt at past_len 0, then one token a step, the
// tokens read on the host 16 steps at a time.
//
//   generate MODEL.so --caches N --capacity C --kv-heads H --head-dim D --ids 1,2,3 --new-tokens T
//            [--dtype float32|float16|bfloat16] [--batch B] [--weights DIR] [--device cpu|cuda]
//
// N, C, H, D and --dtype come from the manifest's "kv_cache" (its "caches" list, "capacity", each cache's
// "kv_heads" and "head_dim", and "dtype": the caches' dtype, float32 by default); --batch runs B rows of the same
// prompt; --weights DIR is the export's weights/ folder where the manifest's "weights" are a "tvm-tensor-cache"
// (they follow the caches in `main`'s arguments); --device: where the export runs, its manifest's target (cpu, the
// default, for llvm; cuda). The step is
// main(input_ids [B, S] int64, attention_mask [B, past_len + S] int64, past_len: Shape, cache_0, ..., cache_N-1,
// weights...) -> logits [B, S, vocab]; each cache is [C, B, H, D] and is written in place. The next tokens are the
// export's greedy_tokens(logits, position) -> ids [B, 1] int64 (an argmax kernel; its output is the next step's
// input_ids as it is), or, for an export built before it had one, the host's argmax of float32 logits.
// Prints a line per row: tokens t0 t1 ...
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>

#include "runtime_helpers.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <sstream>
#include <stdexcept>
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

// Zeros of `shape` and `dtype` on the host.
tvm::ffi::Tensor HostZeros(const std::vector<int64_t>& shape, DLDataType dtype) {
  tvm::ffi::Tensor t = tvm::ffi::Tensor::FromNDAlloc(CPUAlloc(), tvm::ffi::ShapeView(shape.data(), shape.size()),
                                                     dtype, DLDevice{kDLCPU, 0});
  std::memset(t.data_ptr(), 0, tvm::ffi::GetDataSize(t));  // zeros, in every float dtype too
  return t;
}

// [rows, values.size()] int64 on `dev`: `values` in every row.
tvm::ffi::Tensor Rows(const std::vector<int64_t>& values, int64_t rows, DLDevice dev) {
  int64_t width = static_cast<int64_t>(values.size());
  tvm::ffi::Tensor t = HostZeros({rows, width}, DLDataType{kDLInt, 64, 1});
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(static_cast<int64_t*>(t.data_ptr()) + r * width, values.data(), width * sizeof(int64_t));
  }
  return ToDevice(t, dev);
}

DLDataType CacheDtype(const std::string& name) {
  if (name == "float32") return DLDataType{kDLFloat, 32, 1};
  if (name == "float16") return DLDataType{kDLFloat, 16, 1};
  if (name == "bfloat16") return DLDataType{kDLBfloat, 16, 1};
  throw std::invalid_argument("--dtype " + name + ": float32, float16 or bfloat16 (the manifest's kv_cache dtype)");
}

// Each row's argmax at position `at` of logits [B, S, V] (float32), on the host, as [B, 1] int64 on `dev`.
tvm::ffi::Tensor HostArgmax(const tvm::ffi::Tensor& device_logits, int64_t at, DLDevice dev) {
  tvm::ffi::Tensor logits = ToHost(device_logits);
  DLDataType dt = logits.dtype();
  if (dt.code != kDLFloat || dt.bits != 32) throw std::runtime_error("the logits are not float32 (and no sampler)");
  int64_t batch = logits.shape()[0], seq = logits.shape()[1], vocab = logits.shape()[2];
  tvm::ffi::Tensor next = HostZeros({batch, 1}, DLDataType{kDLInt, 64, 1});
  for (int64_t b = 0; b < batch; ++b) {
    const float* row = static_cast<const float*>(logits.data_ptr()) + (b * seq + at) * vocab;
    int64_t best = 0;
    for (int64_t v = 1; v < vocab; ++v) best = row[v] > row[best] ? v : best;
    static_cast<int64_t*>(next.data_ptr())[b] = best;
  }
  return ToDevice(next, dev);
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> opt{{"--dtype", "float32"}, {"--batch", "1"}, {"--device", "cpu"}};
  for (int i = 2; i + 1 < argc; i += 2) opt[argv[i]] = argv[i + 1];
  for (const char* key : {"--caches", "--capacity", "--kv-heads", "--head-dim", "--ids", "--new-tokens"}) {
    if (argc < 2 || !opt.count(key)) {
      std::cerr << "usage: " << argv[0] << " MODEL.so --caches N --capacity C --kv-heads H --head-dim D "
                << "--ids 1,2,3 --new-tokens T [--dtype float32|float16|bfloat16] [--batch B] [--weights DIR] "
                << "[--device cpu|cuda]\n";
      return 2;
    }
  }
  try {
    int64_t caches = std::stoll(opt["--caches"]), capacity = std::stoll(opt["--capacity"]);
    int64_t heads = std::stoll(opt["--kv-heads"]), dim = std::stoll(opt["--head-dim"]);
    int64_t new_tokens = std::stoll(opt["--new-tokens"]), batch = std::stoll(opt["--batch"]);
    DLDataType dtype = CacheDtype(opt["--dtype"]);
    std::vector<int64_t> prompt;
    std::stringstream ss(opt["--ids"]);
    for (std::string item; std::getline(ss, item, ',');) prompt.push_back(std::stoll(item));
    int64_t length = static_cast<int64_t>(prompt.size());
    if (prompt.empty() || new_tokens < 1 || batch < 1 || length + new_tokens - 1 > capacity) {
      std::cerr << "error: the prompt and new tokens need " << length + new_tokens - 1
                << " positions; the cache holds " << capacity << " (and --batch, --new-tokens must be >= 1)\n";
      return 2;
    }
    DLDevice dev = ParseDevice(opt["--device"]);
    LoadDeviceRuntime(dev);
    tvm::ffi::Module lib = tvm::ffi::Module::LoadFromFile(argv[1]);
    tvm::ffi::Module vm = lib->GetFunction("vm_load_executable").value()().cast<tvm::ffi::Module>();
    StartVM(vm, dev);
    tvm::ffi::Function step = vm->GetFunction("main").value();
    tvm::ffi::Optional<tvm::ffi::Function> greedy = vm->GetFunction("greedy_tokens");
    std::cerr << "sampler: " << (greedy.has_value() ? "greedy_tokens (the export's)" : "the host's argmax") << "\n";
    std::vector<tvm::ffi::Tensor> cache;  // created once: zeros, [capacity, batch, kv heads, head dim]
    for (int64_t i = 0; i < caches; ++i) {
      cache.push_back(ToDevice(HostZeros({capacity, batch, heads, dim}, dtype), dev));
    }
    std::vector<tvm::ffi::Tensor> weights;
    if (opt.count("--weights")) weights = LoadWeights(opt["--weights"], dev);

    // One step on ids [batch, seq] at `past`; returns the next ids [batch, 1] (the argmax of the last position).
    auto run = [&](const tvm::ffi::Tensor& ids, int64_t past) {
      int64_t seq = ids.shape()[1];
      std::vector<tvm::ffi::Any> args{ids, Rows(std::vector<int64_t>(past + seq, 1), batch, dev),
                                      tvm::ffi::Shape({past})};
      for (const tvm::ffi::Tensor& c : cache) args.emplace_back(c);
      for (const tvm::ffi::Tensor& w : weights) args.emplace_back(w);
      std::vector<tvm::ffi::AnyView> views(args.begin(), args.end());
      tvm::ffi::Any out;
      step.CallPacked(views.data(), static_cast<int>(views.size()), &out);
      tvm::ffi::Tensor logits = out.cast<tvm::ffi::Tensor>();
      if (!greedy.has_value()) return HostArgmax(logits, seq - 1, dev);
      return greedy.value()(logits, seq - 1).cast<tvm::ffi::Tensor>();
    };
    // Each step's ids are copied on the device into a slot of a window buffer [window, batch], and the host reads
    // a window in one copy: a copy to the host waits for everything queued before it, so one a step would keep the
    // GPU waiting for the host every step (tvmfuse's Python generate also reads a window only once the next one is
    // queued).
    const int64_t window = std::min<int64_t>(16, new_tokens);
    tvm::ffi::Function copy = tvm::ffi::Function::GetGlobalRequired("runtime.TVMTensorCopyFromTo");
    tvm::ffi::Function view = tvm::ffi::Function::GetGlobalRequired("runtime.TVMTensorCreateView");
    tvm::ffi::Tensor slots = ToDevice(HostZeros({window, batch}, DLDataType{kDLInt, 64, 1}), dev);
    auto rows_of = [&](int64_t first, int64_t count) {  // slots first .. first + count - 1, a view (no copy)
      return view(slots, tvm::ffi::Shape({count, batch}), DLDataType{kDLInt, 64, 1},
                  static_cast<uint64_t>(first * batch * sizeof(int64_t))).cast<tvm::ffi::Tensor>();
    };
    std::vector<std::vector<int64_t>> tokens(batch);
    tvm::ffi::Tensor next = run(Rows(prompt, batch, dev), 0);  // prefill: the prompt at past_len 0 fills the caches
    for (int64_t i = 0; i < new_tokens; ++i) {
      int64_t at = i % window;
      copy(next, rows_of(at, 1));  // the step's ids [batch, 1] into its slot, on the device
      if (at == window - 1 || i + 1 == new_tokens) {  // the window's ids, read on the host (waits for the device)
        tvm::ffi::Tensor ids = ToHost(rows_of(0, at + 1));
        for (int64_t s = 0; s <= at; ++s) {
          for (int64_t b = 0; b < batch; ++b) {
            tokens[b].push_back(static_cast<const int64_t*>(ids.data_ptr())[s * batch + b]);
          }
        }
      }
      if (i + 1 < new_tokens) next = run(next, length + i);  // the ids [batch, 1] as the step returned them
    }
    for (const std::vector<int64_t>& row : tokens) {
      std::cout << "tokens";
      for (int64_t t : row) std::cout << " " << t;
      std::cout << "\n";
    }
  } catch (const std::invalid_argument& err) {  // a bad option value (std::stoll's too)
    std::cerr << "error: " << err.what() << "\n";
    return 2;
  } catch (const std::exception& err) {
    std::cerr << "error: " << err.what() << "\n";
    return 1;
  }
  return 0;
}
