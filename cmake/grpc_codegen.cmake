# protoc and the gRPC plugins, looked up once for the whole build, and exl3_grpc_library(), which
# generates the C++ protobuf and gRPC code of .proto files into a static library.
# Included by the top-level CMakeLists.txt when the services are built (protobuf and gRPC found).

if(TARGET protobuf::protoc)
  set(EXL3_PROTOC $<TARGET_FILE:protobuf::protoc>)
else()
  find_program(EXL3_PROTOC protoc REQUIRED)
endif()
if(TARGET gRPC::grpc_cpp_plugin)
  set(EXL3_GRPC_CPP_PLUGIN $<TARGET_FILE:gRPC::grpc_cpp_plugin>)
else()
  find_program(EXL3_GRPC_CPP_PLUGIN grpc_cpp_plugin REQUIRED)
endif()
# Optional: the Python stubs the process-level tests use (tests/services/router; Debian package
# protobuf-compiler-grpc). Without it those tests are not registered.
find_program(EXL3_GRPC_PYTHON_PLUGIN grpc_python_plugin)

# exl3_grpc_library(NAME PROTO_ROOT dir OUT_DIR dir PROTOS a.proto ...)
# PROTOS are paths relative to PROTO_ROOT (protoc's --proto_path); the generated files keep those
# paths under OUT_DIR, which is the library's public include directory: PROTO_ROOT/x/y.proto is
# included as "x/y.pb.h" and "x/y.grpc.pb.h".
function(exl3_grpc_library name)
  cmake_parse_arguments(ARG "" "PROTO_ROOT;OUT_DIR" "PROTOS" ${ARGN})
  set(srcs)
  foreach(proto ${ARG_PROTOS})
    string(REGEX REPLACE "\\.proto$" "" stem ${proto})
    set(outs
      ${ARG_OUT_DIR}/${stem}.pb.cc ${ARG_OUT_DIR}/${stem}.pb.h
      ${ARG_OUT_DIR}/${stem}.grpc.pb.cc ${ARG_OUT_DIR}/${stem}.grpc.pb.h)
    add_custom_command(
      OUTPUT ${outs}
      COMMAND ${CMAKE_COMMAND} -E make_directory ${ARG_OUT_DIR}
      COMMAND ${EXL3_PROTOC}
        --proto_path=${ARG_PROTO_ROOT}
        --cpp_out=${ARG_OUT_DIR}
        --grpc_out=${ARG_OUT_DIR}
        --plugin=protoc-gen-grpc=${EXL3_GRPC_CPP_PLUGIN}
        ${ARG_PROTO_ROOT}/${proto}
      DEPENDS ${ARG_PROTO_ROOT}/${proto}
      COMMENT "protoc ${proto}"
      VERBATIM)
    list(APPEND srcs ${outs})
  endforeach()
  add_library(${name} STATIC ${srcs})
  target_include_directories(${name} PUBLIC ${ARG_OUT_DIR})
  target_link_libraries(${name} PUBLIC protobuf::libprotobuf gRPC::grpc++)
  # Generated code is not ours to warn about.
  target_compile_options(${name} PRIVATE -w)
endfunction()
