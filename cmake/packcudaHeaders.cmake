# The public headers: every umbrella header csrc/*.h (<packcuda/<cap>.h>, <packcuda/packcuda_torch.h>) and
# every header they include, followed file by file. Only these are installed.
#
#   packcuda_public_headers(<out_var> <source_root>)
#
# sets <out_var> to their paths relative to <source_root>. An included header is resolved against the folder of
# the header that includes it, as the compiler resolves it in the install tree (where only include/ is on the
# path); a public header that includes something else (a torch-layer or kernel-internal header, or a path
# relative to the source root) stops the configuration with a message naming both files.
function(packcuda_public_headers out_var root)
  get_filename_component(root "${root}" ABSOLUTE)
  file(GLOB todo "${root}/*.h")
  set(seen "")
  while(todo)
    list(POP_FRONT todo file)
    if(file IN_LIST seen)
      continue()
    endif()
    list(APPEND seen "${file}")
    get_filename_component(dir "${file}" DIRECTORY)
    file(STRINGS "${file}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*\"")
    foreach(line IN LISTS lines)
      string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"([^\"]+)\".*$" "\\1" inc "${line}")
      get_filename_component(target "${inc}" ABSOLUTE BASE_DIR "${dir}")
      file(RELATIVE_PATH from "${root}" "${file}")
      file(RELATIVE_PATH rel "${root}" "${target}")
      if(NOT EXISTS "${target}" OR rel MATCHES "^\\.\\./" OR rel MATCHES "(^|/)torch/")
        message(FATAL_ERROR "packcuda: the public header ${from} includes \"${inc}\", which is not a public header "
                            "(public headers include only public headers, by paths relative to their own folder)")
      endif()
      list(APPEND todo "${target}")
    endforeach()
  endwhile()
  set(rel "")
  foreach(file IN LISTS seen)
    file(RELATIVE_PATH r "${root}" "${file}")
    list(APPEND rel "${r}")
  endforeach()
  list(SORT rel)
  # a header edit that adds an include re-runs the configuration
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${seen})
  set(${out_var} "${rel}" PARENT_SCOPE)
endfunction()
