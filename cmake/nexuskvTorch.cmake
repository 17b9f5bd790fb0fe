# Where LibTorch is and what a CUDA build of it needs, for nexuskv's own build
# and for applications that say find_package(nexuskv) (this file is installed
# next to nexuskvConfig.cmake).  Call find_package(Torch) afterwards.
#   - The torch of the Python environment (Python_EXECUTABLE, else the python
#     found first), unless CMAKE_PREFIX_PATH already points at a LibTorch.
#   - A CUDA build of torch looks for the CUDA toolkit: CUDA_HOME or
#     /usr/local/cuda unless CUDA_TOOLKIT_ROOT_DIR says where.
#   - pip's CUDA torch brings libnvrtc as a wheel (nvidia/cu*/lib), not in the toolkit.
#   - The GPU architectures are pinned (A100 sm_80, H100/H200 sm_90) unless
#     TORCH_CUDA_ARCH_LIST is set: otherwise torch's CMake probes the local GPU
#     with a test program, which fails on a machine without one.
find_package(Python COMPONENTS Interpreter QUIET)
if(Python_FOUND AND NOT NEXUSKV_TORCH_PREFIX)
  execute_process(
    COMMAND ${Python_EXECUTABLE} -c "import torch; print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE NEXUSKV_TORCH_PREFIX OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(NEXUSKV_TORCH_PREFIX)
    list(APPEND CMAKE_PREFIX_PATH ${NEXUSKV_TORCH_PREFIX})
  endif()
endif()
if(NOT DEFINED CUDA_TOOLKIT_ROOT_DIR)
  if(DEFINED ENV{CUDA_HOME})
    set(CUDA_TOOLKIT_ROOT_DIR $ENV{CUDA_HOME})
  elseif(EXISTS /usr/local/cuda/include/cuda_runtime.h)
    set(CUDA_TOOLKIT_ROOT_DIR /usr/local/cuda)
  endif()
endif()
if(NEXUSKV_TORCH_PREFIX)
  get_filename_component(_nexuskv_site "${NEXUSKV_TORCH_PREFIX}/../../.." ABSOLUTE)
  find_library(CUDA_nvrtc_LIBRARY NAMES nvrtc libnvrtc.so.13 libnvrtc.so.12
    HINTS ${CUDA_TOOLKIT_ROOT_DIR}/lib64 ${_nexuskv_site}/nvidia/cu13/lib ${_nexuskv_site}/nvidia/cuda_nvrtc/lib)
endif()
if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(ENV{TORCH_CUDA_ARCH_LIST} "8.0;9.0")
endif()
