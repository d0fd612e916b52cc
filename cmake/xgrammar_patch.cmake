# Run by cmake/xgrammar.cmake on xgrammar 0.2.9's unpacked sources (cmake -DSOURCE_DIR=... -P):
#  1. its cmake/config.cmake turns the Python bindings on (they need tvm_ffi): replaced by
#     cmake/xgrammar_config.cmake, the C++ library alone;
#  2. json_schema_converter.cc, the characters a JSON string may hold unescaped:
#     - a string with minLength/maxLength took any character but `"`, `\`, CR and LF, so the other
#       control characters (U+0000-U+001F) came out raw, which JSON forbids (RFC 8259 section 7;
#       Python's json.loads refuses them): they are excluded, as its other strings exclude them;
#     - every string took the surrogate code points U+D800-U+DFFF, whose 3-byte encodings
#       (ED A0 80 to ED BF BF) are no UTF-8 (RFC 3629 section 3): a byte-level model emitted them,
#       and the text read back as U+FFFD replacement characters. They are excluded from the
#       three character classes of string bodies.
#  (tests/engine/sampling/structured_output_test.cc found both.)
# Each change must apply: a different archive fails the build here instead of building unfixed.
file(COPY_FILE ${CMAKE_CURRENT_LIST_DIR}/xgrammar_config.cmake ${SOURCE_DIR}/cmake/config.cmake)

set(converter ${SOURCE_DIR}/cpp/json_schema_converter.cc)
file(READ ${converter} text)

function(replace_once from to)
  string(FIND "${text}" "${from}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "xgrammar_patch.cmake: not found in ${converter}: ${from}")
  endif()
  string(REPLACE "${from}" "${to}" replaced "${text}")
  set(text "${replaced}" PARENT_SCOPE)
endfunction()

# The bounded string's characters.
replace_once([[builder_.AddCharacterClass({{'"', '"'}, {'\\', '\\'}, {'\r', '\r'}, {'\n', '\n'}}, true);]]
             [[builder_.AddCharacterClass({{0, 0x1f}, {'"', '"'}, {'\\', '\\'}, {0xD800, 0xDFFF}}, true);]])
# The unbounded string's characters (its basic_string_sub rule).
replace_once([[{{0, 0x1f}, {'"', '"'}, {'\\', '\\'}, {'\r', '\r'}, {'\n', '\n'}}, true]]
             [[{{0, 0x1f}, {'"', '"'}, {'\\', '\\'}, {0xD800, 0xDFFF}}, true]])
# The characters of property names outside a schema's fixed ones (BuildTrieBody).
replace_once([[{0, 0x1f}, {'"', '"'}, {'\\', '\\'}, {'\r', '\r'}, {'\n', '\n'}
  };]]
             [[{0, 0x1f}, {'"', '"'}, {'\\', '\\'}, {0xD800, 0xDFFF}
  };]])
file(WRITE ${converter} "${text}")
