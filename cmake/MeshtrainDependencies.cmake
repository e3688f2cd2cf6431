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
pkg_check_modules(LIBFABRIC REQUIRED IMPORTED_TARGET libfabric)
pkg_check_modules(OPENBLAS REQUIRED IMPORTED_TARGET openblas)
if(MESHTRAIN_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()

# cpprestsdk's own link interface misses OpenSSL on Debian: name it explicitly.
add_library(meshtrain_cpprest INTERFACE)
target_link_libraries(meshtrain_cpprest INTERFACE cpprestsdk::cpprest OpenSSL::SSL OpenSSL::Crypto)
add_library(meshtrain::cpprest ALIAS meshtrain_cpprest)
