// x @ W^T (+ b) for a Linear loaded from GGUF: its codes for a step of at most max_rows rows, its
// dequantized bfloat16 weight past them (model/layers/quant.py says where each kernel wins).
//
// The choice by rows is made here, in one op, and not in Python: a step trace
// (worker/step_traces.py) records this op once and, replayed at any size, still multiplies the
// right weight, so a model's row bounds do not multiply the kinds of steps that each need a
// trace of their own. vLLM's GGUF layers choose the same way, inside one custom op.
//
// codes_kind names the codes' kernel: "q4_1_tiles" (minivllm's q4_1_linear; codes is its
// layout), "q8_0" (q8_0_linear, float32 out; scales the float16 scales) or "int4" (torch's int4
// kernel; scales its scales and zeros). The dense weight is what model/layers/linear.py's
// `linear` takes: oneDNN-packed, minivllm's panels, or plain. Each branch makes exactly the calls
// the Python layer made before, so the results are those of either path bit for bit.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

constexpr int64_t kInt4Group = 32;

c10::OperatorHandle minivllm_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

at::Tensor dense(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  if (weight.is_mkldnn()) {
    static const auto op = minivllm_op("minivllm_cpu::packed_linear")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
    return op.call(x, weight, bias);
  }
  if (weight.dim() == 3) {
    static const auto op = minivllm_op("minivllm_cpu::bf16_gemm")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>();
    return op.call(x, weight, bias);
  }
  return at::linear(x, weight, bias);
}

at::Tensor codes_product(const at::Tensor& x, c10::string_view codes_kind, const at::Tensor& codes,
                 const std::optional<at::Tensor>& scales) {
  if (codes_kind == "q4_1_tiles") {
    static const auto op = minivllm_op("minivllm_cpu::q4_1_linear")
        .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
    return op.call(x.stride(-1) == 1 ? x : x.contiguous(), codes);
  }
  TORCH_CHECK(scales.has_value(), "gguf_linear: ", codes_kind, " codes need their scales");
  if (codes_kind == "q8_0") {
    static const auto op = minivllm_op("minivllm_cpu::q8_0_linear")
        .typed<void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
    at::Tensor out = at::empty({x.size(0), codes.size(0)}, x.options().dtype(at::kFloat));
    op.call(out, x, codes, *scales);
    return out.to(x.scalar_type());
  }
  TORCH_CHECK(codes_kind == "int4", "gguf_linear: unknown codes kind ", codes_kind);
  return at::_weight_int4pack_mm_for_cpu(x, codes, kInt4Group, *scales);
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                       int64_t max_rows, c10::string_view codes_kind, const at::Tensor& codes,
                       const std::optional<at::Tensor>& scales) {
  TORCH_CHECK(x.dim() == 2, "gguf_linear: x must be [M, K], got ", x.sizes());
  if (x.size(0) > max_rows) return dense(x, weight, bias);
  at::Tensor out = codes_product(x, codes_kind, codes, scales);
  return bias.has_value() ? out + *bias : out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(minivllm_cpu, m) {
  m.def("gguf_linear(Tensor x, Tensor weight, Tensor? bias, int max_rows, str codes_kind, Tensor codes, "
        "Tensor? scales) -> Tensor");
  // A oneDNN-packed weight makes the call dispatch on MkldnnCPU; the others on CPU.
  m.impl("gguf_linear", c10::DispatchKey::CPU, &gguf_linear);
  m.impl("gguf_linear", c10::DispatchKey::MkldnnCPU, &gguf_linear);
}
