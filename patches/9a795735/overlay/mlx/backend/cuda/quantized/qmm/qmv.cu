// patchkit overlay: generated, do not edit by hand.
// upstream:   https://github.com/ml-explore/mlx mlx/backend/cuda/quantized/qmm/qmv.cu
// pinned:     9a795735ad9a42664e08f42361b405ed570bcf1a (release 0.32.1)
// base blob:  4ec6b95a7a2d8a0680d74d2a4849dc63a04a387d
// regenerate: patchkit apply --pin 9a795735
// hunks carried (line numbers against upstream, without this header):
//   @@ -8,6 +8,8 @@
//   @@ -208,6 +210,494 @@ __global__ void qmv_kernel(
//   @@ -293,6 +783,141 @@ void qmv(
//   @@ -439,6 +1064,35 @@ void qmv(
// end of patchkit header
// Copyright © 2026 Apple Inc.

#include "mlx/backend/cuda/device/cute_dequant.cuh"
#include "mlx/backend/cuda/kernel_utils.cuh"
#include "mlx/backend/cuda/quantized/qmm/qmm.h"
#include "mlx/dtype_utils.h"

#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>

#include "mlx/backend/cuda/steel/utils.cuh"

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

template <int V, int N, bool has_bias, typename T, typename Q, typename S>
__device__ __forceinline__ void dequant_fma_streamed(
    const T* x0,
    int64_t x_stride,
    const Q* w,
    S scale,
    T bias,
    T (*out0)[N],
    int nv) {
  // Read x/w into registers.
  auto w_vec = *(reinterpret_cast<const cutlass::Array<Q, N>*>(w));
  // Output is assumed to be registers.

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
#pragma unroll
  for (int v = 0; v < V; ++v) {
    if (v < nv) {
      const T* x = x0 + v * x_stride;
      auto* out = out0[v];
      auto x_vec = *(reinterpret_cast<const cutlass::Array<T, N>*>(x));
      auto* out_vec = reinterpret_cast<cutlass::Array<T, N>*>(out);
      *out_vec = cutlass::fma(x_vec, w_dq, *out_vec);
    }
  }
}

template <
    int V,
    int N,
    bool has_bias,
    typename T,
    typename Q,
    typename S,
    typename = cuda::std::enable_if_t<!cuda::std::is_same_v<T, float>>>
__device__ __forceinline__ void dequant_fma_streamed(
    const T* x0,
    int64_t x_stride,
    const Q* w,
    S scale,
    T bias,
    float (*out0)[N],
    int nv) {
  // Read x/w into registers.
  auto w_vec = *(reinterpret_cast<const cutlass::Array<Q, N>*>(w));
  // Output is assumed to be registers.

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
  cutlass::Array<float, N> w_f = converter_ft(w_dq);

  // Multiply and add.
#pragma unroll
  for (int v = 0; v < V; ++v) {
    if (v < nv) {
      const T* x = x0 + v * x_stride;
      auto* out = out0[v];
      auto x_vec = *(reinterpret_cast<const cutlass::Array<T, N>*>(x));
      auto* out_vec = reinterpret_cast<cutlass::Array<float, N>*>(out);
      cutlass::Array<float, N> x_f = converter_ft(x_vec);
      *out_vec = cutlass::fma(x_f, w_f, *out_vec);
    }
  }
}

// Streamed qmv: one warp per output row and V vectors per warp. Each vector
// keeps its own sums[], receives the same fma on the same dequantized tile in
// the same order and goes through the same cg::reduce as qmv_kernel_impl does
// for M = 1, so every output row is bit-identical to the M = 1 result. The
// weight tile is loaded and dequantized once for all V vectors; vectors past
// `nv` (the tail tile of M) are skipped with a warp-uniform branch.
//
// x staged in shared memory: per stage of up to max_stage_steps k steps (4
// unless the body's caller asks otherwise), the block's threads copy each
// vector's x slice once (coalesced 32-bit words), and every warp reads its
// elems_per_thread elements from there instead of from global memory. The
// tiles, idx values, dequant_fma_streamed calls and the reduce are the ones
// above, in the same order; only the address x is read from changes, so the
// rows stay bit-identical. Warps past n still stage and meet every barrier;
// they skip only the compute and the store.
//
// A warp may own rows_per_warp consecutive rows: its lanes' x slices do not
// depend on the row, so each is read from shared memory once per k step and
// used for every row (the compiler keeps it in registers). Each row keeps its
// own sums[j][V][elems_per_thread]; the rows are independent chains, so this
// too changes no per-row order. Rows past n within a warp recompute row n - 1
// and are never stored. Vectors past nv read zeros staged for them and are
// never stored either, so the fma loop has no per-vector branch.
//
// Two more memory-only knobs: x_async copies stage i + 1 with cp.async into a
// second buffer while stage i is computed, and l2_prefetch asks L2 for the
// warp's weight rows up front. cp.async exists from sm_80 on; below it x_async
// is ignored and every stage is copied with plain loads and stores, which
// changes when x reaches shared memory, not which tiles are summed or in what
// order. The __global__ wrapper below passes the values the host launcher
// uses; the defaults are the plain form.
template <
    int V,
    int rows_per_block,
    int rows_per_warp,
    int max_stage_steps,
    bool l2_prefetch,
    bool x_async,
    int elems_per_thread,
    int group_size,
    bool has_bias,
    bool has_residue_k,
    typename T,
    typename Q,
    typename S>
