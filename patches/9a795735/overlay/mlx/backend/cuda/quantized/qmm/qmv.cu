// patchkit overlay: generated, do not edit by hand.
// upstream:   https://github.com/ml-explore/mlx mlx/backend/cuda/quantized/qmm/qmv.cu
// pinned:     9a795735ad9a42664e08f42361b405ed570bcf1a (release 0.32.1)
// base blob:  4ec6b95a7a2d8a0680d74d2a4849dc63a04a387d
// regenerate: patchkit apply --pin 9a795735
// hunks carried (line numbers against upstream, without this header):
//   @@ -7,6 +7,10 @@
//   @@ -248,6 +252,372 @@ __global__ void gather_qmv_kernel(
//   @@ -267,7 +637,33 @@ void qmv(
//   @@ -403,6 +799,63 @@ inline void dispatch_quant_types(
//   @@ -420,6 +873,17 @@ void qmv(
//   @@ -451,6 +915,7 @@ void qmv(
// end of patchkit header
// Copyright © 2026 Apple Inc.

#include "mlx/backend/cuda/device/cute_dequant.cuh"
#include "mlx/backend/cuda/kernel_utils.cuh"
#include "mlx/backend/cuda/quantized/qmm/qmm.h"
#include "mlx/dtype_utils.h"

#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>

#include "mlx/utils.h"

namespace mlx::core {

namespace cu {

namespace cg = cooperative_groups;

// Fused vectorized dequantize and multiply-add:
// w_dq = w * scale + bias
// out = fma(x, w_dq, out)
template <int N, bool has_bias, typename T, typename Q, typename S>
__device__ __forceinline__ void
dequant_fma(const T* x, const Q* w, S scale, T bias, T* out) {
  // Read x/w into registers.
  auto x_vec = *(reinterpret_cast<const cutlass::Array<T, N>*>(x));
  auto w_vec = *(reinterpret_cast<const cutlass::Array<Q, N>*>(w));
  // Output is assumed to be registers.
  auto* out_vec = reinterpret_cast<cutlass::Array<T, N>*>(out);

  // Dequantize w.
  cutlass::NumericArrayConverter<T, Q, N> converter_tq;
  cutlass::Array<T, N> w_dq = converter_tq(w_vec);
  if constexpr (has_bias) {
    if constexpr (cuda::std::is_same_v<T, float>) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        w_dq[i] = w_dq[i] * T(scale) + bias;
      }
    } else {
      w_dq = w_dq * T(scale) + bias;
    }
  } else {
    w_dq = w_dq * T(scale);
  }

  // Multiply and add.
  *out_vec = cutlass::fma(x_vec, w_dq, *out_vec);
}

// Specialization for doing float32 accumulations on narrow types.
template <
    int N,
    bool has_bias,
    typename T,
    typename Q,
    typename S,
    typename = cuda::std::enable_if_t<!cuda::std::is_same_v<T, float>>>
__device__ __forceinline__ void
dequant_fma(const T* x, const Q* w, S scale, T bias, float* out) {
  // Read x/w into registers.
  auto x_vec = *(reinterpret_cast<const cutlass::Array<T, N>*>(x));
  auto w_vec = *(reinterpret_cast<const cutlass::Array<Q, N>*>(w));
  // Output is assumed to be registers.
  auto* out_vec = reinterpret_cast<cutlass::Array<float, N>*>(out);

  // Dequantize w.
  cutlass::NumericArrayConverter<T, Q, N> converter_tq;
  cutlass::Array<T, N> w_dq = converter_tq(w_vec);
  if constexpr (has_bias) {
    w_dq = w_dq * T(scale) + bias;
  } else {
    w_dq = w_dq * T(scale);
  }

  // Promote x/w to float.
  static_assert(!cuda::std::is_same_v<T, float>);
  cutlass::NumericArrayConverter<float, T, N> converter_ft;
  cutlass::Array<float, N> x_f = converter_ft(x_vec);
  cutlass::Array<float, N> w_f = converter_ft(w_dq);

  // Multiply and add.
  *out_vec = cutlass::fma(x_f, w_f, *out_vec);
}

template <
    int elems_per_thread,
    int group_size,
    bool has_bias,
    bool has_residue_k,
    typename T,
    typename Q,
    typename S>
