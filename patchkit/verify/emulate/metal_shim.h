// patchkit: a host shim for the subset of the Metal Shading Language that MLX's
// quantized matrix-vector kernels use, so their real source compiles as C++
// and runs on the CPU.
//
// What it models, and how:
// - Address-space words (device, thread, constant, threadgroup) expand to
//   nothing, except under PATCHKIT_ADDRESS_SPACES (the clang syntax check). The standard headers are included first: `thread` as an empty
//   macro would otherwise break <thread>.
// - half and bfloat16_t are 16-bit storage types. Every arithmetic operation
//   between two of them is done in float and rounded once to the narrow type
//   (round to nearest even); since float carries more than twice their
//   precision plus two bits, this equals a correctly rounded narrow operation.
//   half <-> float uses the hardware conversion where the host has one (x86
//   F16C, aarch64 __fp16): straight-line code, as on the GPU. A branchy
//   software conversion splits the fp kernels' weight decode into basic
//   blocks, and g++ fuses a multiply with an add only inside one block, so
//   under cross-statement contraction it fused different products in the
//   M = 1 and streamed kernels (measured: mxfp4 float32 rows differed).
//   Mixed narrow/float arithmetic promotes to float, as in Metal.
// - A simdgroup is 32 lanes run as fibers on one OS thread, in lock step at
//   each cross-lane operation: every lane runs until it reaches simd_sum or
//   simd_shuffle_down, then the operation is evaluated for all 32 lanes at
//   once. simd_sum uses one fixed reduction tree for every kernel (a butterfly:
//   v[l] += v[l ^ d] for d = 16, 8, 4, 2, 1), so two kernels agree exactly when
//   they hand simd_sum identical per-lane values, which is the property the
//   parity suite checks. Lanes that reach different cross-lane operations are
//   reported as an error rather than guessed at.
// - Recording (SumRecorder): while a recorder is installed on the OS thread,
//   every simd_sum call appends the 32 per-lane values it was handed, its
//   result, and where it ran: the threadgroup (tid), the simdgroup and the
//   call's index within that simdgroup. The parity suite turns that into the
//   (batch, vector, output row) the call produces (sums.py) and compares the
//   32 inputs of the streamed and the M = 1 kernel bit for bit: equal inputs
//   give equal results under any reduction tree.
#pragma once

#include <setjmp.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#endif

// ---- Metal words -----------------------------------------------------------
#if defined(PATCHKIT_ADDRESS_SPACES)
// The address-space check (clang -fsyntax-only, build.check_address_spaces):
// Metal's address spaces as clang's, so a pointer handed to a parameter in
// another address space (thread -> device, say) is a compile error naming
// the line, as it is for Metal's compiler. `thread` is the generic space.
#define device __attribute__((address_space(1)))
#define constant __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define thread
#else
#define device
#define thread
#define constant
#define threadgroup
#endif
#define METAL_FUNC inline
#define MLX_MTL_CONST static constexpr const

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned long ulong;

struct uint3 {
  uint x, y, z;
};
struct ulong2 {
  ulong x, y;
};
struct ulong3 {
  ulong x, y, z;
};

using std::max;
using std::min;

template <typename T>
inline T clamp(T x, T lo, T hi) {
  return std::min(std::max(x, lo), hi);
}

