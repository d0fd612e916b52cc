# Sourced by the fuzz checks: the abseil libraries that absl::Status, StrCat and friends need when
# a fuzz target is linked by hand with clang (outside CMake).
ABSL_LIBS="-labsl_statusor -labsl_status -labsl_cord -labsl_cordz_info -labsl_cord_internal
  -labsl_cordz_functions -labsl_cordz_handle -labsl_str_format_internal -labsl_strings
  -labsl_strings_internal -labsl_int128 -labsl_throw_delegate -labsl_synchronization
  -labsl_graphcycles_internal -labsl_stacktrace -labsl_symbolize -labsl_debugging_internal
  -labsl_demangle_internal -labsl_malloc_internal -labsl_time -labsl_time_zone -labsl_civil_time
  -labsl_base -labsl_spinlock_wait -labsl_raw_logging_internal -labsl_exponential_biased"