__device__ __forceinline__ void qmv_kernel_impl(
    const T* x,
    const Q* w,
    const S* scales,
    const T* biases,
    const float* global_scale,
    T* out,
    int row,
    int w_batch,
    int n,
    int k) {
  auto warp = cg::tiled_partition<WARP_SIZE>(cg::this_thread_block());

  // For sub-byte Q, pointer moves by 8bits for each advance, e.g. w += 1 would
  // move past 2 elements for 4-bit Q.
  constexpr int bits = cute::sizeof_bits_v<Q>;
  auto w_step = [&](int idx) { return idx * cuda::std::min(8, bits) / 8; };

  // How many groups (and scales/biases) in a row.
  int groups_per_row = k / group_size;

  // Advance w/scales/biases to current row.
  w += (static_cast<int64_t>(row) + n * w_batch) * w_step(k);
  scales += (static_cast<int64_t>(row) + n * w_batch) * groups_per_row;
  if constexpr (has_bias) {
    biases += (static_cast<int64_t>(row) + n * w_batch) * groups_per_row;
  }

  // Accumulations of current row.
  cuda::std::conditional_t<(bits >= 8), float, T> sums[elems_per_thread] = {};

  auto dequant_fma_tile = [&](int idx) {
    S scale = scales[idx / group_size];
    T bias{0};
    if constexpr (has_bias) {
      bias = biases[idx / group_size];
    }
    dequant_fma<elems_per_thread, has_bias>(
        x + idx, w + w_step(idx), scale, bias, sums);
  };

  // Loop over k dimension.
  constexpr int elems_per_warp = WARP_SIZE * elems_per_thread;
  for (int r = 0; r < k / elems_per_warp; ++r) {
    int idx = warp.thread_rank() * elems_per_thread + r * elems_per_warp;
    dequant_fma_tile(idx);
  }

  // Handle remaining elements in k dimension.
  if constexpr (has_residue_k) {
    int rest = k % elems_per_warp;
    int idx = warp.thread_rank() * elems_per_thread + k - rest;
    if (idx < k) {
      dequant_fma_tile(idx);
    }
  }

  // Result for current row.
  float sum{0};
#pragma unroll
  for (int i = 0; i < elems_per_thread; ++i) {
    sum += sums[i];
  }
  sum = cg::reduce(warp, sum, cg::plus<float>{});

  // Write result for current warp, which maps to rows 1-to-1.
  if (warp.thread_rank() == 0) {
    if constexpr (
        cuda::std::is_same_v<Q, cutlass::float_e2m1_t> &&
        cuda::std::is_same_v<S, cutlass::float_e4m3_t>) {
      // Only nvfp4 supports global scale.
      if (global_scale) {
        sum *= (*global_scale / (F8E4M3_MAX * F4E2M1_MAX));
      }
    }
    out[row] = static_cast<T>(sum);
  }
}

template <
    int rows_per_block,
    int elems_per_thread,
    int group_size,
    bool has_bias,
    bool has_residue_k,
    typename T,
    typename Q,
    typename S>
__global__ void qmv_kernel(
    const T* x,
    const Q* w,
    const S* scales,
    const T* biases,
    const float* global_scale,
    T* out,
    int n,
    int k,
    bool broadcast_w) {
  auto grid = cg::this_grid();
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<WARP_SIZE>(block);

  // The row that this warp handles.
  int row = block.group_index().x * rows_per_block + warp.meta_group_rank();
  if (row >= n) {
    return;
  }

  // Advance pointers of x/out for M and batch dimensions.
  int m = grid.dim_blocks().y;
  int l = block.group_index().z;
  x += block.group_index().y * k + m * k * l;
  out += block.group_index().y * n + m * n * l;
  int w_batch = broadcast_w ? 0 : l;

  qmv_kernel_impl<elems_per_thread, group_size, has_bias, has_residue_k>(
      x, w, scales, biases, global_scale, out, row, w_batch, n, k);
}

template <
    int rows_per_block,
    int elems_per_thread,
    int group_size,
    bool has_bias,
    bool has_residue_k,
    typename T,
    typename Q,
    typename S>
