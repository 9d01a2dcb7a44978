// attnserve::int8_linear's CPU kernel in C++: a compiled decode step calls it through the dispatcher
// without entering Python, so it never waits for the GIL held by the replica's event loop.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <mutex>
#include <unordered_map>

namespace {

struct Packed {
  c10::IValue params;  // quantized::LinearPackedParamsBase (fbgemm)
  bool reduce_range;
};

std::mutex table_mutex;
std::unordered_map<int64_t, Packed> table;  // handle -> packed int8 weights

void set_packed(int64_t handle, c10::IValue params, bool reduce_range) {
  std::lock_guard<std::mutex> lock(table_mutex);
  table[handle] = Packed{std::move(params), reduce_range};
}

void drop_packed(int64_t handle) {
  std::lock_guard<std::mutex> lock(table_mutex);
  table.erase(handle);
}

at::Tensor int8_linear(const at::Tensor& x, c10::SymInt handle, int64_t out_features) {
  Packed packed;
  {
    std::lock_guard<std::mutex> lock(table_mutex);
    auto it = table.find(handle.expect_int());
    TORCH_CHECK(it != table.end(), "attnserve::int8_linear: no int8 weights under handle ", handle);
    packed = it->second;
  }
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("quantized::linear_dynamic", "");
  torch::jit::Stack stack{x, packed.params, packed.reduce_range};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

TORCH_LIBRARY(attnserve_native, m) {
  m.def("set_packed(int handle, Any params, bool reduce_range) -> ()", set_packed);
  m.def("drop_packed(int handle) -> ()", drop_packed);
}

TORCH_LIBRARY_IMPL(attnserve, CPU, m) {
  m.impl("int8_linear", int8_linear);
}
