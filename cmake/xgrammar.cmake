# xgrammar's C++ core (Apache-2.0), the constrained-decoding library behind structured output
# (engine/sampling/token_constraint.h). Built from its source distribution on PyPI, pinned by hash: only the
# static C++ library, without its Python bindings or tests, and not installed with exl3serve.
# EXL3_XGRAMMAR_URL may name a local copy of the same archive for an offline build.
set(EXL3_XGRAMMAR_URL
    "https://files.pythonhosted.org/packages/3a/2f/5bf8e8fa6619cff534932f79b0abc81a417d354bc5093252c1a6081d0a93/xgrammar-0.2.9.tar.gz"
    CACHE STRING "Where the xgrammar 0.2.9 source archive is fetched from (URL or local path)")

include(FetchContent)
if(POLICY CMP0135)
  cmake_policy(SET CMP0135 NEW)  # extracted files get the extraction time: rebuilds stay correct
endif()
if(POLICY CMP0169)
  cmake_policy(SET CMP0169 OLD)  # FetchContent_Populate: keeps the library out of `all` and `install`
endif()
FetchContent_Declare(xgrammar
  URL "${EXL3_XGRAMMAR_URL}"
  URL_HASH SHA256=87b466bca2475e29bb0323abc62c6c33cbcbcff47e5fb800a3e2099ac9620b90
  # The library alone (no Python bindings), and one fix of its JSON strings: xgrammar_patch.cmake.
  PATCH_COMMAND ${CMAKE_COMMAND} -DSOURCE_DIR=<SOURCE_DIR>
                -P ${CMAKE_CURRENT_LIST_DIR}/xgrammar_patch.cmake)
FetchContent_GetProperties(xgrammar)
if(NOT xgrammar_POPULATED)
  FetchContent_Populate(xgrammar)
endif()

# EXCLUDE_FROM_ALL: built only because exl3serve's libraries link it; its install() rules stay out.
add_subdirectory(${xgrammar_SOURCE_DIR} ${xgrammar_BINARY_DIR} EXCLUDE_FROM_ALL)
# Its CMakeLists adds -Werror and -flto=auto for GCC: a newer compiler's new warning must not break
# this build, and LTO objects in a static library would tie every link to the same compiler's plugin.
target_compile_options(xgrammar PRIVATE -Wno-error -fno-lto -w)