__device__ __forceinline__ void qmv_streamed_kernel_impl(
    const T* x,
    const Q* w,
    const S* scales,
    const T* biases,
    const float* global_scale,
    T* out,
    int row,
    int w_batch,
    int n,
    int k,
    int nv) {
  auto warp = cg::tiled_partition<WARP_SIZE>(cg::this_thread_block());

  constexpr int bits = cute::sizeof_bits_v<Q>;
  auto w_step = [&](int idx) { return idx * cuda::std::min(8, bits) / 8; };

  int groups_per_row = k / group_size;

  w += (static_cast<int64_t>(row) + n * w_batch) * w_step(k);
  scales += (static_cast<int64_t>(row) + n * w_batch) * groups_per_row;
  if constexpr (has_bias) {
    biases += (static_cast<int64_t>(row) + n * w_batch) * groups_per_row;
  }

  // One accumulator row per (row, vector), of the type qmv_kernel_impl uses.
  using accumulator = cuda::std::conditional_t<(bits >= 8), float, T>;
  accumulator sums[rows_per_warp][V][elems_per_thread] = {};

  // Shared x: a thread's elems_per_thread elements are x_words 32-bit words
  // (4, 8 or 16), read back as 16-byte vectors. The lane pitch x_words | 4 is
  // 4 mod 8 words, so the 8 lanes of each quarter-warp phase of a 16-byte
  // shared load hit 32 distinct banks.
  constexpr int x_words = elems_per_thread * sizeof(T) / sizeof(uint32_t);
  static_assert(x_words % 4 == 0);
  constexpr int x_pitch = x_words | 4;
  constexpr int tile_words = WARP_SIZE * x_pitch;
  // Up to max_stage_steps k steps per stage (fewer barriers), within 24 KB.
  constexpr int stage_steps =
      cuda::std::min(max_stage_steps, 6144 / (V * tile_words));
  static_assert(stage_steps >= 1, "x for V vectors exceeds 24 KB");
  constexpr int stage_words = stage_steps * tile_words;
  // cp.async exists from sm_80 on; below it x_async is ignored and every
  // stage is copied with plain loads and stores.
#if defined(MLX_CUDA_SM_80_ENABLED)
  constexpr bool async_x = x_async;
#else
  constexpr bool async_x = false;
#endif
  // With async_x, two buffers: full stage i + 1 is copied (cp.async) while
  // stage i is computed.
  constexpr int buffer_words = V * stage_words;
  __shared__ alignas(16) uint32_t xs[(async_x ? 2 : 1) * buffer_words];
  constexpr int block_threads = rows_per_block / rows_per_warp * WARP_SIZE;
  bool row_active = row < n;

  // Ask L2 for this warp's weight rows, scales and biases up front: a hint
  // (no registers, no arithmetic) that keeps many lines in flight, so the
  // k loop's loads find them in L2 instead of each waiting on memory.
  if constexpr (l2_prefetch) {
    auto prefetch = [&](const void* p, int bytes) {
      for (int b = warp.thread_rank() * 128; b < bytes; b += WARP_SIZE * 128) {
        asm volatile(
            "prefetch.global.L2 [%0];" ::"l"(static_cast<const char*>(p) + b));
      }
    };
    if (row_active) {
#pragma unroll
      for (int j = 0; j < rows_per_warp; ++j) {
        int jr = cuda::std::min(j, n - 1 - row);
        prefetch(w + jr * w_step(k), w_step(k));
        prefetch(scales + jr * groups_per_row, groups_per_row * sizeof(S));
        if constexpr (has_bias) {
          prefetch(biases + jr * groups_per_row, groups_per_row * sizeof(T));
        }
      }
    }
  }

  // Copy x[v][k0 : k0 + len] to buf; zeros for v >= nv (block-uniform).
  // Async: MLX's cp_async per 32-bit word; the zeros are plain stores.
  auto stage_x = [&](uint32_t* buf, int k0, int len, auto async) {
    int words = len * sizeof(T) / sizeof(uint32_t);
#pragma unroll
    for (int v = 0; v < V; ++v) {
      auto* src = reinterpret_cast<const uint32_t*>(
          x + static_cast<int64_t>(v < nv ? v : 0) * k + k0);
      uint32_t* dst = buf + v * stage_words;
      for (int i = cg::this_thread_block().thread_rank(); i < words;
           i += block_threads) {
        uint32_t* d = dst + (i / x_words) * x_pitch + i % x_words;
        if constexpr (decltype(async)::value) {
          if (v < nv) {
            cp_async<4>(
                static_cast<uint32_t>(__cvta_generic_to_shared(d)), src + i);
          } else {
            *d = 0u;
          }
        } else {
          *d = v < nv ? src[i] : 0u;
        }
      }
    }
  };

  // This thread's slice of staged k step s, vector 0.
  auto x_slice = [&](const uint32_t* buf, int s) {
    return buf + s * tile_words + warp.thread_rank() * x_pitch;
  };

  auto dequant_fma_tile = [&](int idx, const uint32_t* x_tile) {
    // This lane's x slices of the V vectors, copied bit for bit into
    // registers before any fma (cutlass's fma is inline asm, which would keep
    // the compiler from reusing loads across it), then read by every row.
    uint4 x_regs[V][x_words / 4];
#pragma unroll
    for (int v = 0; v < V; ++v) {
#pragma unroll
      for (int i = 0; i < x_words / 4; ++i) {
        x_regs[v][i] =
            reinterpret_cast<const uint4*>(x_tile + v * stage_words)[i];
      }
    }
#pragma unroll
    for (int j = 0; j < rows_per_warp; ++j) {
      int jr = cuda::std::min(j, n - 1 - row);
      S scale = scales[jr * groups_per_row + idx / group_size];
      T bias{0};
      if constexpr (has_bias) {
        bias = biases[jr * groups_per_row + idx / group_size];
      }
      dequant_fma_streamed<V, elems_per_thread, has_bias>(
          reinterpret_cast<const T*>(x_regs),
          static_cast<int64_t>(elems_per_thread),
          w + jr * w_step(k) + w_step(idx),
          scale,
          bias,
          sums[j],
          V);
    }
  };

  constexpr int elems_per_warp = WARP_SIZE * elems_per_thread;
  // Each warp's tiles for `count` staged k steps from r0, in order, with no
  // branch between tiles.
  auto compute_stage = [&](const uint32_t* buf, int r0, auto count) {
    if (row_active) {
#pragma unroll
      for (int s = 0; s < decltype(count)::value; ++s) {
        int idx =
            warp.thread_rank() * elems_per_thread + (r0 + s) * elems_per_warp;
        dequant_fma_tile(idx, x_slice(buf, s));
      }
    }
  };
  using sync_copy = cuda::std::false_type;
  using full_stage = cuda::std::integral_constant<int, stage_steps>;
  using one_step = cuda::std::integral_constant<int, 1>;
  // Full stages, then the rest one step at a time: r = 0, 1, ..., steps - 1.
  int steps = k / elems_per_warp;
  int r0 = 0;
  if constexpr (async_x) {
    int full = steps / stage_steps;
    if (full > 0) {
      stage_x(xs, 0, stage_steps * elems_per_warp, cuda::std::true_type{});
    }
    cp_async_commit();
    for (int i = 0; i < full; ++i, r0 += stage_steps) {
      if (i + 1 < full) {
        stage_x(
            xs + ((i + 1) % 2) * buffer_words,
            (r0 + stage_steps) * elems_per_warp,
            stage_steps * elems_per_warp,
            cuda::std::true_type{});
      }
      cp_async_commit();
      cp_async_wait<1>();
      __syncthreads();
      compute_stage(xs + (i % 2) * buffer_words, r0, full_stage{});
      __syncthreads();
    }
  } else {
    for (; r0 + stage_steps <= steps; r0 += stage_steps) {
      stage_x(
          xs, r0 * elems_per_warp, stage_steps * elems_per_warp, sync_copy{});
      __syncthreads();
      compute_stage(xs, r0, full_stage{});
      __syncthreads();
    }
  }
  for (; r0 < steps; ++r0) {
    stage_x(xs, r0 * elems_per_warp, elems_per_warp, sync_copy{});
    __syncthreads();
    compute_stage(xs, r0, one_step{});
    __syncthreads();
  }

  if constexpr (has_residue_k) {
    int rest = k % elems_per_warp;
    int idx = warp.thread_rank() * elems_per_thread + k - rest;
    stage_x(xs, k - rest, rest, sync_copy{});
    __syncthreads();
    if (row_active && idx < k) {
      dequant_fma_tile(idx, x_slice(xs, 0));
    }
  }

  // Past the last barrier: warps without a row may leave now.
  if (!row_active) {
    return;
  }

#pragma unroll
  for (int j = 0; j < rows_per_warp; ++j) {
#pragma unroll
    for (int v = 0; v < V; ++v) {
      if (v < nv && row + j < n) {
        float sum{0};
#pragma unroll
        for (int i = 0; i < elems_per_thread; ++i) {
          sum += sums[j][v][i];
        }
        sum = cg::reduce(warp, sum, cg::plus<float>{});
        if (warp.thread_rank() == 0) {
          if constexpr (
              cuda::std::is_same_v<Q, cutlass::float_e2m1_t> &&
              cuda::std::is_same_v<S, cutlass::float_e4m3_t>) {
            if (global_scale) {
              sum *= (*global_scale / (F8E4M3_MAX * F4E2M1_MAX));
            }
          }
          out[static_cast<int64_t>(v) * n + row + j] = static_cast<T>(sum);
        }
      }
    }
  }
}

