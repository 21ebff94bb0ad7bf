// patchkit: grid runner for the extracted kernels of one family. Appended, after
// the shim and the kernel source, to each translation unit the emulator builds.
// The build step prepends PATCHKIT_FAMILY_<AFFINE|FP>, one PATCHKIT_HAS_<role>
// per kernel the source holds (roles: qmv_fast, qmv, qmv_wide,
// qmv_fast_streamed, qmv_streamed) and the PATCHKIT_COMBOS list (type, dtype
// code, group size, bits).
//
// The families' kernels take the same grid and differ only in their buffers
// and template arguments, so each family is the block of names below and the
// rest of the runner is shared.

namespace patchkit {

// Host buffers as the kernels' address spaces (identities unless the
// address-space check defines device and constant).
template <typename P>
auto dev(P* p) {
  return (device P*)p;
}
template <typename V>
const constant V& cst(const V& v) {
  return *(const constant V*)&v;
}
template <typename V>
const constant V* cstp(const V* v) {
  return (const constant V*)v;
}

#if defined(PATCHKIT_FAMILY_FP)
// fp_quantized.h: scales are e8m0/e4m3 bytes, the third buffer is nvfp4's
// global scale (one float), and there are no biases (no bias strides).
template <typename T>
using Scale = uint8_t;
template <typename T>
using Aux = float;
#define PATCHKIT_SCALE_STRIDES cstp(s_strides)
// The global scale and the narrow fast tile exist for nvfp4 (group size 16)
// only, as MLX uses them; other modes compile just the plain variant.
constexpr bool has_variants(int group_size) {
  return group_size == 16;
}
#define PATCHKIT_QMV_FAST upstream::fp_qmv_fast<T, gs, bits, batched, hgs, rps>
#define PATCHKIT_QMV upstream::fp_qmv<T, gs, bits, batched, hgs>
// k_lanes 16 as the fp dispatch sets it: 2 rows per simdgroup; fp_qmv_wide
// takes no global scale buffer.
#define PATCHKIT_QMV_WIDE upstream::fp_qmv_wide<T, gs, bits, V, 16, batched>
#define PATCHKIT_WIDE_ROWS 4
#define PATCHKIT_WIDE_OPERANDS l.w, l.s
// The patched M = 1 kernels at vecs_per_tg = V, as MLX instantiates them: the
// full output tile (results_per_simdgroup 4) whatever tile M = 1 takes.
#define PATCHKIT_QMV_FAST_STREAMED patched::fp_qmv_fast<T, gs, bits, batched, hgs, 4, V>
#define PATCHKIT_QMV_STREAMED patched::fp_qmv<T, gs, bits, batched, hgs, V>
#else
// quantized.h (affine): scales and biases in T.
template <typename T>
using Scale = T;
template <typename T>
using Aux = T;
#define PATCHKIT_SCALE_STRIDES cstp(s_strides), cstp(b_strides)
constexpr bool has_variants(int) {
  return false;
}
#define PATCHKIT_QMV_FAST upstream::affine_qmv_fast<T, gs, bits, batched>
#define PATCHKIT_QMV upstream::affine_qmv<T, gs, bits, batched>
// k_lanes 8 as the affine dispatch sets it: 4 rows per simdgroup.
#define PATCHKIT_QMV_WIDE upstream::affine_qmv_wide<T, gs, bits, V, 8, batched>
#define PATCHKIT_WIDE_ROWS 8
#define PATCHKIT_WIDE_OPERANDS l.w, l.s, l.aux
#define PATCHKIT_QMV_FAST_STREAMED patched::affine_qmv_fast<T, gs, bits, batched, false, V>
#define PATCHKIT_QMV_STREAMED patched::affine_qmv<T, gs, bits, batched, false, V>
#endif
#define PATCHKIT_OPERANDS l.w, l.s, l.aux

struct Problem {
  const uint32_t* w;
  const void* scales;
  const void* aux;  // affine: biases; fp: the global scale
  const void* x;
  void* y;
  int K, N, M, B;
  // Batch shape (batch_ndims dimensions, product B) and the bitmask of batch
  // dimensions along which the weights are shared (BatchLayout).
  const int* batch;
  int batch_ndims;
  int w_shared;
};

template <typename T, int group_size, int bits>
struct Launcher : BatchLayout {
  const Problem& p;
  const uint32_t* w;
  const Scale<T>* s;
  const Aux<T>* aux;
  const T* x;
  T* y;