// ---- 16-bit float types ----------------------------------------------------
struct half_traits {
#if defined(__F16C__)
  // The x86 conversion instructions (round to nearest even): straight-line
  // code, as on the GPU, so the conversions add no branches for a compiler's
  // basic-block-local contraction to trip over (g++ forms a fused multiply-add
  // only when the multiply and the add share a basic block).
  static uint16_t from_float(float f) {
    return _cvtss_sh(f, 0);
  }
  static float to_float(uint16_t b) {
    return _cvtsh_ss(b);
  }
#elif defined(__aarch64__)
  static uint16_t from_float(float f) {
    __fp16 h = static_cast<__fp16>(f);
    uint16_t b;
    std::memcpy(&b, &h, 2);
    return b;
  }
  static float to_float(uint16_t b) {
    __fp16 h;
    std::memcpy(&h, &b, 2);
    return static_cast<float>(h);
  }
#else
  // Bit-level IEEE binary16 conversion with round to nearest even; written out
  // because not every host compiler has _Float16 (Debian's clang 14 on x86).
  static uint16_t from_float(float f) {
    uint32_t x;
    std::memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {
      return sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u);  // NaN, inf
    }
    if (ax >= 0x477ff000u) {
      return sign | 0x7c00u;  // rounds past 65504
    }
    if (ax < 0x38800000u) {
      // Subnormal (or zero) result: count units of 2^-24, rounding to even.
      float a;
      std::memcpy(&a, &ax, 4);
      return sign | static_cast<uint32_t>(std::nearbyintf(a * 16777216.0f));
    }
    uint32_t h = ((((ax >> 23) - 127 + 15) << 10) | ((ax & 0x7fffffu) >> 13));
    uint32_t rest = ax & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) {
      h++;  // a carry into the exponent is the correct rounding
    }
    return static_cast<uint16_t>(sign | h);
  }
  static float to_float(uint16_t b) {
    uint32_t sign = static_cast<uint32_t>(b & 0x8000u) << 16;
    uint32_t exp = (b >> 10) & 0x1fu;
    uint32_t mant = b & 0x3ffu;
    if (exp == 0) {
      float f = std::ldexp(static_cast<float>(mant), -24);
      return sign ? -f : f;
    }
    uint32_t u = sign |
        (exp == 31 ? (0xffu << 23) | (mant << 13)
                   : ((exp - 15 + 127) << 23) | (mant << 13));
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
#endif
};