// Block x enumerates (row block, M tile) with the M tile fastest, so the
// blocks that share one weight tile run side by side and the second and later
// ones find it in L2. m is passed in: the grid no longer says what M is.
template <
    int V,
    int rows_per_block,
    int elems_per_thread,
    int group_size,
    bool has_bias,
    bool has_residue_k,
    typename T,
    typename Q,
    typename S,
    int max_stage_steps = 4,
    int rows_per_warp = 1,
    bool l2_prefetch = false,
    bool x_async = false>
__device__ __forceinline__ void qmv_streamed_kernel_body(
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
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<WARP_SIZE>(block);

  int m_tiles = (m + V - 1) / V;
  int tile = block.group_index().x % m_tiles;
  int row = (block.group_index().x / m_tiles) * rows_per_block +
      warp.meta_group_rank() * rows_per_warp;
  // No early return here: rows past n take part in x staging and barriers.

  int l = block.group_index().z;
  int v0 = tile * V;
  x += static_cast<int64_t>(v0) * k + static_cast<int64_t>(m) * k * l;
  out += static_cast<int64_t>(v0) * n + static_cast<int64_t>(m) * n * l;
  int w_batch = broadcast_w ? 0 : l;

  qmv_streamed_kernel_impl<
      V,
      rows_per_block,
      rows_per_warp,
      max_stage_steps,
      l2_prefetch,
      x_async,
      elems_per_thread,
      group_size,
      has_bias,
      has_residue_k>(
      x,
      w,
      scales,
      biases,
      global_scale,
      out,
      row,
      w_batch,
      n,
      k,
      cuda::std::min(V, m - v0));
}

