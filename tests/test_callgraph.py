"""The route from each eval_gpu to the patched functions, from synthetic C++ (no MLX needed)."""

from __future__ import annotations

from patchkit.carry import callgraph

SOURCE = """\
#include <x.h>
#define LIMIT(x) { return x; }
namespace mlx::core {
namespace {
bool supports_fast(const array& x) { return x.size() > 4; }  // a predicate
int tile(int k) { return k / 32; }
void unrelated_helper() {}
}  // namespace

namespace cu {
template <typename T>
void launch(const T* x, int n) { kernel<<<1, n>>>(x); }
}  // namespace cu

struct Helper {
  void not_a_route() { dispatch(); }
};

void dispatch(const array& x) {
  cu::launch(x.data<float>(), tile(x.shape(-1)));
}

void QuantizedMatmul::eval_gpu(const std::vector<array>& inputs, array& out) {
  auto pick = supports(supports_fast);  // a predicate passed as a value
  dispatch(inputs[0]);
  out.set_data(nullptr);  // a member call is no reference to a free function
}

void Softmax::eval_gpu(const std::vector<array>& inputs, array& out) {
  unrelated_helper();
}
}  // namespace mlx::core
"""


def test_definitions_see_namespace_scope_functions_only() -> None:
    defs = {d.name: d for d in callgraph.definitions("a.cpp", SOURCE)}
    assert set(defs) == {"supports_fast", "tile", "unrelated_helper", "launch", "dispatch",
                         "QuantizedMatmul::eval_gpu", "Softmax::eval_gpu"}  # fmt: skip
    assert defs["launch"].qualified == "mlx::core::cu::launch"
    assert defs["supports_fast"].returns_scalar and defs["tile"].returns_scalar
    assert not defs["dispatch"].returns_scalar
    assert "supports_fast" in defs["QuantizedMatmul::eval_gpu"].refs
    assert "set_data" not in defs["QuantizedMatmul::eval_gpu"].refs


def test_the_route_is_callers_to_the_target_and_the_values_they_read() -> None:
    defs = callgraph.definitions("a.cpp", SOURCE)
    on = {d.name for d in callgraph.route(defs, {"launch"})}
    assert on == {"QuantizedMatmul::eval_gpu", "dispatch", "launch", "supports_fast", "tile"}
    # control: a target nothing calls leaves no route
    assert {d.name for d in callgraph.route(defs, {"nothing"})} == set()