struct bfloat_traits {
  static uint16_t from_float(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    return static_cast<uint16_t>(u >> 16);
  }
  static float to_float(uint16_t b) {
    uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

template <typename Traits>
struct narrow_float {
  uint16_t bits_;
  narrow_float() = default;
  narrow_float(float f) : bits_(Traits::from_float(f)) {}
  narrow_float(double f) : bits_(Traits::from_float(static_cast<float>(f))) {}
  narrow_float(int i) : bits_(Traits::from_float(static_cast<float>(i))) {}
  operator float() const {
    return Traits::to_float(bits_);
  }
  // Negation flips the sign bit, as it does on the GPU (exact, no rounding).
  narrow_float operator-() const {
    narrow_float r;
    r.bits_ = static_cast<uint16_t>(bits_ ^ 0x8000u);
    return r;
  }
  // fp4.h / fp8.h scale a decoded half in place (`converted *= 16384.0`):
  // computed in float and rounded once to the narrow type.
  template <typename X>
  narrow_float& operator*=(X v) {
    *this = narrow_float(float(*this) * float(v));
    return *this;
  }
};

#define PATCHKIT_NARROW_OP(op)                                        \
  template <typename Tr>                                              \
  inline narrow_float<Tr> operator op(                                \
      narrow_float<Tr> a, narrow_float<Tr> b) {                       \
    return narrow_float<Tr>(float(a) op float(b));                    \
  }
PATCHKIT_NARROW_OP(+)
PATCHKIT_NARROW_OP(-)
PATCHKIT_NARROW_OP(*)
PATCHKIT_NARROW_OP(/)
#undef PATCHKIT_NARROW_OP

#if defined(PATCHKIT_ADDRESS_SPACES)
// Only address spaces are checked here, so the 16-bit types are builtin
// arithmetic types: a class's conversion operator cannot be called on an
// object in another address space (clang allows address-space-qualified
// methods only in OpenCL), while a builtin loads from any address space, as
// Metal's half does. half is clang's __fp16, which the check lets fp4.h/fp8.h
// return by value (-fallow-half-arguments-and-returns, as ARM targets have
// it); bfloat16_t must be a distinct type (fp4.h/fp8.h convert to both), and
// clang 14 on x86 has no second 16-bit float, so a 16-bit integer stands in.
typedef __fp16 half;
typedef short bfloat16_t;
#else
typedef narrow_float<half_traits> half;
typedef narrow_float<bfloat_traits> bfloat16_t;
#endif
typedef half float16_t;

// ---- what fp4.h / fp8.h and the fp kernels use ------------------------------
// Metal's `constant` on a namespace-scope constant is erased like the others.

// Reinterpret the bits of one type as another of the same size.
template <typename To, typename From>
inline To as_type(From from) {
  static_assert(sizeof(To) == sizeof(From), "as_type needs equal sizes");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

namespace metal {
using std::abs;
using std::isfinite;
using std::isnan;
using std::log2;
using std::round;
using std::signbit;
}  // namespace metal

// vec<T, 4> and float4 as fp_qmv_wide_impl reads x and holds dequantized
// weights; dot() sums the four products left to right (the negative control
// only needs some fixed order).
template <typename T, int N>
struct vec {
  T v[N];
#if defined(PATCHKIT_ADDRESS_SPACES)
  // Metal copies a vector out of device memory by value.
  vec() = default;
  vec(const device vec& o) {
    for (int i = 0; i < N; i++) {
      v[i] = o.v[i];
    }
  }
#endif
};

struct float4 {
  float x, y, z, w;
  float4() = default;
  float4(float a, float b, float c, float d) : x(a), y(b), z(c), w(d) {}
  template <typename T>
  explicit float4(const vec<T, 4>& o)
      : x(float(o.v[0])), y(float(o.v[1])), z(float(o.v[2])), w(float(o.v[3])) {}
#if defined(PATCHKIT_ADDRESS_SPACES)
  // fp_qmv_wide_impl converts a vector read in place from device memory.
  template <typename T>
  explicit float4(const device vec<T, 4>& o)
      : x(float(o.v[0])), y(float(o.v[1])), z(float(o.v[2])), w(float(o.v[3])) {}
#endif
};

inline float dot(float4 a, float4 b) {
  return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
}

// ---- lock-step simdgroups --------------------------------------------------
namespace patchkit {

constexpr int kSimdSize = 32;
constexpr size_t kFiberStack = 256 * 1024;

enum class LaneOp { kNone, kSum, kShuffleDown, kShuffleXor, kDone };

// One simd_sum call as recorded (layout mirrored by sums.RECORD in Python).
struct SumRecord {
  int32_t tid[3];  // threadgroup_position_in_grid
  int32_t simdgroup;  // simdgroup_index_in_threadgroup
  int32_t call;  // index of this simd_sum call within its simdgroup's run
  float lanes[32];  // the value each lane handed to simd_sum
  float out;  // the result every lane received
};

struct SumRecorder {
  SumRecord* records;
  int capacity;
  int count = 0;
};

struct Simdgroup {
  // Each lane starts once through swapcontext (to get its own stack), then
  // switches with _setjmp/_longjmp, which unlike swapcontext make no system
  // call for the signal mask: the suite switches lanes millions of times.
  ucontext_t boot;
  ucontext_t lane_start[kSimdSize];
  jmp_buf scheduler;
  jmp_buf lanes[kSimdSize];
  bool started[kSimdSize] = {};
  std::vector<char> stacks[kSimdSize];
  LaneOp op[kSimdSize];
  float in[kSimdSize];
  float out[kSimdSize];
  int arg[kSimdSize];
  int current = 0;
  // Where the running simdgroup sits in the grid, and its simd_sum calls so far.
  uint3 tid = {0, 0, 0};
  uint gid = 0;
  int sum_calls = 0;
  const void* body = nullptr;
  void (*trampoline)(const void*, int) = nullptr;
  std::string error;
#if defined(__SANITIZE_ADDRESS__)
  // AddressSanitizer's fiber annotations (sanitizer/common_interface_defs.h):
  // each fiber's fake-stack slot (the scheduler's last) and the scheduler's
  // stack, as ASan reports it when a lane is entered.
  void* fake[kSimdSize + 1] = {};
  const void* scheduler_bottom = nullptr;
  size_t scheduler_size = 0;
#endif
};

// Switch announcements for AddressSanitizer (no-ops otherwise). Without them
// ASan takes a lane's heap-allocated stack for the thread's and, at every
// _longjmp, clears the shadow of the whole range between the two stacks: the
// sanitizer build spent its time in the kernel doing that, and warned that it
// did not support the fibers.
inline void switching_to_lane(Simdgroup& sg, int lane) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(&sg.fake[kSimdSize], sg.stacks[lane].data(), kFiberStack);
#endif
}
inline void arrived_in_lane(Simdgroup& sg, int lane) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(sg.fake[lane], &sg.scheduler_bottom, &sg.scheduler_size);
#endif
}
inline void switching_to_scheduler(Simdgroup& sg, int lane) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_start_switch_fiber(&sg.fake[lane], sg.scheduler_bottom, sg.scheduler_size);
#endif
}
inline void arrived_in_scheduler(Simdgroup& sg) {
#if defined(__SANITIZE_ADDRESS__)
  __sanitizer_finish_switch_fiber(sg.fake[kSimdSize], nullptr, nullptr);
#endif
}

// One per OS thread, shared by every kernel instantiation (its fibers' stacks
// are allocated once).
inline thread_local Simdgroup this_thread_simdgroup;
inline thread_local Simdgroup* current_simdgroup = nullptr;
// Installed by the runner for one launch when the caller asks for a recording.
inline thread_local SumRecorder* sum_recorder = nullptr;

// A lane's fiber lives as long as its OS thread: it runs one simdgroup's body,
// reports done, and waits to be resumed with the next body.
inline void lane_entry() {
  Simdgroup& sg = *current_simdgroup;
  int lane = sg.current;
  arrived_in_lane(sg, lane);
  for (;;) {
    try {
      sg.trampoline(sg.body, lane);
    } catch (const std::exception& e) {
      if (sg.error.empty()) {
        sg.error = e.what();
      }
    }
    sg.op[lane] = LaneOp::kDone;
    if (!_setjmp(sg.lanes[lane])) {
      switching_to_scheduler(sg, lane);
      _longjmp(sg.scheduler, 1);
    }
    arrived_in_lane(sg, lane);
  }
}

inline float cross_lane(LaneOp op, float v, int arg) {
  Simdgroup& sg = *current_simdgroup;
  int lane = sg.current;
  sg.op[lane] = op;
  sg.in[lane] = v;
  sg.arg[lane] = arg;
  if (!_setjmp(sg.lanes[lane])) {
    switching_to_scheduler(sg, lane);
    _longjmp(sg.scheduler, 1);
  }
  arrived_in_lane(sg, lane);
  return sg.out[lane];
}

// Evaluates the cross-lane operation all 32 lanes are waiting at.
inline bool resolve(Simdgroup& sg) {
  if (!sg.error.empty()) {
    return false;
  }
  LaneOp op = sg.op[0];
  for (int l = 1; l < kSimdSize; l++) {
    if (sg.op[l] != op || sg.arg[l] != sg.arg[0]) {
      sg.error = "lanes diverged at a cross-lane operation";
      return false;
    }
  }
  if (op == LaneOp::kDone) {
    return false;
  }
  if (op == LaneOp::kSum) {
    float v[kSimdSize];
    std::copy(sg.in, sg.in + kSimdSize, v);
    for (int d = kSimdSize / 2; d >= 1; d /= 2) {
      float next[kSimdSize];
      for (int l = 0; l < kSimdSize; l++) {
        next[l] = v[l] + v[l ^ d];
      }
      std::copy(next, next + kSimdSize, v);
    }
    std::copy(v, v + kSimdSize, sg.out);
    if (sum_recorder != nullptr) {
      SumRecorder& rec = *sum_recorder;
      if (rec.count == rec.capacity) {
        sg.error = "simd_sum record buffer full";
        return false;
      }
      SumRecord& r = rec.records[rec.count++];
      r.tid[0] = int32_t(sg.tid.x), r.tid[1] = int32_t(sg.tid.y), r.tid[2] = int32_t(sg.tid.z);
      r.simdgroup = int32_t(sg.gid);
      r.call = sg.sum_calls;
      std::copy(sg.in, sg.in + kSimdSize, r.lanes);
      r.out = v[0];
    }
    sg.sum_calls++;
  } else if (op == LaneOp::kShuffleXor) {
    for (int l = 0; l < kSimdSize; l++) {
      sg.out[l] = sg.in[l ^ (sg.arg[0] & (kSimdSize - 1))];
    }
  } else {
    int d = sg.arg[0];
    for (int l = 0; l < kSimdSize; l++) {
      sg.out[l] = (l + d < kSimdSize) ? sg.in[l + d] : sg.in[l];
    }
  }
  return true;
}

// Runs body(lane) for 32 lanes in lock step. Throws on divergent lanes.
template <typename F>
void run_simdgroup(const F& body) {
  Simdgroup& sg = this_thread_simdgroup;
  current_simdgroup = &sg;
  sg.body = &body;
  sg.trampoline = [](const void* b, int lane) {
    (*static_cast<const F*>(b))(lane);
  };
  sg.error.clear();
  sg.sum_calls = 0;
  for (int l = 0; l < kSimdSize; l++) {
    if (!sg.started[l]) {
      sg.stacks[l].resize(kFiberStack);
      getcontext(&sg.lane_start[l]);
      sg.lane_start[l].uc_stack.ss_sp = sg.stacks[l].data();
      sg.lane_start[l].uc_stack.ss_size = kFiberStack;
      sg.lane_start[l].uc_link = nullptr;
      makecontext(&sg.lane_start[l], lane_entry, 0);
    }
    sg.op[l] = LaneOp::kNone;
  }
  do {
    for (int l = 0; l < kSimdSize; l++) {
      sg.current = l;
      if (!_setjmp(sg.scheduler)) {
        switching_to_lane(sg, l);
        if (sg.started[l]) {
          _longjmp(sg.lanes[l], 1);
        }
        sg.started[l] = true;
        swapcontext(&sg.boot, &sg.lane_start[l]);
      }
      arrived_in_scheduler(sg);
    }
  } while (resolve(sg));
  current_simdgroup = nullptr;
  if (!sg.error.empty()) {
    // Lanes may be suspended inside the failed body: never resume them.
    std::fill(sg.started, sg.started + kSimdSize, false);
    throw std::runtime_error(sg.error);
  }
}

// The batch arguments of the [[kernel]] entries (adjust_matrix_offsets), as
// MLX's host passes them (add_strides_and_shapes): for each operand its full
// shape and strides, batch dimensions first, and the number of batch
// dimensions. x is (batch..., M, K), w (batch..., N, K * bits / 32), scales and
// biases (batch..., N, K / group_size), all contiguous; y is (prod(batch), M, N).
// Weights shared along batch dimension i (bit i of w_shared) are stored once
// along it and read through stride 0 there, as a broadcast array is.
struct BatchLayout {
  static constexpr int kMaxDims = 6;  // up to 4 batch dimensions + 2 matrix ones
  int x_batch_ndims;
  int x_shape[kMaxDims];
  int64_t x_strides[kMaxDims];
  int w_batch_ndims;
  int w_shape[kMaxDims];
  int64_t w_strides[kMaxDims];
  int64_t s_strides[kMaxDims];
  int64_t b_strides[kMaxDims];
  int batches = 1;  // prod(batch): the grid's z extent

