// nanoserve::gguf_linear: x @ W.T + bias for a GGUF 4-bit W at any row count, choosing the
// kernel by x's rows as worker/linear/base.py's Linear does: at most max_rows rows take q4_linear;
// more take w4a8_linear where W has its 8-bit-activation form, else oneDNN's bfloat16 matmul
// on its pre-packed matrix (mkldnn::_linear_pointwise).
//
// Why one operator: a compiled decode graph (worker/compiled/decode.py) saw that choice as a Python
// branch on its batch size, so dynamo guarded on it and traced a graph for each side: three
// graphs (batch 1; 2 to max_rows; above it), each seconds of tracing on every start. Made here
// at run time, batches 2 to 32 share one graph.
//
// Shapes: x (M, K) bfloat16; q4, scale, low pack_q4's; w4a8 pack_w4a8's or undefined; onednn
// the packed (N, K) matrix or undefined (one of the two is given); bias (N,) or undefined
// -> out (M, out_features) bfloat16.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <vector>

namespace {

// The other operators, looked up once: w4a8_linear exists only in builds with AVX512-VNNI.
c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// Boxed: oneDNN's operator takes a list of optional scalars, simplest passed as IValues.
at::Tensor call(const c10::OperatorHandle& handle, std::vector<c10::IValue> stack) {
  handle.callBoxed(&stack);
  return stack[0].toTensor();
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& q4, const at::Tensor& scale,
                       const at::Tensor& low, const std::optional<at::Tensor>& w4a8,
                       const std::optional<at::Tensor>& onednn,
                       const std::optional<at::Tensor>& bias, int64_t max_rows,
                       int64_t out_features) {
  TORCH_CHECK(x.dim() == 2, "gguf_linear: x must be (M, K)");
  TORCH_CHECK(w4a8.has_value() || onednn.has_value(),
              "gguf_linear: rows above max_rows need w4a8 or onednn");
  const int64_t rows = x.size(0);
  if (rows > max_rows && !w4a8.has_value()) {
    static const c10::OperatorHandle pointwise = op("mkldnn::_linear_pointwise");
    c10::IValue no_bias = bias.has_value() ? c10::IValue(*bias) : c10::IValue();
    return call(pointwise, {x, *onednn, no_bias, std::string("none"),
                            c10::List<std::optional<at::Scalar>>(), std::string("")});
  }
  // Unboxed: these run 120 times a decode step of the default model.
  using Kernel = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&);
  at::Tensor out;
  if (rows > max_rows) {
    static const auto big = op("nanoserve::w4a8_linear").typed<Kernel>();
    out = big.call(x.contiguous(), *w4a8, scale, low);
  } else {
    static const auto small = op("nanoserve::q4_linear").typed<Kernel>();
    out = small.call(x.contiguous(), q4, scale, low);
  }
  if (out.size(1) != out_features) {  // rows of W padded to a multiple of 16
    out = out.narrow(1, 0, out_features).contiguous();
  }
  return bias.has_value() ? out.add_(*bias) : out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoserve, lib) {
  lib.def(
      "gguf_linear(Tensor x, Tensor q4, Tensor scale, Tensor low, Tensor? w4a8, Tensor? onednn, "
      "Tensor? bias, int max_rows, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoserve, CPU, lib) { lib.impl("gguf_linear", &gguf_linear); }

// oneDNN's packed matrix is an MkldnnCPU tensor, and the dispatcher picks that key when it is
// an argument.
TORCH_LIBRARY_IMPL(nanoserve, MkldnnCPU, lib) { lib.impl("gguf_linear", &gguf_linear); }
