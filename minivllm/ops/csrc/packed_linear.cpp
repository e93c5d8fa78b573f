// oneDNN's linear on a weight pre-packed by mkldnn::_reorder_linear_weight (model/layers/linear.py),
// behind a schema a TorchScript trace can record: mkldnn::_linear_pointwise itself takes a
// Scalar?[] argument, which the tracer rejects, so decode steps through packed layers could not be
// replayed from a trace (worker/decode_graph.py). Same op, same results.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, weight, bias, std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          std::optional<std::string>(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  // The packed weight is an MKLDNN tensor, so that is the key the call dispatches on.
  m.impl("packed_linear", c10::DispatchKey::MkldnnCPU, &packed_linear);
}
