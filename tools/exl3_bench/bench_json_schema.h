// The JSON schema the constrained-decoding benchmarks constrain output to: exl3-constraint-bench
// (tools/constraint_bench.cc, the host cost per sequence and step) and exl3-engine-bench
// --constrained-tokenizer (tools/exl3_bench/constraint_step_bench.h, the engine's step). One
// schema so that both measure the same grammar (bench/results/structured-output.md): a name of at
// most 20 characters, an integer, an array of strings, a boolean.
#pragma once

namespace exl3::bench {

inline constexpr char kBenchJsonSchema[] = R"({"type": "object", "properties": {
  "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
  "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}},
  "required": ["name", "age", "tags", "ok"]})";

}  // namespace exl3::bench
