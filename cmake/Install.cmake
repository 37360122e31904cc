# `cmake --install` rules and the CPack package (docs/build.md, "Install and package").
#
# Layout under the prefix (relocatable: nothing below names the build tree or the venv):
#   bin/                   odyssey-controller, odyssey (CLI), odyssey-plan  (no libtorch)
#                          odyssey-worker, odyssey-train, odyssey-bench     (libtorch)
#   lib/odyssey/           libtorch's shared libraries (component `torch`); the libtorch binaries
#                          find them through their RUNPATH, $ORIGIN/../lib/odyssey
#                          (CMAKE_INSTALL_RPATH, set in CMakeLists.txt before any target)
#   share/odyssey/proto/   the gRPC API (odyssey.v1, grpc.health.v1) for grpcurl -proto and clients
#   share/odyssey/python/  the Python client's source tree with its proto: `pip install` it
#   share/odyssey/deploy/  deploy/ (Dockerfiles, kustomize base and overlays, Prometheus, Grafana)
#   share/doc/odyssey/     README.md and docs/
#
# Components: `odyssey` (everything but libtorch; small) and `torch` (libtorch's libraries, the
# worker's part: ~460 MB on the CPU build). `cpack` writes one tarball per component, both to be
# unpacked into the same folder; the controller image takes only the first.
#
# The rest of the binaries' dependencies (gRPC, protobuf, Abseil, ...) are the system's Debian 12
# packages: deploy/docker/*.Dockerfile install them (tests/package/package_test.py checks the
# lists against what the binaries load).

set(_torch_free_bins odyssey-controller odyssey odyssey-plan)
set(_torch_bins odyssey-worker odyssey-train odyssey-bench)
foreach(_t ${_torch_free_bins})
  if(TARGET ${_t})
    install(TARGETS ${_t} RUNTIME DESTINATION bin COMPONENT odyssey)
  endif()
endforeach()
set(_installed_torch_bins "")
foreach(_t ${_torch_bins})
  if(TARGET ${_t})
    list(APPEND _installed_torch_bins ${_t})
  endif()
endforeach()
install(TARGETS ${_installed_torch_bins} RUNTIME_DEPENDENCY_SET odyssey_torch_libs
        RUNTIME DESTINATION bin COMPONENT odyssey)

# libtorch's libraries: the ones the binaries need, as the dynamic loader would resolve them
# (libtorch_cpu, libc10, the wheel's libgomp and the two CUDA runtime libraries libtorch_cpu
# names even on a CPU build), copied flat into lib/odyssey: each has $ORIGIN in its own rpath,
# so they find each other there (their other entries, the wheel's ../../nvidia/..., name
# folders the package does not have; the loader skips them). System libraries stay the system's (only files under a
# site-packages' torch/lib or nvidia/*/lib are taken).
set(_nvidia_root "${TORCH_ROOT}/../nvidia")
file(GLOB _nvidia_libdirs LIST_DIRECTORIES true "${_nvidia_root}/*/lib")
install(RUNTIME_DEPENDENCY_SET odyssey_torch_libs
        DIRECTORIES "${ODYSSEY_TORCH_LIBDIR}" ${_nvidia_libdirs}
        POST_INCLUDE_REGEXES "/site-packages/(.*/)?(torch/lib|nvidia/[^/]+/lib)/[^/]+$"
        POST_EXCLUDE_REGEXES ".*"
        LIBRARY DESTINATION ${ODYSSEY_INSTALL_LIBDIR} COMPONENT torch)
if(ODYSSEY_CUDA)
  # What libtorch_cuda and cuDNN open with dlopen (cuDNN's engines, nvrtc's builtins, ...) is
  # invisible to the dependency walk above: on the CUDA build take every library of torch/lib
  # and of the nvidia wheels. Not built on the CPU machines: run on a GPU host
  # (deploy/docker/worker.Dockerfile does).
  install(DIRECTORY "${ODYSSEY_TORCH_LIBDIR}/" DESTINATION ${ODYSSEY_INSTALL_LIBDIR} COMPONENT torch
          FILES_MATCHING PATTERN "*.so*" PATTERN "libtorch_python.so" EXCLUDE PATTERN "libshm*" EXCLUDE)
  foreach(_d ${_nvidia_libdirs})
    install(DIRECTORY "${_d}/" DESTINATION ${ODYSSEY_INSTALL_LIBDIR} COMPONENT torch FILES_MATCHING PATTERN "*.so*")
  endforeach()
endif()

install(DIRECTORY proto/odyssey proto/grpc DESTINATION share/odyssey/proto COMPONENT odyssey
        FILES_MATCHING PATTERN "*.proto")
# The Python client as an sdist-like tree: setup.py finds the proto in ./proto.
install(DIRECTORY client/python/ DESTINATION share/odyssey/python COMPONENT odyssey
        PATTERN "tests" EXCLUDE PATTERN "_pb" EXCLUDE PATTERN "__pycache__" EXCLUDE
        PATTERN "*.egg-info" EXCLUDE PATTERN "build" EXCLUDE)
install(DIRECTORY proto/odyssey DESTINATION share/odyssey/python/proto COMPONENT odyssey
        FILES_MATCHING PATTERN "*.proto")
install(DIRECTORY deploy/ DESTINATION share/odyssey/deploy COMPONENT odyssey)
install(FILES README.md DESTINATION share/doc/odyssey COMPONENT odyssey)
install(DIRECTORY docs/ DESTINATION share/doc/odyssey/docs COMPONENT odyssey)

# The package: `cpack` (or `cpack -G TGZ`) in the build folder writes
#   odyssey-<version>-linux-<arch>[-cuda]-odyssey.tar.gz   bin/, share/ (no libtorch)
#   odyssey-<version>-linux-<arch>[-cuda]-torch.tar.gz     lib/odyssey/
# with no top-level folder: unpack both into one folder (tar -C DIR -xzf ...).
set(CPACK_GENERATOR TGZ)
set(CPACK_PACKAGE_NAME odyssey)
set(CPACK_PACKAGE_VENDOR odyssey)
set(CPACK_PACKAGE_VERSION "${PROJECT_VERSION}")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY "odyssey: long-context training backend (controller, worker, CLI)")
string(TOLOWER "${CMAKE_SYSTEM_NAME}-${CMAKE_SYSTEM_PROCESSOR}" _platform)
if(ODYSSEY_CUDA)
  string(APPEND _platform "-cuda")
endif()
set(CPACK_PACKAGE_FILE_NAME "odyssey-${PROJECT_VERSION}-${_platform}")
set(CPACK_ARCHIVE_COMPONENT_INSTALL ON)
set(CPACK_COMPONENTS_ALL odyssey torch)
set(CPACK_INCLUDE_TOPLEVEL_DIRECTORY OFF)
set(CPACK_COMPONENT_INCLUDE_TOPLEVEL_DIRECTORY OFF)
set(CPACK_VERBATIM_VARIABLES ON)
# The package's binaries without debug info (the build tree keeps it): smaller, quicker to pack.
set(CPACK_STRIP_FILES ON)
include(CPack)
