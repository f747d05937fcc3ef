// FA-V100: a FlashAttention-2-style forward for SM70-class GPUs (Volta and newer), written with WMMA.
//
// Numerics contract (the torch reference in diffusers_h3/kernels/fa_v100.py states the same):
//   * Q, K, V are fp16 in (batch, seq, heads, head_dim) layout with arbitrary batch / seq / head strides
//     (multiples of 8 elements, 16-byte aligned base) and a contiguous head_dim of 64 or 128.
//   * S = Q K^T runs on fp16 tensor cores with fp32 accumulation; the softmax is computed in fp32 with an online
//     (running max / running sum) rescaling over key tiles of 64.
//   * P is rounded to fp16 for the P V product (fp16 tensor cores, fp32 accumulation); the row sum uses the same
//     rounded P, so rows are normalised exactly by what was accumulated.
//   * O is divided by the row sum in fp32 and stored as fp16. Non-causal, no mask, no dropout.
//
// Tensor cores are reached through nvcuda::wmma 16x16x16 (fp16 x fp16 -> fp32), which is valid on sm_70 and every
// later architecture, so the same source builds for sm_70 (CUDA <= 12.x toolkits) and for sm_75 / sm_80 / sm_90.
// Shared memory per block: (BLOCK_M + 64) * (D + 8) * 2 + BLOCK_M * 68 * 4 + BLOCK_M * 12 bytes, i.e. 88,576 B for
// the largest variant (q-tile 128, D 128), under V100's 96 KB opt-in limit.
//
// Schedule per key tile: K (staged in registers during the previous P V) goes to shared memory; V's global loads are
// issued into registers and land during Q K^T and the softmax; V goes to the same shared buffer; the next K's loads
// are issued and land during P V. V100 has no cp.async, so register staging is how loads overlap tensor-core work.
// Each warp owns 16 query rows; a block is 4 (query tile 64) or 8 (query tile 128) warps, and the tiles give
// bitwise-identical results.
//
// This file includes nothing but CUDA's own headers: the torch binding lives in fa_v100_binding.cpp, so CI can
// compile this file alone with `nvcc -c` on a machine without a GPU. Under NVRTC (`__CUDACC_RTC__`) only the device
// code is compiled: CI builds it for sm_70 with CUDA 12's NVRTC + ptxas, since CUDA 13's nvcc no longer targets sm_70.
//
// Hardware honesty: written for V100 (sm_70), tested on an H200 (sm_90); its device code is compiled for sm_70 and the
// whole file for sm_75 in CPU CI; it has not been run on V100 hardware.

#include <cuda_fp16.h>
#include <mma.h>
#ifdef __CUDACC_RTC__
// NVRTC has no C library headers.
typedef long long int64_t;
typedef unsigned long long uint64_t;
typedef int int32_t;
typedef unsigned int uint32_t;
#define INFINITY __int_as_float(0x7f800000)
#else
#include <cuda_runtime.h>
#include <stdint.h>
#endif