  // BatchLayout's s_strides count scale elements (bytes for the fp modes).
  explicit Launcher(const Problem& p_)
      : BatchLayout(p_.batch, p_.batch_ndims, p_.w_shared, p_.M, p_.N, p_.K, bits, group_size),
        p(p_),
        w(p_.w),
        s(static_cast<const Scale<T>*>(p_.scales)),
        aux(static_cast<const Aux<T>*>(p_.aux)),
        x(static_cast<const T*>(p_.x)),
        y(static_cast<T*>(p_.y)) {}

  // Grid (ceil(M / V), ceil(N / rows_per_tg), prod(batch)). The M = 1 kernels run with
  // V = 1 (qmv's grid of M); qmv_wide takes M as an argument (takes_m).
  template <bool takes_m, typename F, typename... Operands>
  void launch(int V, int rows_per_tg, F f, Operands... ops) {
    launch_grid(batches, (p.M + V - 1) / V, (p.N + rows_per_tg - 1) / rows_per_tg,
                [&](uint3 tid, uint sg, uint lane) {
                  if constexpr (takes_m) {
                    f(dev(ops)..., dev(x), dev(y), cst(p.K), cst(p.N), cst(p.M),
                      cst(x_batch_ndims), cstp(x_shape), cstp(x_strides), cst(w_batch_ndims),
                      cstp(w_shape), cstp(w_strides), PATCHKIT_SCALE_STRIDES, tid, sg, lane);
                  } else {
                    f(dev(ops)..., dev(x), dev(y), cst(p.K), cst(p.N), cst(x_batch_ndims),
                      cstp(x_shape), cstp(x_strides), cst(w_batch_ndims), cstp(w_shape),
                      cstp(w_strides), PATCHKIT_SCALE_STRIDES, tid, sg, lane);
                  }
                });
  }
};

// Kernel kinds: 0 qmv_fast, 1 qmv, 2 qmv_wide, 3 qmv_fast_streamed,
// 4 qmv_streamed (each with the family's prefix). rps is results_per_simdgroup
// (4, or 2 for nvfp4's narrow fast tile); threadgroups cover 2 * rps rows.
template <typename T, int gs, int bits, bool batched, bool hgs, int rps, int V>
int run_v(int kind, const Problem& p) {
  Launcher<T, gs, bits> l(p);
  switch (kind) {
#ifdef PATCHKIT_HAS_qmv_wide
    case 2:
      if constexpr (!hgs && rps == 4) {
        l.template launch<true>(V, PATCHKIT_WIDE_ROWS, PATCHKIT_QMV_WIDE, PATCHKIT_WIDE_OPERANDS);
        return 0;
      }
      return 2;
#endif
// The patched kernels read M as x_shape[x_batch_ndims], as MLX's host sets it.
#ifdef PATCHKIT_HAS_qmv_fast_streamed
    case 3:
      l.template launch<false>(V, 8, PATCHKIT_QMV_FAST_STREAMED, PATCHKIT_OPERANDS);
      return 0;
#endif
#ifdef PATCHKIT_HAS_qmv_streamed
    case 4:
      if constexpr (rps == 4) {
        l.template launch<false>(V, 8, PATCHKIT_QMV_STREAMED, PATCHKIT_OPERANDS);
        return 0;
      }
      return 2;
#endif
    default:
      return 2;
  }
}

template <typename T, int gs, int bits, bool batched, bool hgs, int rps>
int run_kind(int kind, int V, const Problem& p) {
  Launcher<T, gs, bits> l(p);
  if (kind == 0) {
#ifdef PATCHKIT_HAS_qmv_fast
    l.template launch<false>(1, 2 * rps, PATCHKIT_QMV_FAST, PATCHKIT_OPERANDS);
    return 0;
#endif
  } else if (kind == 1) {
#ifdef PATCHKIT_HAS_qmv
    if constexpr (rps == 4) {
      l.template launch<false>(1, 8, PATCHKIT_QMV, PATCHKIT_OPERANDS);
      return 0;
    }
#endif
  } else {
    switch (V) {
      case 2:
        return run_v<T, gs, bits, batched, hgs, rps, 2>(kind, p);
      case 3:
        return run_v<T, gs, bits, batched, hgs, rps, 3>(kind, p);
      case 4:
        return run_v<T, gs, bits, batched, hgs, rps, 4>(kind, p);
      case 5:
        return run_v<T, gs, bits, batched, hgs, rps, 5>(kind, p);
    }
  }
  return 2;
}

template <typename T, int gs, int bits, bool batched>
int run_variant(int kind, int V, int hgs, int rps, const Problem& p) {
  if constexpr (has_variants(gs)) {
    if (hgs && rps == 2) {
      return run_kind<T, gs, bits, batched, true, 2>(kind, V, p);
    }
    if (hgs) {
      return run_kind<T, gs, bits, batched, true, 4>(kind, V, p);
    }
    if (rps == 2) {
      return run_kind<T, gs, bits, batched, false, 2>(kind, V, p);
    }
  }
  if (hgs || rps != 4) {
    return 2;
  }
  return run_kind<T, gs, bits, batched, false, 4>(kind, V, p);
}

}  // namespace patchkit

