# Helpers that give every meshtrain target the same warnings, sanitizers and layout.

if(MESHTRAIN_SANITIZE)
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
endif()

# Fuzz builds instrument all of meshtrain's code for coverage; only the fuzzer binary links libFuzzer's main.
if(MESHTRAIN_FUZZ)
  add_compile_options(-fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer)
  add_link_options(-fsanitize=address,undefined)
endif()

# Warnings apply to meshtrain's own code only; third-party headers come in as SYSTEM.
function(meshtrain_warnings target)
  target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wpedantic -Wshadow>)
  # GCC 12 reports -Wrestrict for ordinary std::string concatenation (GCC bug 105329).
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Wno-restrict>)
  endif()
  if(MESHTRAIN_WERROR)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Werror>)
  endif()
endfunction()

# meshtrain_library(NAME SOURCES... DEPS ...): a component library, included from the repo root.
function(meshtrain_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PUBLIC ${ARG_DEPS})
  meshtrain_warnings(${name})
  # The files of a library compile as unity units of up to 8: the project's headers, JSON,
  # cpprest and CLI11 parse once per unit, not once per file (CI builds on 2 cores). So a
  # file's anonymous helpers must not share a name with another file's of the same target.
  set_target_properties(${name} PROPERTIES UNITY_BUILD ON)
endfunction()

# meshtrain_test(NAME LABEL SOURCES... DEPS ...): a gtest binary whose cases are registered with ctest.
function(meshtrain_test name label)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  # tests/support/test_main.cc: OpenBLAS's core chosen as the programs under test choose it.
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} meshtrain_test_main)
  meshtrain_warnings(${name})
  # A test's own code drives the libraries (built -O3) and checks what they give: -O1 runs
  # it about as fast, and gtest's macros at -O3 cost half again the time to compile (the
  # test binaries are nearly half of what a build compiles).
  target_compile_options(${name} PRIVATE $<$<AND:$<CONFIG:Release>,$<COMPILE_LANGUAGE:CXX>>:-O1>)
  # Unity units, as a library's (the unit tests built in 65 s instead of 149 s here). A
  # test file whose helpers would clash with a sibling's takes a namespace of its own.
  set_target_properties(${name} PROPERTIES UNITY_BUILD ON)
  # A GTEST_SKIP() shows in ctest as skipped, not passed (gpu tests say "skipped: no GPU").
  gtest_discover_tests(${name} PROPERTIES LABELS ${label} SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]"
                       WORKING_DIRECTORY ${PROJECT_SOURCE_DIR} DISCOVERY_TIMEOUT 60)
endfunction()