  BatchLayout(const int* batch, int nb, int w_shared, int M, int N, int K, int bits,
              int group_size) {
    if (nb < 1 || nb > kMaxDims - 2) {
      throw std::runtime_error("batch: 1 to 4 batch dimensions");
    }
    x_batch_ndims = w_batch_ndims = nb;
    int w_cols = K * bits / 32;
    int groups = K / group_size;
    for (int i = 0; i < nb; i++) {
      x_shape[i] = w_shape[i] = batch[i];
      batches *= batch[i];
    }
    x_shape[nb] = M, x_shape[nb + 1] = K;
    w_shape[nb] = N, w_shape[nb + 1] = w_cols;
    int64_t xs = 1, ws = 1, ss = 1;
    x_strides[nb + 1] = 1, x_strides[nb] = xs = K;
    w_strides[nb + 1] = 1, w_strides[nb] = ws = w_cols;
    s_strides[nb + 1] = 1, s_strides[nb] = ss = groups;
    xs *= M, ws *= N, ss *= N;
    for (int i = nb - 1; i >= 0; i--) {
      bool shared = (w_shared >> i) & 1;
      x_strides[i] = xs;
      w_strides[i] = shared ? 0 : ws;
      s_strides[i] = shared ? 0 : ss;
      xs *= batch[i];
      ws *= shared ? 1 : batch[i];
      ss *= shared ? 1 : batch[i];
    }
    for (int i = 0; i < nb + 2; i++) {
      b_strides[i] = s_strides[i];
    }
  }
};

// Launches one [[kernel]] over a grid of (gx, gy, batches) threadgroups of
// 2 simdgroups of 32 lanes, the shape MLX's host code dispatches for qmv and
// its variants. Simdgroups run one after another: these kernels share nothing
// through threadgroup memory.
template <typename Kernel>
void launch_grid(int batches, int gx, int gy, const Kernel& kernel) {
  for (uint z = 0; z < uint(batches); z++) {
    for (uint ty = 0; ty < uint(gy); ty++) {
      for (uint tx = 0; tx < uint(gx); tx++) {
        for (uint sg = 0; sg < 2; sg++) {
          this_thread_simdgroup.tid = uint3{tx, ty, z};
          this_thread_simdgroup.gid = sg;
          run_simdgroup([&](int lane) { kernel(uint3{tx, ty, z}, sg, uint(lane)); });
        }
      }
    }
  }
}

}  // namespace patchkit

