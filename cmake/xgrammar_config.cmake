# Replaces xgrammar's cmake/config.cmake (cmake/xgrammar_patch.cmake copies it in when the archive is
# unpacked): the C++ library alone, without the Python bindings the published file turns on.
set(XGRAMMAR_BUILD_PYTHON_BINDINGS OFF)
set(XGRAMMAR_ENABLE_COVERAGE OFF)
set(XGRAMMAR_BUILD_CXX_TESTS OFF)
set(XGRAMMAR_ENABLE_CPPTRACE OFF)
set(XGRAMMAR_ENABLE_INTERNAL_CHECK OFF)
