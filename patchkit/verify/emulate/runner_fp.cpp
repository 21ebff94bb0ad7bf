// patchkit: grid runner for the extracted fp kernels (fp_quantized.h), the fp
// twin of runner.cpp. Appended, after the shim and the kernel source, to each
// translation unit the emulator builds for the fp modes; PATCHKIT_COMBOS
// (type, dtype code, group size, bits) and PATCHKIT_HAS_<kind> are prepended
// by the build step. Uses the shim's launch_grid() as runner.cpp does.

namespace patchkit {

struct FpProblem {
  const uint32_t* w;
  const uint8_t* scales;
  const float* global_scale;
  const void* x;
  void* y;
  int K, N, M, B;
};

template <typename T, int group_size, int bits>
struct FpLauncher : BatchLayout {
  const FpProblem& p;
  const uint32_t* w;
  const uint8_t* s;
  const float* gs;
  const T* x;
  T* y;

  // Scales are bytes here, one per group; BatchLayout's s_strides count them.
  explicit FpLauncher(const FpProblem& p_)
      : BatchLayout(p_.B, p_.M, p_.N, p_.K, bits, group_size),
        p(p_),
        w(p_.w),
        s(p_.scales),
        gs(p_.global_scale),
        x(static_cast<const T*>(p_.x)),
        y(static_cast<T*>(p_.y)) {}

  // M = 1 kernels (fp_qmv_fast, fp_qmv): grid (M, ceil(N / rows_per_tg), B).
  template <typename F>
  void per_vector(int rows_per_tg, F f) {
    launch_grid(p.B, p.M, (p.N + rows_per_tg - 1) / rows_per_tg, [&](uint3 tid, uint sg, uint lane) {
      f(w, s, gs, x, y, p.K, p.N, x_batch_ndims, x_shape, x_strides, w_batch_ndims, w_shape,
        w_strides, s_strides, tid, sg, lane);
    });
  }

  // The streamed kernels: grid (ceil(M / V), ceil(N / rows_per_tg), B).
  template <typename F>
  void streamed(int V, int rows_per_tg, F f) {
    launch_grid(p.B, (p.M + V - 1) / V, (p.N + rows_per_tg - 1) / rows_per_tg,
              [&](uint3 tid, uint sg, uint lane) {
                f(w, s, gs, x, y, p.K, p.N, p.M, x_batch_ndims, x_shape, x_strides,
                  w_batch_ndims, w_shape, w_strides, s_strides, tid, sg, lane);
              });
  }

