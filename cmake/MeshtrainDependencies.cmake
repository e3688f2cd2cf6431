# Third-party libraries, all from Debian 12 packages (scripts/setup.sh installs them).

# cpprestsdk defines a macro `U` that breaks gtest and fmt; turn it off everywhere.
add_compile_definitions(_TURN_OFF_PLATFORM_STRING)

find_package(Threads REQUIRED)
find_package(OpenMP REQUIRED)
find_package(nlohmann_json 3.10 REQUIRED)
find_package(yaml-cpp 0.7 REQUIRED)
find_package(spdlog 1.10 REQUIRED)
find_package(CLI11 2.1 REQUIRED)
find_package(OpenSSL REQUIRED)
find_package(cpprestsdk REQUIRED)
find_package(prometheus-cpp REQUIRED)
find_package(PkgConfig REQUIRED)
pkg_check_modules(LIBFABRIC REQUIRED libfabric)
# libfabric's headers only: the fabric backend loads the library on first use
# (worker/comm/fabric/libfabric.h says why).
add_library(meshtrain_libfabric_headers INTERFACE)
target_include_directories(meshtrain_libfabric_headers SYSTEM INTERFACE ${LIBFABRIC_INCLUDE_DIRS})
target_link_libraries(meshtrain_libfabric_headers INTERFACE ${CMAKE_DL_LIBS})
add_library(meshtrain::libfabric_headers ALIAS meshtrain_libfabric_headers)
# GPT-2's pre-tokenizer pattern needs Unicode classes (\p{L}), which std::regex lacks.
pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
# OpenBLAS built on OpenMP shares libgomp's threads with meshtrain's OpenMP loops; the
# default pthread build keeps a second pool of spinning threads that fights them.
find_library(OPENBLAS_OPENMP_LIBRARY openblas PATHS /usr/lib/x86_64-linux-gnu/openblas-openmp NO_DEFAULT_PATH)
find_path(OPENBLAS_OPENMP_INCLUDE_DIR cblas.h PATHS /usr/include/x86_64-linux-gnu/openblas-openmp NO_DEFAULT_PATH)
if(NOT OPENBLAS_OPENMP_LIBRARY OR NOT OPENBLAS_OPENMP_INCLUDE_DIR)
  message(FATAL_ERROR "OpenBLAS built for OpenMP was not found: apt-get install libopenblas-openmp-dev")
endif()
add_library(meshtrain_blas INTERFACE)
target_include_directories(meshtrain_blas SYSTEM INTERFACE ${OPENBLAS_OPENMP_INCLUDE_DIR})
target_link_libraries(meshtrain_blas INTERFACE ${OPENBLAS_OPENMP_LIBRARY})
add_library(meshtrain::blas ALIAS meshtrain_blas)
if(MESHTRAIN_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()

# cpprestsdk's own link interface misses OpenSSL on Debian: name it explicitly.
add_library(meshtrain_cpprest INTERFACE)
target_link_libraries(meshtrain_cpprest INTERFACE cpprestsdk::cpprest OpenSSL::SSL OpenSSL::Crypto)
add_library(meshtrain::cpprest ALIAS meshtrain_cpprest)
