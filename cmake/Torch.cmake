# Finds libtorch and defines the imported target odyssey::torch.
#
# CPU build (ODYSSEY_CUDA=OFF, the default): libtorch comes from the project venv's torch wheel
# (scripts/setup.sh installs torch==2.11.0). The PyPI wheel is a CUDA build, and its
# TorchConfig.cmake drags in the CUDA toolkit and every CUDA library; a CPU-only build needs
# none of that. So we skip find_package(Torch) and link only libtorch_cpu + libc10, with the
# wheel's include folders and its C++ ABI flag. The result runs on a machine with no GPU.
#
# GPU build (ODYSSEY_CUDA=ON): the same, plus libtorch_cuda + libc10_cuda and the CUDA
# toolkit's runtime; we still skip TorchConfig.cmake, whose CUDA/cuDNN/NVTX discovery differs
# from host to host, and define what its targets would (USE_CUDA). See docs/gpu.md.

set(ODYSSEY_PYTHON "" CACHE FILEPATH "Python with torch (default: .venv/bin/python)")
if(NOT ODYSSEY_PYTHON)
  set(ODYSSEY_PYTHON "${PROJECT_SOURCE_DIR}/.venv/bin/python")
endif()
if(NOT EXISTS "${ODYSSEY_PYTHON}")
  message(FATAL_ERROR "No Python at ${ODYSSEY_PYTHON}: run scripts/setup.sh first, "
                      "or pass -DODYSSEY_PYTHON=/path/to/python with torch installed.")
endif()
execute_process(
  COMMAND "${ODYSSEY_PYTHON}" -c "import torch, os; print(os.path.dirname(torch.__file__)); print(torch.__version__); print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
  OUTPUT_VARIABLE _torch_out RESULT_VARIABLE _torch_rc OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _torch_rc EQUAL 0)
  message(FATAL_ERROR "${ODYSSEY_PYTHON} cannot import torch: run scripts/setup.sh")
endif()
string(REPLACE "\n" ";" _torch_out "${_torch_out}")
list(GET _torch_out 0 TORCH_ROOT)
list(GET _torch_out 1 TORCH_VERSION_STRING)
list(GET _torch_out 2 TORCH_CXX11_ABI)
message(STATUS "odyssey: torch ${TORCH_VERSION_STRING} at ${TORCH_ROOT} (cuda=${ODYSSEY_CUDA})")

add_library(odyssey_torch INTERFACE)
add_library(odyssey::torch ALIAS odyssey_torch)
set(_tlib "${TORCH_ROOT}/lib")
set(_tlibs torch_cpu c10)
if(ODYSSEY_CUDA)
  # libtorch_cuda registers the CUDA kernels (it must be linked even where no symbol of it is
  # used directly: --no-as-needed), c10_cuda holds streams and the caching allocator.
  list(APPEND _tlibs torch_cuda c10_cuda)
  find_package(CUDAToolkit REQUIRED)
  target_link_libraries(odyssey_torch INTERFACE CUDA::cudart)
  target_compile_definitions(odyssey_torch INTERFACE ODYSSEY_WITH_CUDA=1 USE_CUDA=1)
endif()
# NCCL (engine/parallel/nccl_communicator.h): a CUDA build whose libtorch ships c10d's
# ProcessGroupNCCL (libtorch_cuda, with nccl.h beside the wheel or on the system) defines
# ODYSSEY_WITH_NCCL; the CPU build never does and compiles no NCCL code.
set(ODYSSEY_WITH_NCCL OFF)
if(ODYSSEY_CUDA AND EXISTS "${TORCH_ROOT}/include/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp")
  find_path(ODYSSEY_NCCL_INCLUDE nccl.h HINTS "${TORCH_ROOT}/../nvidia/nccl/include" /usr/include)
  if(ODYSSEY_NCCL_INCLUDE)
    set(ODYSSEY_WITH_NCCL ON)
    target_include_directories(odyssey_torch SYSTEM INTERFACE "${ODYSSEY_NCCL_INCLUDE}")
    target_compile_definitions(odyssey_torch INTERFACE ODYSSEY_WITH_NCCL=1 USE_C10D_NCCL=1)
  endif()
endif()
message(STATUS "odyssey: NCCL communicator ${ODYSSEY_WITH_NCCL}")
set(_tpaths)
foreach(_l ${_tlibs})
  if(NOT EXISTS "${_tlib}/lib${_l}.so")
    message(FATAL_ERROR "missing ${_tlib}/lib${_l}.so in the torch installation")
  endif()
  list(APPEND _tpaths "${_tlib}/lib${_l}.so")
endforeach()
# The wheel's include folder also carries its own copies of protobuf (google/) and fmt (fmt/),
# older/newer than the system's that gRPC and spdlog are built against. Put only torch's own
# headers on the include path: a folder of links to every entry but those two.
set(_shim "${CMAKE_BINARY_DIR}/torch_include")
file(MAKE_DIRECTORY "${_shim}")
file(GLOB _entries RELATIVE "${TORCH_ROOT}/include" "${TORCH_ROOT}/include/*")
foreach(_e ${_entries})
  if(NOT _e MATCHES "^(google|fmt)$" AND NOT EXISTS "${_shim}/${_e}")
    file(CREATE_LINK "${TORCH_ROOT}/include/${_e}" "${_shim}/${_e}" SYMBOLIC)
  endif()
endforeach()
target_include_directories(odyssey_torch SYSTEM INTERFACE "${_shim}" "${_shim}/torch/csrc/api/include")
target_link_libraries(odyssey_torch INTERFACE "-Wl,--no-as-needed" ${_tpaths} "-Wl,--as-needed")
target_compile_definitions(odyssey_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=${TORCH_CXX11_ABI})
# The torch libraries find each other (and the CUDA libraries of the wheel) through their own
# rpath ($ORIGIN); ours get one to them from CMake, which adds the folder of every library
# linked by full path to the build rpath.
set(ODYSSEY_TORCH_LIBDIR "${_tlib}")