template <
    int V,
    int rows_per_block,
    int rows_per_warp,
    int elems_per_thread,
    int group_size,
    bool has_bias,
    bool has_residue_k,
    typename T,
    typename Q,
    typename S>
__global__ void qmv_streamed_kernel(
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
  // From sm_80 on, x stages of 4 k steps are copied with cp.async while the
  // previous one is computed. Below it the copies are plain and a stage is one
  // k step: the same tiles in the same order, and a fraction of the unrolled
  // code for ptxas to compile.
#if defined(MLX_CUDA_SM_80_ENABLED)
  constexpr int max_stage_steps = 4;
#else
  constexpr int max_stage_steps = 1;
#endif
  qmv_streamed_kernel_body<
      V,
      rows_per_block,
      elems_per_thread,
      group_size,
      has_bias,
      has_residue_k,
      T,
      Q,
      S,
      max_stage_steps,
      rows_per_warp,
      /* l2_prefetch */ true,
      /* x_async */ true>(
      x, w, scales, biases, global_scale, out, m, n, k, broadcast_w);
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
    F&& launch_kernel) {
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

// Below this many weights (n * k), M = 2..7 keep the per-vector kernel: with
// the weights read from HBM, as in decoding, a 1024 x 1024 layer's streamed
// kernel took 1.2-2.2x stock's time on an H200 (128 blocks for 132 SMs; one
// row per warp in blocks of 8 warps, as qmv has, did not close the gap). From
// 2**24 weights up it took 0.34-0.90 of stock's time at every M = 2..7.
constexpr int64_t qmv_streamed_min_weights = 16777216;

// M = 5..7 of one batch as several passes: a V = 4 pass, then a V = 2 pass
// and/or the per-vector qmv for the last vector (5 = 4 + 1, 6 = 4 + 2,
// 7 = 4 + 2 + 1), where two V = 4 tiles would run the second partly on vectors
// that are not there. 4-bit at M = 7 keeps the two tiles (one slot idle, one
// launch), which timed faster than three passes. Several kernels for one call:
// the caller holds the encoder's concurrent context.
inline bool qmv_streamed_splits(int m, int l, int bits) {
  return l == 1 && (m == 5 || m == 6 || (m == 7 && bits == 8));
}

// Which M >= 2 stream. Streamed or per-vector, every row equals M = 1's bit for
// bit; this is only about speed. 4-bit streams at every M; 8-bit at M = 2..4 in
// one weight pass and at M = 5..7 in several (qmv_streamed_splits: as two V = 4
// tiles it was no faster than stock). The other widths keep the per-vector
// kernel. M >= 8 only arrives through the opt-in exact route of quantized.cpp.
inline bool use_qmv_streamed(int m, int n, int k, int l, int bits) {
  if (m >= 8) {
    return true;
  }
  if (static_cast<int64_t>(n) * k < qmv_streamed_min_weights) {
    return false;
  }
  return m >= 2 &&
      (bits == 4 || (bits == 8 && (m <= 4 || qmv_streamed_splits(m, l, bits))));
}

template <
    int group_size,
    bool has_bias,
    typename T,
    typename Q,
    typename S,
    typename F>
void qmv_streamed(
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
  // The same tiling as qmv, so each vector's per-thread order is qmv's.
  // Which warp computes a row, where x is read from and when the weights are
  // fetched do not change any row's order; the shape below (4 warps of 2 rows,
  // V <= 4, x staged in shared memory, L2 prefetch) only sets the speed.
  constexpr int rows_per_warp = 2;
  constexpr int rows_per_block = 8;
  constexpr int elems_per_thread =
      (cute::sizeof_bits_v<T> <= 16 && cute::sizeof_bits_v<Q> <= 4) ? 16 : 8;

  auto launch = [&](auto vecs) {
    constexpr int V = decltype(vecs)::value;
    int m_tiles = cuda::ceil_div(m, V);
    dim3 num_blocks{
        uint32_t(cuda::ceil_div(n, rows_per_block) * m_tiles), 1, uint32_t(l)};
    dim3 block_dims{WARP_SIZE, rows_per_block / rows_per_warp};
    void* args[] = {
        &x,
        &w,
        &scales,
        &biases,
        &global_scale,
        &out,
        &m,
        &n,
        &k,
        &broadcast_w};
    dispatch_bool(k % (WARP_SIZE * elems_per_thread), [&](auto has_residue_k) {
      auto* kernel = &qmv_streamed_kernel<
          V,
          rows_per_block,
          rows_per_warp,
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
  };

  if (qmv_streamed_splits(m, l, cute::sizeof_bits_v<Q>)) {
    // Each launch copies its arguments when it is added.
    int rest = m - 4;
    m = 4;
    launch(cuda::std::integral_constant<int, 4>{});
    x += 4 * static_cast<int64_t>(k);
    out += 4 * static_cast<int64_t>(n);
    if (rest >= 2) {
      m = 2;
      launch(cuda::std::integral_constant<int, 2>{});
      x += 2 * static_cast<int64_t>(k);
      out += 2 * static_cast<int64_t>(n);
      rest -= 2;
    }
    if (rest == 1) {
      qmv<group_size, has_bias>(
          x,
          w,
          scales,
          biases,
          global_scale,
          out,
          1,
          n,
          k,
          1,
          broadcast_w,
          launch_kernel);
    }
    return;
  }

  if (m <= 2) {
    launch(cuda::std::integral_constant<int, 2>{});
    return;
  }
  launch(cuda::std::integral_constant<int, 4>{});
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
          if (cu::use_qmv_streamed(m, n, k, l, bits)) {
            // Several kernels for one call: the concurrent context gives each
            // of them the arrays registered above as dependencies, and joins
            // them before out is read.
            std::optional<cu::CommandEncoder::ConcurrentContext> concurrent;
            if (cu::qmv_streamed_splits(m, l, bits)) {
              concurrent.emplace(encoder);
            }
            cu::qmv_streamed<group_size, has_bias>(
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
                [&](auto* kernel,
                    dim3 num_blocks,
                    dim3 block_dims,
                    void** args) {
                  encoder.add_kernel_node_raw(
                      kernel, num_blocks, block_dims, {}, 0, args);
                });
            return;
          }
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
