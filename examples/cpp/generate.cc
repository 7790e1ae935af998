// Greedy generation on a tvmfuse decoder step built with the in-place KV cache (docs/kv_cache.md), with the TVM
// C++ runtime alone: allocate the caches once, prefill the prompt at past_len 0, then one token a step.
//
//   generate MODEL.so --caches N --capacity C --kv-heads H --head-dim D --ids 1,2,3 --new-tokens T
//
// N, C, H, D come from the manifest's "kv_cache" (its "caches" list, "capacity", each cache's "kv_heads" and
// "head_dim"); float32 caches (the manifest's kv_cache "dtype"), batch 1, embedded weights. The step is
// main(input_ids [1, S] int64, attention_mask [1, past_len + S] int64, past_len: Shape, cache_0, ..., cache_N-1)
// -> logits [1, S, vocab]; each cache is [C, 1, H, D] and is written in place. The next token is the export's
// greedy_tokens(logits, position) -> ids [1, 1] int64 (an argmax kernel: on a GPU only the id is copied to the
// host), or, for an export built before it had one, the host's argmax. Prints: tokens t0 t1 ...
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>

#include "host_alloc.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

using tvmfuse_example::CPUAlloc;
using tvmfuse_example::kPooledAllocator;

tvm::ffi::Tensor Empty(const std::vector<int64_t>& shape, DLDataType dtype, DLDevice dev) {
  tvm::ffi::Tensor t = tvm::ffi::Tensor::FromNDAlloc(CPUAlloc(), tvm::ffi::ShapeView(shape.data(), shape.size()),
                                                     dtype, dev);
  std::memset(t.data_ptr(), 0, tvm::ffi::GetDataSize(t));
  return t;
}

tvm::ffi::Tensor Int64s(const std::vector<int64_t>& values, int64_t rows, DLDevice dev) {
  tvm::ffi::Tensor t = Empty({rows, static_cast<int64_t>(values.size()) / rows}, DLDataType{kDLInt, 64, 1}, dev);
  std::memcpy(t.data_ptr(), values.data(), values.size() * sizeof(int64_t));
  return t;
}

// The last position's argmax of logits [1, S, V] (float32, CPU).
int64_t LastArgmax(const tvm::ffi::Tensor& logits) {
  int64_t seq = logits.shape()[1], vocab = logits.shape()[2];
  const float* row = static_cast<const float*>(logits.data_ptr()) + (seq - 1) * vocab;
  int64_t best = 0;
  for (int64_t v = 1; v < vocab; ++v) best = row[v] > row[best] ? v : best;
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  std::map<std::string, std::string> opt;
  for (int i = 2; i + 1 < argc; i += 2) opt[argv[i]] = argv[i + 1];
  for (const char* key : {"--caches", "--capacity", "--kv-heads", "--head-dim", "--ids", "--new-tokens"}) {
    if (argc < 2 || !opt.count(key)) {
      std::cerr << "usage: " << argv[0] << " MODEL.so --caches N --capacity C --kv-heads H --head-dim D "
                << "--ids 1,2,3 --new-tokens T\n";
      return 2;
    }
  }
  try {
    int64_t caches = std::stoll(opt["--caches"]), capacity = std::stoll(opt["--capacity"]);
    int64_t heads = std::stoll(opt["--kv-heads"]), dim = std::stoll(opt["--head-dim"]);
    int64_t new_tokens = std::stoll(opt["--new-tokens"]);
    std::vector<int64_t> prompt;
    std::stringstream ss(opt["--ids"]);
    for (std::string item; std::getline(ss, item, ',');) prompt.push_back(std::stoll(item));
    if (prompt.empty() || new_tokens < 1 || static_cast<int64_t>(prompt.size()) + new_tokens - 1 > capacity) {
      std::cerr << "error: the prompt and new tokens need " << prompt.size() + new_tokens - 1
                << " positions; the cache holds " << capacity << "\n";
      return 2;
    }
    DLDevice dev{kDLCPU, 0};
    tvm::ffi::Module lib = tvm::ffi::Module::LoadFromFile(argv[1]);
    tvm::ffi::Module vm = lib->GetFunction("vm_load_executable").value()().cast<tvm::ffi::Module>();
    vm->GetFunction("vm_initialization").value()(static_cast<int>(dev.device_type), dev.device_id,
                                                   kPooledAllocator);
    tvm::ffi::Function step = vm->GetFunction("main").value();
    tvm::ffi::Optional<tvm::ffi::Function> greedy = vm->GetFunction("greedy_tokens");
    std::cerr << "sampler: " << (greedy.has_value() ? "greedy_tokens (the export's)" : "the host's argmax") << "\n";
    std::vector<tvm::ffi::Tensor> cache;  // created once: zeros, [capacity, batch 1, kv heads, head dim]
    for (int64_t i = 0; i < caches; ++i) cache.push_back(Empty({capacity, 1, heads, dim}, {kDLFloat, 32, 1}, dev));

    auto run = [&](const std::vector<int64_t>& ids, int64_t past) {
      std::vector<tvm::ffi::Any> args{Int64s(ids, 1, dev),
                                      Int64s(std::vector<int64_t>(past + ids.size(), 1), 1, dev),
                                      tvm::ffi::Shape({past})};
      for (const tvm::ffi::Tensor& c : cache) args.emplace_back(c);
      std::vector<tvm::ffi::AnyView> views(args.begin(), args.end());
      tvm::ffi::Any out;
      step.CallPacked(views.data(), static_cast<int>(views.size()), &out);
      tvm::ffi::Tensor logits = out.cast<tvm::ffi::Tensor>();
      if (!greedy.has_value()) return LastArgmax(logits);
      int64_t last = static_cast<int64_t>(ids.size()) - 1;
      tvm::ffi::Tensor next = greedy.value()(logits, last).cast<tvm::ffi::Tensor>();  // [1, 1] int64, on dev
      return static_cast<const int64_t*>(next.data_ptr())[0];
    };
    std::vector<int64_t> tokens{run(prompt, 0)};  // prefill: the whole prompt at past_len 0 fills the caches
    for (int64_t i = 1; i < new_tokens; ++i) {
      tokens.push_back(run({tokens.back()}, static_cast<int64_t>(prompt.size()) + i - 1));
    }
    std::cout << "tokens";
    for (int64_t t : tokens) std::cout << " " << t;
    std::cout << "\n";
  } catch (const std::exception& err) {
    std::cerr << "error: " << err.what() << "\n";
    return 1;
  }
  return 0;
}