// batch (batch_ndims ints, product B) and w_shared describe a multi-dimensional
// batch (BatchLayout); batch_ndims 0 is one dimension of B. With a non-null
// record (room for record_cap SumRecords) every simd_sum call of the launch is
// recorded there and *record_count says how many.
// Returns 0 on success, 1 on a runtime error (message in err), 2 when the
// requested combination is not compiled into this library.
extern "C" int pk_run(
    int dtype, int gs, int bits, int kind, int V, int hgs, int rps, int B, int M, int N,
    int K, const void* w, const void* scales, const void* aux, const void* x, void* y,
    const int* batch, int batch_ndims, int w_shared, void* record, int record_cap,
    int* record_count, char* err, int err_len) {
  // No batch shape: one batch dimension of B.
  patchkit::Problem p{static_cast<const uint32_t*>(w), scales, aux, x, y, K, N, M, B,
                      batch_ndims ? batch : &B, batch_ndims ? batch_ndims : 1, w_shared};
  patchkit::SumRecorder recorder{static_cast<patchkit::SumRecord*>(record), record_cap};
  // Installed for this launch only, and removed however it ends.
  struct Install {
    explicit Install(patchkit::SumRecorder* r) {
      patchkit::sum_recorder = r;
    }
    ~Install() {
      patchkit::sum_recorder = nullptr;
    }
  } install(record != nullptr ? &recorder : nullptr);
  struct Count {
    patchkit::SumRecorder& r;
    int* out;
    ~Count() {
      if (out != nullptr) {
        *out = r.count;
      }
    }
  } count{recorder, record_count};
  try {
#define PATCHKIT_COMBO(T, code, G, BITS)                                                \
  if (dtype == code && gs == G && bits == BITS) {                                       \
    return B > 1 ? patchkit::run_variant<T, G, BITS, true>(kind, V, hgs, rps, p)        \
                 : patchkit::run_variant<T, G, BITS, false>(kind, V, hgs, rps, p);      \
  }
    PATCHKIT_COMBOS
#undef PATCHKIT_COMBO
  } catch (const std::exception& e) {
    std::snprintf(err, err_len, "%s", e.what());
    return 1;
  }
  return 2;
}

#if defined(PATCHKIT_FAMILY_FP)
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
#endif