namespace {

using namespace nvcuda;

constexpr int kBlockN = 64;  // keys per tile
constexpr int kFrag = 16;    // WMMA m = n = k

template <int kHeadDim, int kBlockM>
struct Config {
  static constexpr int kWarps = kBlockM / kFrag;  // each warp owns 16 query rows
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kLdH = kHeadDim + 8;       // halves per row of the Q / K / V tiles (+16 B against bank conflicts)
  static constexpr int kLdS = kBlockN + 4;        // floats per row of the score tile
  static constexpr int kLdP = 2 * kLdS;           // halves per row of P, which overwrites its own row of S
  static constexpr int kQBytes = kBlockM * kLdH * 2;
  static constexpr int kKVBytes = kBlockN * kLdH * 2;  // K, then V of the same key tile
  static constexpr int kSBytes = kBlockM * kLdS * 4;
  static constexpr int kStatBytes = kBlockM * 3 * 4;   // running max, running sum, rescale factor per row
  static constexpr int kSmemBytes = kQBytes + kKVBytes + kSBytes + kStatBytes;
};

// Copy `rows` rows of kHeadDim halves from global memory into a shared tile, 16 bytes at a time; rows at or past
// `rows_valid` are zero-filled so that padding never brings NaN or Inf into the tensor-core products.
template <int kHeadDim, int kThreads>
__device__ __forceinline__ void load_tile(half* __restrict__ tile, int ld, const half* __restrict__ src,
                                          int64_t row_stride, int rows_valid, int rows, int tid) {
  constexpr int kChunks = kHeadDim / 8;
#pragma unroll 4
  for (int i = tid; i < rows * kChunks; i += kThreads) {
    const int r = i / kChunks;
    const int c = (i % kChunks) * 8;
    uint4 value = make_uint4(0u, 0u, 0u, 0u);
    if (r < rows_valid) {
      value = *reinterpret_cast<const uint4*>(src + static_cast<int64_t>(r) * row_stride + c);
    }
    *reinterpret_cast<uint4*>(tile + r * ld + c) = value;
  }
}

// Register staging of one key tile (K or V): global loads are issued early and land in registers while the warps
// compute, then go to shared memory after a barrier. V100 has no cp.async, so this is how a tile load overlaps work.
template <int kHeadDim, int kThreads>
struct TileRegs {
  static constexpr int kChunks = kHeadDim / 8;                  // 16-byte chunks per row
  static constexpr int kPerThread = kBlockN * kChunks / kThreads;
  uint4 chunk[kPerThread];

  __device__ __forceinline__ void fetch(const half* __restrict__ src, int64_t row_stride, int rows_valid, int tid) {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int idx = tid + i * kThreads;
      const int r = idx / kChunks;
      const int c = (idx % kChunks) * 8;
      chunk[i] = make_uint4(0u, 0u, 0u, 0u);
      if (r < rows_valid) chunk[i] = *reinterpret_cast<const uint4*>(src + static_cast<int64_t>(r) * row_stride + c);
    }
  }

  __device__ __forceinline__ void store(half* __restrict__ tile, int ld, int tid) const {
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int idx = tid + i * kThreads;
      *reinterpret_cast<uint4*>(tile + (idx / kChunks) * ld + (idx % kChunks) * 8) = chunk[i];
    }
  }
};