__global__ void gather_qmv_kernel(
    const T* x,
    const Q* w,
    const S* scales,
    const T* biases,
    T* out,
    const uint32_t* lhs_indices,
    const uint32_t* rhs_indices,
    int n,
    int k) {
  auto grid = cg::this_grid();
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<WARP_SIZE>(block);

  int row = block.group_index().x * rows_per_block + warp.meta_group_rank();
  if (row >= n) {
    return;
  }

  int m = grid.dim_blocks().y;
  int l = block.group_index().z;
  uint32_t x_idx = lhs_indices[l];
  uint32_t w_idx = rhs_indices[l];

  x += block.group_index().y * k + m * k * x_idx;
  out += block.group_index().y * n + m * n * l;

  qmv_kernel_impl<elems_per_thread, group_size, has_bias, has_residue_k>(
      x, w, scales, biases, nullptr, out, row, w_idx, n, k);
}

// qmv on tensor cores: weight rows are MMA rows and vectors MMA columns. M
// never changes a vector's operations, so where the MMA computes every column
// alike (checked on sm90; PTX does not promise it) each row equals M = 1's.
template <typename T, typename Q>
constexpr bool qmv_mma_types = (cuda::std::is_same_v<T, cutlass::half_t> ||
                                cuda::std::is_same_v<T, cutlass::bfloat16_t>) &&
    (cute::sizeof_bits_v<Q> == 4 || cute::sizeof_bits_v<Q> == 8);

template <typename T>
__device__ __forceinline__ void
qmv_mma_fma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  using Mma = cuda::std::conditional_t<
      cuda::std::is_same_v<T, cutlass::half_t>,
      cute::SM80_16x8x16_F32F16F16F32_TN,
      cute::SM80_16x8x16_F32BF16BF16F32_TN>;
  Mma::fma(
      d[0],
      d[1],
      d[2],
      d[3],
      a[0],
      a[1],
      a[2],
      a[3],
      b0,
      b1,
      d[0],
      d[1],
      d[2],
      d[3]);
}

// Both halves of a packed pair set to v.
template <typename T>
__device__ __forceinline__ auto qmv_mma_pair(T v) {
  if constexpr (cuda::std::is_same_v<T, cutlass::half_t>) {
    return __half2half2(v.to_half());
  } else {
    return __bfloat162bfloat162(v.to_nv_bfloat16());
  }
}

template <
    int tiles,
    int k_warps,
    int stages,
    int blocks_per_sm,
    int group_size,
    bool has_bias,
    typename T,
    typename Q,
    typename S>
