// patchkit: grid runner for the extracted kernels. Appended, after the shim
// and the kernel source, to each translation unit the emulator builds; the
// PATCHKIT_COMBOS list (type, dtype code, group size, bits) is prepended by
// the build step, which also defines one PATCHKIT_HAS_<kind> per kernel kind
// the source holds.

namespace patchkit {

struct Problem {
  const uint32_t* w;
  const void* scales;
  const void* biases;
  const void* x;
  void* y;
  int K, N, M, B;
};

template <typename T, int group_size, int bits, bool batched>
struct Launcher : BatchLayout {
  const Problem& p;
  const uint32_t* w;
  const T* s;
  const T* b;
  const T* x;
  T* y;

  explicit Launcher(const Problem& p_)
      : BatchLayout(p_.B, p_.M, p_.N, p_.K, bits, group_size),
        p(p_),
        w(p_.w),
        s(static_cast<const T*>(p_.scales)),
        b(static_cast<const T*>(p_.biases)),
        x(static_cast<const T*>(p_.x)),
        y(static_cast<T*>(p_.y)) {}

  // M = 1 kernels (qmv_fast, qmv): grid (M, ceil(N / 8), B), as qmv dispatches.
  template <typename F>
  void per_vector(F f) {
    launch_grid(p.B, p.M, (p.N + 7) / 8, [&](uint3 tid, uint sg, uint lane) {
      f(w, s, b, x, y, p.K, p.N, x_batch_ndims, x_shape, x_strides, w_batch_ndims,
        w_shape, w_strides, s_strides, b_strides, tid, sg, lane);
    });
  }

  // Kernels that stream V vectors per threadgroup: grid (ceil(M / V), ceil(N / rows), B).
  template <typename F>
  void streamed(int V, int rows_per_tg, F f) {
    launch_grid(p.B, (p.M + V - 1) / V, (p.N + rows_per_tg - 1) / rows_per_tg,
              [&](uint3 tid, uint sg, uint lane) {
                f(w, s, b, x, y, p.K, p.N, p.M, x_batch_ndims, x_shape, x_strides,
                  w_batch_ndims, w_shape, w_strides, s_strides, b_strides, tid, sg, lane);
              });
  }
};

template <typename T, int gs, int bits, bool batched, int V>
int run_v(int kind, const Problem& p) {
  Launcher<T, gs, bits, batched> l(p);
  switch (kind) {
#ifdef PATCHKIT_HAS_qmv_wide
    case 2:  // k_lanes 8 as the affine dispatch sets it: 4 rows per simdgroup.
      l.streamed(V, 8, affine_qmv_wide<T, gs, bits, V, 8, batched>);
      return 0;
#endif
#ifdef PATCHKIT_HAS_qmv_fast_streamed
    case 3:
      l.streamed(V, 8, affine_qmv_fast_streamed<T, gs, bits, V, batched>);
      return 0;
#endif
#ifdef PATCHKIT_HAS_qmv_streamed
    case 4:
      l.streamed(V, 8, affine_qmv_streamed<T, gs, bits, V, batched>);
      return 0;
#endif
    default:
      return 2;
  }
}

template <typename T, int gs, int bits, bool batched>
int run_batched(int kind, int V, const Problem& p) {
  Launcher<T, gs, bits, batched> l(p);
  if (kind == 0) {
#ifdef PATCHKIT_HAS_qmv_fast
    l.per_vector(affine_qmv_fast<T, gs, bits, batched>);
    return 0;
#endif
  } else if (kind == 1) {
#ifdef PATCHKIT_HAS_qmv
    l.per_vector(affine_qmv<T, gs, bits, batched>);
    return 0;
#endif
  } else {
    switch (V) {
      case 2:
        return run_v<T, gs, bits, batched, 2>(kind, p);
      case 3:
        return run_v<T, gs, bits, batched, 3>(kind, p);
      case 4:
        return run_v<T, gs, bits, batched, 4>(kind, p);
      case 5:
        return run_v<T, gs, bits, batched, 5>(kind, p);
    }
  }
  return 2;
}

}  // namespace patchkit

// Returns 0 on success, 1 on a runtime error (message in err), 2 when the
// requested combination is not compiled into this library.
extern "C" int pk_run(
    int dtype, int gs, int bits, int kind, int V, int B, int M, int N, int K,
    const void* w, const void* scales, const void* biases, const void* x,
    void* y, char* err, int err_len) {
  patchkit::Problem p{static_cast<const uint32_t*>(w), scales, biases, x, y, K, N, M, B};
  try {
#define PATCHKIT_COMBO(T, code, G, BITS)                                     \
  if (dtype == code && gs == G && bits == BITS) {                            \
    return B > 1 ? patchkit::run_batched<T, G, BITS, true>(kind, V, p)       \
                 : patchkit::run_batched<T, G, BITS, false>(kind, V, p);     \
  }
    PATCHKIT_COMBOS
#undef PATCHKIT_COMBO
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return 1;
  }
  return 2;
}
