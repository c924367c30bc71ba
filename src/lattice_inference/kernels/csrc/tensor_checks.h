// What every entry point of the native ops checks before it touches memory: a defined CPU tensor, laid out
// contiguously, of the rank and dtype the kernel indexes. A wrong tensor (a CUDA one, a view, a float16 one)
// becomes one clear Python error naming the op and the argument, never a crash or a silent misread. Also the
// output the linear ops allocate for the inputs they have checked.
#pragma once
#include <torch/extension.h>
#include <vector>

inline void check_cpu(const torch::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

inline void check_tensor(const torch::Tensor& t, const char* op, const char* name, int64_t dim,
                         c10::ScalarType dtype) {
  check_cpu(t, op, name);
  TORCH_CHECK(t.dim() == dim, op, ": ", name, " must be ", dim, "-d, got ", t.dim(), "-d");
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
}

// A 1-d weight of ``n`` values in ``dtype`` (a norm's), where given.
inline void check_vector(const c10::optional<torch::Tensor>& t, const char* op, const char* name, int64_t n,
                         c10::ScalarType dtype) {
  if (!t.has_value()) return;
  check_tensor(*t, op, name, 1, dtype);
  TORCH_CHECK(t->size(0) == n, op, ": ", name, " has ", t->size(0), " values, ", n, " expected");
}

// The uninitialised output of a linear op over ``x [..., in]`` with ``out`` outputs: ``[..., out]``, ``x``'s dtype.
inline torch::Tensor linear_output(const torch::Tensor& x, int64_t out) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  return torch::empty(shape, x.options());
}