__global__ void __launch_bounds__(k_warps* WARP_SIZE, blocks_per_sm)
    qmv_mma_kernel(
        const T* x,
        const Q* w,
        const S* scales,
        const T* biases,
        const float* global_scale,
        T* out,
        int m,
        int n,
        int k,
        bool broadcast_w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ != 900
  // Launched on sm90 only (supports_qmv_mma): no code for other architectures.
  __trap();
#else
  constexpr int bits = cute::sizeof_bits_v<Q>;
  // Weights a thread dequantizes per row and step: one 16-byte load.
  constexpr int seg = 128 / bits;
  // Groups in a step (nvfp4's groups of 16 are shorter than a step).
  constexpr int seg_groups = cuda::std::max(1, seg / group_size);
  constexpr int group_elems = seg / seg_groups;
  // Weights of a row dequantized at a time: two MMAs' worth, in one group.
  constexpr int chunk = 8;
  static_assert(group_elems % chunk == 0, "a chunk lies in one group");
  // K of one step of a warp: the four threads of an MMA row.
  constexpr int step_k = 4 * seg;
  using T2 = cuda::std::conditional_t<
      cuda::std::is_same_v<T, cutlass::half_t>,
      __half2,
      __nv_bfloat162>;

  int lane = threadIdx.x % WARP_SIZE;
  int warp = threadIdx.x / WARP_SIZE;
  // Weight rows g and g + 8 of each tile, vectors g and g + 8.
  int g = lane / 4;
  int quad = lane % 4; // which quarter of a step's K it reads

  int n0 = blockIdx.x * tiles * 16;
  int v0 = blockIdx.y * 16;
  int l = blockIdx.z;
  int vecs = cuda::std::min(16, m - v0);
  // Vectors 8 to 15 take a second MMA per step (uniform over the block).
  bool two = vecs > 8;
  x += (static_cast<int64_t>(l) * m + v0) * k;
  out += (static_cast<int64_t>(l) * m + v0) * n;
  int w_batch = broadcast_w ? 0 : l;
  int groups_per_row = k / group_size;
  int64_t row_bytes = static_cast<int64_t>(k) * bits / 8;
  auto* w_bytes = reinterpret_cast<const uint8_t*>(w) +
      static_cast<int64_t>(w_batch) * n * row_bytes;
  scales += static_cast<int64_t>(w_batch) * n * groups_per_row;
  if constexpr (has_bias) {
    biases += static_cast<int64_t>(w_batch) * n * groups_per_row;
  }

  const T* x_rows[2] = {
      x + static_cast<int64_t>(g) * k, x + static_cast<int64_t>(g + 8) * k};
  bool x_real[2] = {g < vecs, g + 8 < vecs};

  // Each warp streams its weights through a ring of `stages` slots (cp.async,
  // zeros past K or N); a thread reads only the words it copied.
  __shared__ uint4 ring[k_warps][stages][tiles][2][WARP_SIZE];
  __shared__ float partial[k_warps][tiles][2][4][WARP_SIZE];
  static_assert(
      sizeof(ring) + sizeof(partial) <= 48 * 1024, "static shared memory");
  S scale[stages][tiles][2][seg_groups];
  T bias[stages][tiles][2][seg_groups];

  int steps = cuda::ceil_div(k, step_k);
  // Step s of this thread into ring slot `slot`: zeros past K or N.
  auto fetch = [&](int slot, int s) {
    int k0 = s * step_k + quad * seg;
#pragma unroll
    for (int t = 0; t < tiles; ++t) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        int row = n0 + t * 16 + h * 8 + g;
        uint4& dst = ring[warp][slot][t][h][lane];
        if (k0 < k && row < n) {
          cute::SM80_CP_ASYNC_CACHEGLOBAL<uint4>::copy(
              *reinterpret_cast<const uint4*>(
                  w_bytes + row * row_bytes + k0 * bits / 8),
              dst);
          int64_t g0 =
              static_cast<int64_t>(row) * groups_per_row + k0 / group_size;
#pragma unroll
          for (int j = 0; j < seg_groups; ++j) {
            scale[slot][t][h][j] = scales[g0 + j];
            bias[slot][t][h][j] = T{0};
            if constexpr (has_bias) {
              bias[slot][t][h][j] = biases[g0 + j];
            }
          }
        } else {
          // A plain store (faster than a zero-fill copy): this thread waited
          // for and read any earlier copy into the slot.
          dst = make_uint4(0, 0, 0, 0);
#pragma unroll
          for (int j = 0; j < seg_groups; ++j) {
            scale[slot][t][h][j] = S{};
            bias[slot][t][h][j] = T{0};
          }
        }
      }
    }
    cute::cp_async_fence();
  };

  float acc[tiles][2][4] = {};
  // A warp takes steps warp, warp + k_warps, ... in order.
