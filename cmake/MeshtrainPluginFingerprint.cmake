# The fingerprint of the CUDA plugin boundary (worker/train/cuda_plugin.h): a hash of that
# header and of every project header it includes, directly or not, so of every type that
# crosses dlopen. The program and libmeshtrain-cuda.so are both compiled with it, and the
# loader refuses a plugin whose fingerprint differs: a plugin from another build, whose
# vtable or structs may be laid out differently, is never called.

# meshtrain_plugin_fingerprint(OUT HEADER [INCLUDE_DIR...]): OUT gets "meshtrain VERSION,
# plugin boundary HASH" for HEADER, whose includes are searched in the INCLUDE_DIRs before
# the source tree (tests hash a modified copy this way). Configuration re-runs when any
# of the hashed headers changes.
function(meshtrain_plugin_fingerprint out header)
  set(flags)
  foreach(dir ${ARGN} ${PROJECT_SOURCE_DIR})
    list(APPEND flags -I${dir})
  endforeach()
  execute_process(COMMAND ${CMAKE_CXX_COMPILER} -std=c++20 ${flags} -MM ${header}
                  WORKING_DIRECTORY ${PROJECT_SOURCE_DIR}
                  OUTPUT_VARIABLE deps ERROR_VARIABLE error RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "cannot list the headers ${header} includes: ${error}")
  endif()
  string(REGEX REPLACE "^[^:]*:" "" deps "${deps}")
  string(REGEX REPLACE "[\\\n\t ]+" ";" deps "${deps}")
  set(text "")
  set(files)
  foreach(file IN LISTS deps)
    if(file STREQUAL "")
      continue()
    endif()
    get_filename_component(file "${file}" ABSOLUTE BASE_DIR ${PROJECT_SOURCE_DIR})
    file(READ "${file}" content)
    string(APPEND text "${content}")
    list(APPEND files "${file}")
  endforeach()
  string(SHA256 hash "${text}")
  string(SUBSTRING "${hash}" 0 16 hash)
  set_property(DIRECTORY ${PROJECT_SOURCE_DIR} APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${files})
  set(${out} "meshtrain ${PROJECT_VERSION}, plugin boundary ${hash}" PARENT_SCOPE)
endfunction()
