# Included by `patchkit build` after each project() of MLX's CMake (CMAKE_PROJECT_INCLUDE)
# when the C/C++ compiler cannot link -flto. Targets that ask for interprocedural
# optimization (nanobind_add_module(... LTO), MLX's Python module) then build and link
# without it: empty IPO options instead of the compiler's -flto.
foreach(lang C CXX)
  set(CMAKE_${lang}_COMPILE_OPTIONS_IPO "")
  set(CMAKE_${lang}_LINK_OPTIONS_IPO "")
endforeach()