#pragma unroll
  for (int slot = 0; slot < stages - 1; ++slot) {
    fetch(slot, warp + slot * k_warps);
  }
  for (int s0 = warp; s0 < steps; s0 += k_warps * stages) {
#pragma unroll
    for (int slot = 0; slot < stages; ++slot) {
      int s = s0 + slot * k_warps;
      // Refill the slot read last: this thread's reads of it fed MMAs issued
      // before this copy (volatile instructions stay in order).
      fetch((slot + stages - 1) % stages, s + (stages - 1) * k_warps);
      // This step's copies have landed; the warp barrier also keeps the
      // compiler from moving the slot's reads above the wait.
      cute::cp_async_wait<stages - 1>();
      __syncwarp();
      if (s >= steps) {
        break;
      }
      int k0 = s * step_k + quad * seg;
      bool in_k = k0 < k;

      // x of vectors g and g + 8 at this thread's K, as packed pairs (zeros
      // past M or K).
      uint32_t xs[2][seg / 2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
#pragma unroll
        for (int j = 0; j < seg / 8; ++j) {
          uint4 v = make_uint4(0, 0, 0, 0);
          if (in_k && x_real[h]) {
            v = reinterpret_cast<const uint4*>(x_rows[h] + k0)[j];
          }
          xs[h][4 * j] = v.x;
          xs[h][4 * j + 1] = v.y;
          xs[h][4 * j + 2] = v.z;
          xs[h][4 * j + 3] = v.w;
        }
      }

#pragma unroll
      for (int t = 0; t < tiles; ++t) {
        uint4 raw[2] = {
            ring[warp][slot][t][0][lane], ring[warp][slot][t][1][lane]};
#pragma unroll
        for (int c = 0; c < seg / chunk; ++c) {
          // w * scale + bias in T, one fma per pair of weights.
          uint32_t wp[2][chunk / 2];
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            auto w_vec =
                reinterpret_cast<const cutlass::Array<Q, chunk>*>(&raw[h])[c];
            cutlass::NumericArrayConverter<T, Q, chunk> converter;
            cutlass::Array<T, chunk> w_dq = converter(w_vec);
            auto* w2 = reinterpret_cast<T2*>(&w_dq);
            int grp = c * chunk / group_elems;
            T2 s2 = qmv_mma_pair(T(scale[slot][t][h][grp]));
            T2 b2 = qmv_mma_pair(bias[slot][t][h][grp]);
#pragma unroll
            for (int i = 0; i < chunk / 2; ++i) {
              if constexpr (has_bias) {
                w2[i] = __hfma2(w2[i], s2, b2);
              } else {
                w2[i] = __hmul2(w2[i], s2);
              }
            }
#pragma unroll
            for (int i = 0; i < chunk / 2; ++i) {
              wp[h][i] = reinterpret_cast<const uint32_t*>(&w_dq)[i];
            }
          }

          // MMA j takes k0 + 4j .. k0 + 4j + 3 of every thread: pairs 2j,
          // 2j + 1 of the step.
#pragma unroll
          for (int jc = 0; jc < chunk / 4; ++jc) {
            int j = c * chunk / 4 + jc;
            uint32_t a[4] = {
                wp[0][2 * jc],
                wp[1][2 * jc],
                wp[0][2 * jc + 1],
                wp[1][2 * jc + 1]};
            qmv_mma_fma<T>(acc[t][0], a, xs[0][2 * j], xs[0][2 * j + 1]);
            if (two) {
              qmv_mma_fma<T>(acc[t][1], a, xs[1][2 * j], xs[1][2 * j + 1]);
            }
          }
        }
      }
    }
  }

  // No copy left in flight at exit, whatever the loop's bounds.
  cute::cp_async_wait<0>();

  // The warps' partial sums, added in warp order.
#pragma unroll
  for (int t = 0; t < tiles; ++t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        partial[warp][t][h][i][lane] = acc[t][h][i];
      }
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < tiles * 2 * 4 * WARP_SIZE;
       e += k_warps * WARP_SIZE) {
    int t = e / (2 * 4 * WARP_SIZE);
    int h = (e / (4 * WARP_SIZE)) % 2;
    int i = (e / WARP_SIZE) % 4;
    int src = e % WARP_SIZE;
    // Accumulator i of lane src in MMA h: weight row src / 4 (+ 8 for i >= 2)
    // of tile t, vector 8 * h + 2 * (src % 4) + i % 2.
    int vec = 8 * h + 2 * (src % 4) + i % 2;
    int row = n0 + t * 16 + src / 4 + 8 * (i / 2);
    if (vec >= vecs || row >= n) {
      continue;
    }
    float sum = partial[0][t][h][i][src];
#pragma unroll
    for (int p = 1; p < k_warps; ++p) {
      sum += partial[p][t][h][i][src];
    }
    if constexpr (
        cuda::std::is_same_v<Q, cutlass::float_e2m1_t> &&
        cuda::std::is_same_v<S, cutlass::float_e4m3_t>) {
      // Only nvfp4 supports global scale.
      if (global_scale) {
        sum *= (*global_scale / (F8E4M3_MAX * F4E2M1_MAX));
      }
    }
    out[static_cast<int64_t>(vec) * n + row] = static_cast<T>(sum);
  }
#endif
}

template <
    int group_size,
    bool has_bias,
    typename T,
    typename Q,
    typename S,
    typename F>
