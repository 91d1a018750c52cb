# The CUDA architectures of a build, from torch's TORCH_CUDA_ARCH_LIST syntax:
#   entries separated by ";" or spaces; "8.0" (machine code for sm_80), "9.0a" / "10.0f" (arch- and
#   family-specific machine code), "9.0+PTX" (machine code plus PTX that the driver compiles for newer GPUs),
#   or one of torch's names: Turing, Ampere, Ampere+Tegra, Ada, Hopper, Blackwell, Blackwell+Tegra.
#
#   packcuda_cuda_architectures(<archs_var> <list_var> <arch_list>)
#
# sets <archs_var> to CMAKE_CUDA_ARCHITECTURES ("80-real;90" for "8.0;9.0+PTX") and <list_var> to the list with
# the names expanded ("8.0;9.0+PTX"), the form the library reports when a device has no code in it. An empty
# <arch_list> means the default. An entry that is not an architecture stops the configuration.
#
# Script mode prints both, for tests: cmake -DTORCH_CUDA_ARCH_LIST="8.0 9.0+PTX" -P cmake/packcudaCudaArchs.cmake

# Machine code for the GPUs in use (A100 / A10 / RTX 30xx, L4 / L40 / RTX 40xx, H100 / H200) and PTX of the
# newest of them, which the driver compiles at first use for any newer GPU (Blackwell and later).
set(PACKCUDA_DEFAULT_CUDA_ARCH_LIST "8.0;8.6;8.9;9.0+PTX")

function(packcuda_cuda_architectures archs_var list_var arch_list)
  if("${arch_list}" STREQUAL "")
    set(arch_list "${PACKCUDA_DEFAULT_CUDA_ARCH_LIST}")
  endif()
  # torch's named architectures (torch.utils.cpp_extension._get_cuda_arch_flags)
  set(_names Turing Ampere+Tegra Ampere Ada Hopper Blackwell+Tegra Blackwell)
  set(_Turing "7.5+PTX")
  set(_Ampere+Tegra "8.7")
  set(_Ampere "8.0;8.6+PTX")
  set(_Ada "8.9+PTX")
  set(_Hopper "9.0+PTX")
  set(_Blackwell+Tegra "11.0")
  set(_Blackwell "10.0;10.3;12.0;12.1+PTX")
  string(REGEX REPLACE "[ \t\n]+" ";" arch_list "${arch_list}")
  set(_expanded "")
  foreach(_a IN LISTS arch_list)
    list(FIND _names "${_a}" _name_at)  # not if(IN_LIST): script mode runs with the old policies
    if(_name_at GREATER -1)
      list(APPEND _expanded ${_${_a}})
    elseif(NOT _a STREQUAL "")
      list(APPEND _expanded "${_a}")
    endif()
  endforeach()
  set(_archs "")
  foreach(_a IN LISTS _expanded)
    if(NOT _a MATCHES "^([0-9]+)\\.([0-9])([af]?)(\\+PTX)?$")
      message(FATAL_ERROR "packcuda: TORCH_CUDA_ARCH_LIST entry '${_a}' is not a CUDA architecture; write "
                          "e.g. \"8.0;9.0a;9.0+PTX\" or a name (Ampere, Ada, Hopper, Blackwell)")
    endif()
    set(_num "${CMAKE_MATCH_1}${CMAKE_MATCH_2}${CMAKE_MATCH_3}")
    if(CMAKE_MATCH_4)
      list(APPEND _archs "${_num}")  # a bare number: machine code and PTX
    else()
      list(APPEND _archs "${_num}-real")
    endif()
  endforeach()
  if(NOT _archs)
    message(FATAL_ERROR "packcuda: TORCH_CUDA_ARCH_LIST names no architecture")
  endif()
  list(REMOVE_DUPLICATES _archs)
  list(REMOVE_DUPLICATES _expanded)
  set(${archs_var} "${_archs}" PARENT_SCOPE)
  set(${list_var} "${_expanded}" PARENT_SCOPE)
endfunction()

if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  if(NOT DEFINED TORCH_CUDA_ARCH_LIST)
    set(TORCH_CUDA_ARCH_LIST "$ENV{TORCH_CUDA_ARCH_LIST}")
  endif()
  packcuda_cuda_architectures(_archs _list "${TORCH_CUDA_ARCH_LIST}")
  execute_process(COMMAND "${CMAKE_COMMAND}" -E echo "CMAKE_CUDA_ARCHITECTURES=${_archs}")
  execute_process(COMMAND "${CMAKE_COMMAND}" -E echo "TORCH_CUDA_ARCH_LIST=${_list}")
endif()