  // fp_qmv_wide takes no global scale buffer.
  template <typename F>
  void wide(int V, int rows_per_tg, F f) {
    launch_grid(p.B, (p.M + V - 1) / V, (p.N + rows_per_tg - 1) / rows_per_tg,
              [&](uint3 tid, uint sg, uint lane) {
                f(w, s, x, y, p.K, p.N, p.M, x_batch_ndims, x_shape, x_strides, w_batch_ndims,
                  w_shape, w_strides, s_strides, tid, sg, lane);
              });
  }
};

// Kernel kinds: 0 fp_qmv_fast, 1 fp_qmv, 2 fp_qmv_wide, 3 fp_qmv_fast_streamed,
// 4 fp_qmv_streamed. rps is results_per_simdgroup (4, or 2 for the narrow
// fast tile); threadgroups cover 2 * rps rows.
template <typename T, int gs, int bits, bool batched, bool hgs, int rps, int V>
int run_fp_v(int kind, const FpProblem& p) {
  FpLauncher<T, gs, bits> l(p);
  switch (kind) {
#ifdef PATCHKIT_HAS_fp_qmv_wide
    case 2:  // k_lanes 16 as the fp dispatch sets it: 2 rows per simdgroup.
      if constexpr (!hgs && rps == 4) {
        l.wide(V, 4, fp_qmv_wide<T, gs, bits, V, 16, batched>);
        return 0;
      }
      return 2;
#endif
#ifdef PATCHKIT_HAS_fp_qmv_fast_streamed
    case 3:
      l.streamed(V, 2 * rps, fp_qmv_fast_streamed<T, gs, bits, V, batched, hgs, rps>);
      return 0;
#endif
#ifdef PATCHKIT_HAS_fp_qmv_streamed
    case 4:
      if constexpr (rps == 4) {
        l.streamed(V, 8, fp_qmv_streamed<T, gs, bits, V, batched, hgs>);
        return 0;
      }
      return 2;
#endif
    default:
      return 2;
  }
}

template <typename T, int gs, int bits, bool batched, bool hgs, int rps>
int run_fp_kind(int kind, int V, const FpProblem& p) {
  FpLauncher<T, gs, bits> l(p);
  if (kind == 0) {
#ifdef PATCHKIT_HAS_fp_qmv_fast
    l.per_vector(2 * rps, fp_qmv_fast<T, gs, bits, batched, hgs, rps>);
    return 0;
#endif
  } else if (kind == 1) {
#ifdef PATCHKIT_HAS_fp_qmv
    if constexpr (rps == 4) {
      l.per_vector(8, fp_qmv<T, gs, bits, batched, hgs>);
      return 0;
    }
#endif
  } else {
    switch (V) {
      case 2:
        return run_fp_v<T, gs, bits, batched, hgs, rps, 2>(kind, p);
      case 3:
        return run_fp_v<T, gs, bits, batched, hgs, rps, 3>(kind, p);
      case 4:
        return run_fp_v<T, gs, bits, batched, hgs, rps, 4>(kind, p);
      case 5:
        return run_fp_v<T, gs, bits, batched, hgs, rps, 5>(kind, p);
    }
  }
  return 2;
}

// The global scale and the narrow tile exist for nvfp4 (group size 16) only,
// as MLX uses them; other modes compile just the plain variants.
template <typename T, int gs, int bits, bool batched>
int run_fp_batched(int kind, int V, int hgs, int rps, const FpProblem& p) {
  if constexpr (gs == 16) {
    if (hgs && rps == 2) {
      return run_fp_kind<T, gs, bits, batched, true, 2>(kind, V, p);
    }
    if (hgs) {
      return run_fp_kind<T, gs, bits, batched, true, 4>(kind, V, p);
    }
    if (rps == 2) {
      return run_fp_kind<T, gs, bits, batched, false, 2>(kind, V, p);
    }
  }
  if (hgs || rps != 4) {
    return 2;
  }
  return run_fp_kind<T, gs, bits, batched, false, 4>(kind, V, p);
}

}  // namespace patchkit

// Returns 0 on success, 1 on a runtime error (message in err), 2 when the
// requested combination is not compiled into this library.
extern "C" int pk_run_fp(
    int dtype, int gs, int bits, int kind, int V, int hgs, int rps, int B, int M, int N,
    int K, const void* w, const void* scales, const void* global_scale, const void* x,
    void* y, char* err, int err_len) {
  patchkit::FpProblem p{static_cast<const uint32_t*>(w), static_cast<const uint8_t*>(scales),
                        static_cast<const float*>(global_scale), x, y, K, N, M, B};
  try {
#define PATCHKIT_COMBO(T, code, G, BITS)                                                 \
  if (dtype == code && gs == G && bits == BITS) {                                        \
    return B > 1 ? patchkit::run_fp_batched<T, G, BITS, true>(kind, V, hgs, rps, p)      \
                 : patchkit::run_fp_batched<T, G, BITS, false>(kind, V, hgs, rps, p);    \
  }
    PATCHKIT_COMBOS
#undef PATCHKIT_COMBO
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return 1;
  }
  return 2;
}

// The fp types' decode as compiled here (fp4.h / fp8.h from the wheel, under
// the shim), for the test that checks it against the OCP MX spec:
// kind 0 fp4_e2m1, 1 fp8_e4m3, 2 fp8_e8m0 (as float).
extern "C" float pk_fp_decode(int kind, int byte) {
  uint8_t b = static_cast<uint8_t>(byte);
  if (kind == 0) {
    return float(*reinterpret_cast<fp4_e2m1*>(&b));
  }
  if (kind == 1) {
    return float(*reinterpret_cast<fp8_e4m3*>(&b));
  }
  return float(*reinterpret_cast<fp8_e8m0*>(&b));
}