void qmv_mma(
    const T* x,
    const Q* w,
    const S* scales,
    const T* biases,
    const float* global_scale,
    T* out,
    int m,
    int n,
    int k,
    int l,
    bool broadcast_w,
    F&& launch_kernel) {
  constexpr int tiles = 1;
  constexpr int stages = 4;
  // Warps per SM, in blocks of k_warps warps over K (128 registers a thread).
  constexpr int warps_per_sm = 16;
  // Warps over K set a vector's summation order, so they follow the layer's
  // rows, never M: wide layers take more blocks of fewer warps.
  constexpr int narrow_k_warps = 8;
  constexpr int wide_n = 8192;
  constexpr int wide_k_warps = 4;
  // Past wider_n rows a warp takes two tiles: each x fragment it loads then
  // feeds twice the weights (x's loads bound M > 8). 2 slots measured faster
  // than 3 or 4, and one tile faster up to 8192 rows. Neither changes the
  // order of a vector's sums.
  constexpr int wider_n = 8192;
  constexpr int wider_tiles = 2;
  constexpr int wider_stages = 2;
  void* args[] = {
      &x, &w, &scales, &biases, &global_scale, &out, &m, &n, &k, &broadcast_w};
  auto launch = [&]<int k_warps, int row_tiles, int slots>() {
    dim3 num_blocks{
        uint32_t(cuda::ceil_div(n, row_tiles * 16)),
        uint32_t(cuda::ceil_div(m, 16)),
        uint32_t(l)};
    dim3 block_dims{k_warps * WARP_SIZE};
    auto* kernel = &qmv_mma_kernel<
        row_tiles,
        k_warps,
        slots,
        warps_per_sm / k_warps,
        group_size,
        has_bias,
        T,
        Q,
        S>;
    launch_kernel(
        reinterpret_cast<void*>(kernel), num_blocks, block_dims, args);
  };
  if (n < wide_n) {
    launch.template operator()<narrow_k_warps, tiles, stages>();
  } else if (n <= wider_n) {
    launch.template operator()<wide_k_warps, tiles, stages>();
  } else {
    launch.template operator()<wide_k_warps, wider_tiles, wider_stages>();
  }
}

template <
    int group_size,
    bool has_bias,
    typename T,
    typename Q,
    typename S,
    typename F>
void qmv(
    const T* x,
    const Q* w,
    const S* scales,
    const T* biases,
    const float* global_scale,
    T* out,
    int m,
    int n,
    int k,
    int l,
    bool broadcast_w,
    bool mma,
    F&& launch_kernel) {
  if constexpr (qmv_mma_types<T, Q>) {
    if (mma) {
      // Weights shared by the batch: its vectors are rows of the same tiles,
      // while the tiles of 16 fit gridDim.y (at most 65535).
      if (broadcast_w &&
          cuda::ceil_div(static_cast<int64_t>(m) * l, int64_t(16)) <= 65535) {
        m *= l;
        l = 1;
      }
      qmv_mma<group_size, has_bias>(
          x,
          w,
          scales,
          biases,
          global_scale,
          out,
          m,
          n,
          k,
          l,
          broadcast_w,
          launch_kernel);
      return;
    }
  }
  constexpr int rows_per_block = 8;
  constexpr int elems_per_thread =
      (cute::sizeof_bits_v<T> <= 16 && cute::sizeof_bits_v<Q> <= 4) ? 16 : 8;

  dim3 num_blocks{
      uint32_t(cuda::ceil_div(n, rows_per_block)), uint32_t(m), uint32_t(l)};
  dim3 block_dims{WARP_SIZE, rows_per_block};
  void* args[] = {
      &x, &w, &scales, &biases, &global_scale, &out, &n, &k, &broadcast_w};

  dispatch_bool(k % (WARP_SIZE * elems_per_thread), [&](auto has_residue_k) {
    auto* kernel = &qmv_kernel<
        rows_per_block,
        elems_per_thread,
        group_size,
        has_bias,
        has_residue_k.value,
        T,
        Q,
        S>;
    launch_kernel(
        reinterpret_cast<void*>(kernel), num_blocks, block_dims, args);
  });
}

template <
    int group_size,
    bool has_bias,
    typename T,
    typename Q,
    typename S,
    typename F>