template <int kHeadDim, int kBlockM>
__global__ void __launch_bounds__(Config<kHeadDim, kBlockM>::kThreads)
    fa_v100_forward_kernel(const half* __restrict__ q, const half* __restrict__ k, const half* __restrict__ v,
                           half* __restrict__ o, int seq_q, int seq_k, int64_t q_sb, int64_t q_ss, int64_t q_sh,
                           int64_t k_sb, int64_t k_ss, int64_t k_sh, int64_t v_sb, int64_t v_ss, int64_t v_sh,
                           int64_t o_sb, int64_t o_ss, int64_t o_sh, float scale_log2) {
  using Cfg = Config<kHeadDim, kBlockM>;
  constexpr int kLdH = Cfg::kLdH;
  constexpr int kLdS = Cfg::kLdS;
  constexpr int kLdP = Cfg::kLdP;
  constexpr int kThreads = Cfg::kThreads;
  constexpr int kDFrags = kHeadDim / kFrag;  // output fragments per warp
  constexpr int kNFrags = kBlockN / kFrag;   // score fragments per warp
  constexpr int kHalfRow = kBlockN / 2;      // score columns handled by one lane (two lanes per row)

  extern __shared__ __align__(128) unsigned char smem_raw[];
  half* s_q = reinterpret_cast<half*>(smem_raw);
  half* s_kv = s_q + kBlockM * kLdH;
  float* s_s = reinterpret_cast<float*>(s_kv + kBlockN * kLdH);
  float* s_max = s_s + kBlockM * kLdS;
  float* s_sum = s_max + kBlockM;
  float* s_alpha = s_sum + kBlockM;

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int m0 = blockIdx.x * kBlockM;
  const int64_t head = blockIdx.y;
  const int64_t batch = blockIdx.z;

  const half* q_base = q + batch * q_sb + head * q_sh + static_cast<int64_t>(m0) * q_ss;
  const half* k_base = k + batch * k_sb + head * k_sh;
  const half* v_base = v + batch * v_sb + head * v_sh;
  half* o_base = o + batch * o_sb + head * o_sh + static_cast<int64_t>(m0) * o_ss;

  load_tile<kHeadDim, kThreads>(s_q, kLdH, q_base, q_ss, seq_q - m0, kBlockM, tid);
  for (int r = tid; r < kBlockM; r += kThreads) {
    s_max[r] = -INFINITY;
    s_sum[r] = 0.0f;
  }

  const int warp_row0 = warp * kFrag;
  float* s_s_warp = s_s + warp_row0 * kLdS;
  const half* s_p_warp = reinterpret_cast<const half*>(s_s_warp);
  const half* s_q_warp = s_q + warp_row0 * kLdH;

  // The element -> (row, col) mapping of a WMMA accumulator is unspecified but identical for every fragment of one
  // type, so loading a matrix whose entries are their own row index tells each lane which row it holds. Row-wise
  // rescaling of the output accumulators then happens in registers.
  for (int i = lane; i < kFrag * kFrag; i += 32) {
    s_s_warp[(i / kFrag) * kLdS + (i % kFrag)] = static_cast<float>(i / kFrag);
  }
  __syncwarp();
  wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float> row_of;
  wmma::load_matrix_sync(row_of, s_s_warp, kLdS, wmma::mem_row_major);

  wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float> acc[kDFrags];
#pragma unroll
  for (int t = 0; t < kDFrags; ++t) wmma::fill_fragment(acc[t], 0.0f);

  static_assert((kBlockN * (kHeadDim / 8)) % kThreads == 0, "a key tile must split evenly over the threads");
  TileRegs<kHeadDim, kThreads> staged;
  staged.fetch(k_base, k_ss, min(kBlockN, seq_k), tid);

  for (int n0 = 0; n0 < seq_k; n0 += kBlockN) {
    const int valid_n = min(kBlockN, seq_k - n0);

    __syncthreads();  // every warp is done with the previous V tile
    staged.store(s_kv, kLdH, tid);  // K of this tile
    __syncthreads();
    staged.fetch(v_base + static_cast<int64_t>(n0) * v_ss, v_ss, valid_n, tid);  // V lands during QK^T + softmax

    // 1. S = Q K^T for this warp's 16 rows (K^T is K read column-major).
    {
      wmma::fragment<wmma::accumulator, kFrag, kFrag, kFrag, float> s_frag[kNFrags];
#pragma unroll
      for (int j = 0; j < kNFrags; ++j) wmma::fill_fragment(s_frag[j], 0.0f);
#pragma unroll
      for (int kk = 0; kk < kDFrags; ++kk) {
        wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, half, wmma::row_major> a_frag;
        wmma::load_matrix_sync(a_frag, s_q_warp + kk * kFrag, kLdH);
#pragma unroll
        for (int j = 0; j < kNFrags; ++j) {
          wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, half, wmma::col_major> b_frag;
          wmma::load_matrix_sync(b_frag, s_kv + j * kFrag * kLdH + kk * kFrag, kLdH);
          wmma::mma_sync(s_frag[j], a_frag, b_frag, s_frag[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < kNFrags; ++j) {
        wmma::store_matrix_sync(s_s_warp + j * kFrag, s_frag[j], kLdS, wmma::mem_row_major);
      }
    }
    __syncwarp();

    // 2. Online softmax in fp32: two lanes per row, 32 columns each.
    {
      const int r = lane >> 1;
      const int c0 = (lane & 1) * kHalfRow;
      const int row = warp_row0 + r;
      const float* s_row = s_s_warp + r * kLdS + c0;
      float x[kHalfRow];
      float tile_max = -INFINITY;
#pragma unroll
      for (int i = 0; i < kHalfRow; ++i) {
        const float value = (n0 + c0 + i < seq_k) ? s_row[i] * scale_log2 : -INFINITY;
        x[i] = value;
        tile_max = fmaxf(tile_max, value);
      }
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      const float max_old = s_max[row];
      const float max_new = fmaxf(max_old, tile_max);  // finite: column n0 of every tile is a valid key
      const float alpha = exp2f(max_old - max_new);     // 0 on the first tile (max_old = -inf)
      float tile_sum = 0.0f;
      __half2 p[kHalfRow / 2];
#pragma unroll
      for (int i = 0; i < kHalfRow / 2; ++i) {
        p[i] = __floats2half2_rn(exp2f(x[2 * i] - max_new), exp2f(x[2 * i + 1] - max_new));
        const float2 rounded = __half22float2(p[i]);
        tile_sum += rounded.x + rounded.y;
      }
      tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 1);
      __syncwarp();  // both lanes of a row have read their scores before P overwrites the row
      __half2* p_row = reinterpret_cast<__half2*>(s_s_warp + r * kLdS) + c0 / 2;
#pragma unroll
      for (int i = 0; i < kHalfRow / 2; ++i) p_row[i] = p[i];
      if ((lane & 1) == 0) {
        s_max[row] = max_new;
        s_sum[row] = s_sum[row] * alpha + tile_sum;
        s_alpha[row] = alpha;
      }
    }
    __syncwarp();

    // 3. Rescale the output accumulators by each row's alpha.
#pragma unroll
    for (int t = 0; t < kDFrags; ++t) {
#pragma unroll
      for (int e = 0; e < acc[t].num_elements; ++e) {
        acc[t].x[e] *= s_alpha[warp_row0 + static_cast<int>(row_of.x[e])];
      }
    }

    __syncthreads();  // every warp is done with the K tile
    staged.store(s_kv, kLdH, tid);  // V of this tile
    __syncthreads();
    if (n0 + kBlockN < seq_k) {  // the next K lands during P V
      staged.fetch(k_base + static_cast<int64_t>(n0 + kBlockN) * k_ss, k_ss, min(kBlockN, seq_k - n0 - kBlockN), tid);
    }

    // 4. O += P V.
#pragma unroll
    for (int kk = 0; kk < kNFrags; ++kk) {
      wmma::fragment<wmma::matrix_a, kFrag, kFrag, kFrag, half, wmma::row_major> p_frag;
      wmma::load_matrix_sync(p_frag, s_p_warp + kk * kFrag, kLdP);
#pragma unroll
      for (int t = 0; t < kDFrags; ++t) {
        wmma::fragment<wmma::matrix_b, kFrag, kFrag, kFrag, half, wmma::row_major> v_frag;
        wmma::load_matrix_sync(v_frag, s_kv + kk * kFrag * kLdH + t * kFrag, kLdH);
        wmma::mma_sync(acc[t], p_frag, v_frag, acc[t]);
      }
    }
  }

  // 5. Normalise by the row sums and store fp16, 64 columns at a time through this warp's score rows.
  __syncwarp();
#pragma unroll
  for (int t = 0; t < kDFrags; ++t) {
#pragma unroll
    for (int e = 0; e < acc[t].num_elements; ++e) {
      acc[t].x[e] /= s_sum[warp_row0 + static_cast<int>(row_of.x[e])];
    }
  }
#pragma unroll
  for (int c = 0; c < kHeadDim; c += kBlockN) {
    __syncwarp();
#pragma unroll
    for (int j = 0; j < kNFrags; ++j) {
      wmma::store_matrix_sync(s_s_warp + j * kFrag, acc[c / kFrag + j], kLdS, wmma::mem_row_major);
    }
    __syncwarp();
    for (int i = lane; i < kFrag * (kBlockN / 8); i += 32) {
      const int r = i / (kBlockN / 8);
      const int g = (i % (kBlockN / 8)) * 8;
      if (m0 + warp_row0 + r < seq_q) {
        const float* src = s_s_warp + r * kLdS + g;
        uint4 packed;
        __half2* h = reinterpret_cast<__half2*>(&packed);
#pragma unroll
        for (int e = 0; e < 4; ++e) h[e] = __floats2half2_rn(src[2 * e], src[2 * e + 1]);
        *reinterpret_cast<uint4*>(o_base + static_cast<int64_t>(warp_row0 + r) * o_ss + c + g) = packed;
      }
    }
  }
}

#ifndef __CUDACC_RTC__  // host code: launchers and the C API of the torch binding

template <int kHeadDim, int kBlockM>
int launch(const void* q, const void* k, const void* v, void* o, int batch, int heads, int seq_q, int seq_k,
           const int64_t* strides, float scale_log2, cudaStream_t stream) {
  using Cfg = Config<kHeadDim, kBlockM>;
  auto kernel = fa_v100_forward_kernel<kHeadDim, kBlockM>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (err != cudaSuccess) return static_cast<int>(err);
  const dim3 grid((seq_q + kBlockM - 1) / kBlockM, heads, batch);
  kernel<<<grid, Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
      static_cast<const half*>(q), static_cast<const half*>(k), static_cast<const half*>(v), static_cast<half*>(o),
      seq_q, seq_k, strides[0], strides[1], strides[2], strides[3], strides[4], strides[5], strides[6], strides[7],
      strides[8], strides[9], strides[10], strides[11], scale_log2);
  return static_cast<int>(cudaGetLastError());
}

#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__

// Error codes below cudaError_t's range are ours.
#define FA_V100_BAD_CONFIG (-1)
#define FA_V100_BAD_SHAPE (-2)

extern "C" {

// Dynamic shared memory one block of the (head_dim, query_tile) variant asks for, or -1 for an unsupported variant.
int fa_v100_smem_bytes(int head_dim, int query_tile) {
  if (head_dim == 64 && query_tile == 64) return Config<64, 64>::kSmemBytes;
  if (head_dim == 64 && query_tile == 128) return Config<64, 128>::kSmemBytes;
  if (head_dim == 128 && query_tile == 64) return Config<128, 64>::kSmemBytes;
  if (head_dim == 128 && query_tile == 128) return Config<128, 128>::kSmemBytes;
  return FA_V100_BAD_CONFIG;
}

// Launch the forward on `stream`. `strides` holds 12 element strides: (batch, seq, head) for q, k, v and o.
// Returns 0 (cudaSuccess), a cudaError_t value, or one of the negative FA_V100_* codes.
int fa_v100_forward(const void* q, const void* k, const void* v, void* o, int batch, int heads, int seq_q, int seq_k,
                    int head_dim, const int64_t* strides, float softmax_scale, int query_tile, void* stream) {
  if (batch <= 0 || heads <= 0 || seq_q <= 0 || seq_k <= 0 || batch > 65535 || heads > 65535) {
    return FA_V100_BAD_SHAPE;
  }
  const float scale_log2 = softmax_scale * 1.4426950408889634f;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (head_dim == 64 && query_tile == 64)
    return launch<64, 64>(q, k, v, o, batch, heads, seq_q, seq_k, strides, scale_log2, s);
  if (head_dim == 64 && query_tile == 128)
    return launch<64, 128>(q, k, v, o, batch, heads, seq_q, seq_k, strides, scale_log2, s);
  if (head_dim == 128 && query_tile == 64)
    return launch<128, 64>(q, k, v, o, batch, heads, seq_q, seq_k, strides, scale_log2, s);
  if (head_dim == 128 && query_tile == 128)
    return launch<128, 128>(q, k, v, o, batch, heads, seq_q, seq_k, strides, scale_log2, s);
  return FA_V100_BAD_CONFIG;
}

const char* fa_v100_error_string(int code) {
  if (code == FA_V100_BAD_CONFIG) return "unsupported (head_dim, query_tile): head_dim must be 64 or 128, query_tile 64 or 128";
  if (code == FA_V100_BAD_SHAPE) return "bad shape: batch, heads, seq_q and seq_k must be positive, batch and heads <= 65535";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // extern "C"

#endif  // __CUDACC_RTC__
