// Thin torch binding for fa_v100.cu. Argument checking with clear messages lives in diffusers_h3/kernels/fa_v100.py;
// this file repeats only the checks that keep the kernel from reading out of bounds.

#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

extern "C" {
int fa_v100_smem_bytes(int head_dim, int query_tile);
int fa_v100_forward(const void* q, const void* k, const void* v, void* o, int batch, int heads, int seq_q, int seq_k,
                    int head_dim, const int64_t* strides, float softmax_scale, int query_tile, void* stream);
const char* fa_v100_error_string(int code);
}

namespace {

void check_operand(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "fa_v100: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == torch::kHalf, "fa_v100: ", name, " must be float16");
  TORCH_CHECK(t.dim() == 4, "fa_v100: ", name, " must be (batch, seq, heads, head_dim)");
  TORCH_CHECK(t.stride(3) == 1, "fa_v100: ", name, " must have a contiguous head_dim");
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK(t.stride(d) % 8 == 0, "fa_v100: ", name, " strides must be multiples of 8 elements");
  }
  TORCH_CHECK(reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0, "fa_v100: ", name, " must be 16-byte aligned");
}

torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, torch::Tensor out,
                      double softmax_scale, int64_t query_tile) {
  check_operand(q, "query");
  check_operand(k, "key");
  check_operand(v, "value");
  check_operand(out, "out");
  TORCH_CHECK(k.sizes() == v.sizes(), "fa_v100: key and value shapes differ");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(3) == k.size(3),
              "fa_v100: query and key disagree on batch, heads or head_dim");
  TORCH_CHECK(out.sizes() == q.sizes(), "fa_v100: out must have the query's shape");
  TORCH_CHECK(q.get_device() == k.get_device() && q.get_device() == v.get_device() &&
                  q.get_device() == out.get_device(),
              "fa_v100: all tensors must be on one device");

  const int64_t strides[12] = {q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                               v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2)};
  const c10::cuda::CUDAGuard guard(q.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int err = fa_v100_forward(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), static_cast<int>(q.size(0)),
                                  static_cast<int>(q.size(2)), static_cast<int>(q.size(1)), static_cast<int>(k.size(1)),
                                  static_cast<int>(q.size(3)), strides, static_cast<float>(softmax_scale),
                                  static_cast<int>(query_tile), static_cast<void*>(stream));
  TORCH_CHECK(err == 0, "fa_v100: kernel launch failed: ", fa_v100_error_string(err));
  return out;
}

int64_t smem_bytes(int64_t head_dim, int64_t query_tile) {
  return fa_v100_smem_bytes(static_cast<int>(head_dim), static_cast<int>(query_tile));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "FA-V100 attention forward (fp16, BSHD, non-causal)");
  m.def("smem_bytes", &smem_bytes, "Dynamic shared memory per block of a (head_dim, query_tile) variant");
}