void gather_qmv(
    const T* x,
    const Q* w,
    const S* scales,
    const T* biases,
    T* out,
    const uint32_t* lhs_indices,
    const uint32_t* rhs_indices,
    int m,
    int n,
    int k,
    int l,
    F&& launch_kernel) {
  constexpr int rows_per_block = 8;
  constexpr int elems_per_thread =
      (cute::sizeof_bits_v<T> <= 16 && cute::sizeof_bits_v<Q> <= 4) ? 16 : 8;

  dim3 num_blocks{
      uint32_t(cuda::ceil_div(n, rows_per_block)), uint32_t(m), uint32_t(l)};
  dim3 block_dims{WARP_SIZE, rows_per_block};
  void* args[] = {
      &x, &w, &scales, &biases, &out, &lhs_indices, &rhs_indices, &n, &k};

  dispatch_bool(k % (WARP_SIZE * elems_per_thread), [&](auto has_residue_k) {
    auto* kernel = &gather_qmv_kernel<
        rows_per_block,
        elems_per_thread,
        group_size,
        has_bias,
        has_residue_k.value,
        T,
        Q,
        S>;
    launch_kernel(
        reinterpret_cast<void*>(kernel), num_blocks, block_dims, args);
  });
}

} // namespace cu

template <typename F>
inline void dispatch_element_types(Dtype dtype, const char* tag, F&& f) {
  if (dtype == float32) {
    f.template operator()<float>();
  } else if (dtype == float16) {
    f.template operator()<cutlass::half_t>();
  } else if (dtype == bfloat16) {
    f.template operator()<cutlass::bfloat16_t>();
  } else {
    throw std::invalid_argument(
        fmt::format("{} Unsupported dtype: {}.", tag, dtype_to_string(dtype)));
  }
}

template <typename F>
inline void dispatch_groups(int group_size, const char* tag, F&& f) {
  if (group_size == 32) {
    f.template operator()<32>();
  } else if (group_size == 64) {
    f.template operator()<64>();
  } else if (group_size == 128) {
    f.template operator()<128>();
  } else {
    throw std::invalid_argument(
        fmt::format("{} Group size {} is not supported.", tag, group_size));
  }
}

template <typename T, typename F>
inline void dispatch_quant_types(
    int bits,
    int group_size,
    QuantizationMode mode,
    const char* tag,
    F&& f) {
  if (mode == QuantizationMode::Mxfp4) {
    f.template operator()<cutlass::float_e2m1_t, cutlass::float_ue8m0_t, 32>();
  } else if (mode == QuantizationMode::Mxfp8) {
    f.template operator()<cutlass::float_e4m3_t, cutlass::float_ue8m0_t, 32>();
  } else if (mode == QuantizationMode::Nvfp4) {
    f.template operator()<cutlass::float_e2m1_t, cutlass::float_e4m3_t, 16>();
  } else {
    dispatch_groups(group_size, tag, [&]<int group_size>() {
      if (bits == 2) {
        f.template operator()<cutlass::uint2b_t, T, group_size>();
      } else if (bits == 3) {
        f.template operator()<cutlass::uint3b_t, T, group_size>();
      } else if (bits == 4) {
        f.template operator()<cutlass::uint4b_t, T, group_size>();
      } else if (bits == 5) {
        f.template operator()<cutlass::uint5b_t, T, group_size>();
      } else if (bits == 6) {
        f.template operator()<cutlass::uint6b_t, T, group_size>();
      } else if (bits == 8) {
        f.template operator()<uint8_t, T, group_size>();
      } else {
        throw std::invalid_argument(
            fmt::format("{} {}-bit quantization is not supported.", tag, bits));
      }
    });
  }
}

bool supports_qmv_mma(
    const array& x,
    const array& w,
    const array& scales,
    const std::optional<array>& biases,
    const array& out,
    bool transpose,
    int bits,
    int group_size,
    QuantizationMode mode,
    cu::Device& device) {
  // Downstream off switch: qmv reads the weights once per vector, as upstream.
  static bool off = !env::get_var("MLX_CUDA_QMV_SHARED_WEIGHTS", 1);
  if (off) {
    return false;
  }
  // 16-bit inputs on 4- and 8-bit weights, on sm90 only: rows and speed are
  // measured there; other GPUs keep the other kernels until they are.
  int major = device.compute_capability_major();
  if (major != 9) {
    return false;
  }
  // A build without sm90 code holds only the kernel's trap stub: the kernel
  // must come from sm90 code.
  static bool compiled_for_mma = [] {
    cudaFuncAttributes attr;
    auto* kernel = &cu::qmv_mma_kernel<
        1,
        8,
        4,
        2,
        64,
        true,
        cutlass::bfloat16_t,
        cutlass::uint4b_t,
        cutlass::bfloat16_t>;
    if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
      cudaGetLastError(); // An answer here, not an error for later calls.
      return false;
    }
    return attr.ptxVersion >= 90;
  }();
  if (!compiled_for_mma) {
    return false;
  }
  if (out.dtype() != float16 && out.dtype() != bfloat16) {
    return false;
  }
  if (bits != 4 && bits != 8) {
    return false;
  }
  // K in whole 16-byte loads of a weight row, and x and w starting 16-byte
  // aligned in their buffers (a view can start anywhere).
  int k = x.shape(-1);
  return k % (128 / bits) == 0 && x.offset() % 16 == 0 && w.offset() % 16 == 0;
}