inline float simd_sum(float v) {
  return patchkit::cross_lane(patchkit::LaneOp::kSum, v, 0);
}

inline float simd_shuffle_down(float v, ushort delta) {
  return patchkit::cross_lane(patchkit::LaneOp::kShuffleDown, v, delta);
}

// Lane l receives lane (l ^ mask)'s value. No upstream kernel here uses it; the
// suite's mutation tests do (a lane permutation that one reduction tree hides).
inline float simd_shuffle_xor(float v, ushort mask) {
  return patchkit::cross_lane(patchkit::LaneOp::kShuffleXor, v, mask);
}

// The batch helpers adjust_matrix_offsets calls when an operand has more than
// one batch dimension, written from their contract (MLX's utils.h): the
// offset of flat element `elem` of an array of `shape` with `strides` over its
// first `ndim` dimensions, the last dimension fastest; the _broadcast forms
// give that offset for two or three operands of one shape, each with its own
// strides (weights, scales[, biases]).
template <typename IdxT = int64_t>
inline IdxT elem_to_loc(uint elem, const constant int* shape, const constant int64_t* strides,
                        int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0; i--) {
    loc += IdxT(elem % uint(shape[i])) * IdxT(strides[i]);
    elem /= uint(shape[i]);
  }
  return loc;
}

inline ulong2 elem_to_loc_broadcast(uint elem, const constant int* shape,
                                    const constant int64_t* a_strides,
                                    const constant int64_t* b_strides, int ndim) {
  ulong2 loc = {0, 0};
  for (int i = ndim - 1; i >= 0; i--) {
    ulong pos = elem % uint(shape[i]);
    loc.x += pos * ulong(a_strides[i]);
    loc.y += pos * ulong(b_strides[i]);
    elem /= uint(shape[i]);
  }
  return loc;
}

inline ulong3 elem_to_loc_broadcast(uint elem, const constant int* shape,
                                    const constant int64_t* a_strides,
                                    const constant int64_t* b_strides,
                                    const constant int64_t* c_strides, int ndim) {
  ulong3 loc = {0, 0, 0};
  for (int i = ndim - 1; i >= 0; i--) {
    ulong pos = elem % uint(shape[i]);
    loc.x += pos * ulong(a_strides[i]);
    loc.y += pos * ulong(b_strides[i]);
    loc.z += pos * ulong(c_strides[i]);
    elem /= uint(shape[i]);
  }
  return loc;
}
