# Run by cmake/xgrammar.cmake on xgrammar 0.2.9's unpacked sources (cmake -DSOURCE_DIR=... -P):
#  1. its cmake/config.cmake turns the Python bindings on (they need tvm_ffi): replaced by
#     cmake/xgrammar_config.cmake, the C++ library alone;
#  2. json_schema_converter.cc: a string with minLength/maxLength takes any character but `"`,
#     `\`, CR and LF, so the other control characters (U+0000-U+001F) came out raw, which JSON
#     forbids (RFC 8259 section 7; Python's json.loads refuses them): they are excluded, as the
#     library's unbounded strings already do (tests/engine/structured_output_test.cc found it).
# Each change must apply: a different archive fails the build here instead of building unfixed.
file(COPY_FILE ${CMAKE_CURRENT_LIST_DIR}/xgrammar_config.cmake ${SOURCE_DIR}/cmake/config.cmake)

set(converter ${SOURCE_DIR}/cpp/json_schema_converter.cc)
file(READ ${converter} text)
set(bounded_string_class [[builder_.AddCharacterClass({{'"', '"'}, {'\\', '\\'}, {'\r', '\r'}, {'\n', '\n'}}, true);]])
set(json_string_class [[builder_.AddCharacterClass({{0, 0x1f}, {'"', '"'}, {'\\', '\\'}}, true);]])
string(FIND "${text}" "${bounded_string_class}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "xgrammar_patch.cmake: the bounded string's character class is not in ${converter}")
endif()
string(REPLACE "${bounded_string_class}" "${json_string_class}" text "${text}")
file(WRITE ${converter} "${text}")