void qmv(
    const array& x,
    const array& w,
    const array& scales,
    const std::optional<array>& biases,
    const std::optional<array>& global_scale,
    array& out,
    int bits,
    int group_size,
    QuantizationMode mode,
    cu::CommandEncoder& encoder) {
  const char* tag = "[quantized_matmul]";
  int m = out.shape(-2);
  int n = out.shape(-1);
  int k = x.shape(-1);
  int l = out.size() / (m * n);
  bool broadcast_w = (w.ndim() <= 2) || (w.size() != w.data_size());
  bool mma = supports_qmv_mma(
      x,
      w,
      scales,
      biases,
      out,
      true,
      bits,
      group_size,
      mode,
      encoder.device());

  dispatch_element_types(out.dtype(), tag, [&]<typename T>() {
    dispatch_quant_types<T>(
        bits,
        group_size,
        mode,
        tag,
        [&]<typename Q, typename S, int group_size>() {
          encoder.set_input_array(x);
          encoder.set_input_array(w);
          encoder.set_input_array(scales);
          if (biases) {
            encoder.set_input_array(*biases);
          }
          if (global_scale) {
            encoder.set_input_array(*global_scale);
          }
          encoder.set_output_array(out);
          constexpr bool has_bias = !cutlass::has_negative_zero_v<Q>;
          cu::qmv<group_size, has_bias>(
              gpu_ptr<T>(x),
              gpu_ptr<Q>(w),
              gpu_ptr<S>(scales),
              biases ? gpu_ptr<T>(*biases) : nullptr,
              global_scale ? gpu_ptr<float>(*global_scale) : nullptr,
              gpu_ptr<T>(out),
              m,
              n,
              k,
              l,
              broadcast_w,
              mma,
              [&](auto* kernel, dim3 num_blocks, dim3 block_dims, void** args) {
                encoder.add_kernel_node_raw(
                    kernel, num_blocks, block_dims, {}, 0, args);
              });
        });
  });
}

void gather_qmv(
    const array& x,
    const array& w,
    const array& scales,
    const std::optional<array>& biases,
    const array& lhs_indices,
    const array& rhs_indices,
    array& out,
    int bits,
    int group_size,
    QuantizationMode mode,
    cu::CommandEncoder& encoder) {
  const char* tag = "[gather_qmm]";
  int m = out.shape(-2);
  int n = out.shape(-1);
  int k = x.shape(-1);
  int l = out.size() / (m * n);

  dispatch_element_types(out.dtype(), tag, [&]<typename T>() {
    dispatch_quant_types<T>(
        bits,
        group_size,
        mode,
        tag,
        [&]<typename Q, typename S, int group_size>() {
          encoder.set_input_array(x);
          encoder.set_input_array(w);
          encoder.set_input_array(scales);
          if (biases) {
            encoder.set_input_array(*biases);
          }
          encoder.set_input_array(lhs_indices);
          encoder.set_input_array(rhs_indices);
          encoder.set_output_array(out);
          constexpr bool has_bias = !cutlass::has_negative_zero_v<Q>;
          cu::gather_qmv<group_size, has_bias>(
              gpu_ptr<T>(x),
              gpu_ptr<Q>(w),
              gpu_ptr<S>(scales),
              biases ? gpu_ptr<T>(*biases) : nullptr,
              gpu_ptr<T>(out),
              gpu_ptr<uint32_t>(lhs_indices),
              gpu_ptr<uint32_t>(rhs_indices),
              m,
              n,
              k,
              l,
              [&](auto* kernel, dim3 num_blocks, dim3 block_dims, void** args) {
                encoder.add_kernel_node_raw(
                    kernel, num_blocks, block_dims, {}, 0, args);
              });
        });
  });
}

} // namespace mlx::core
