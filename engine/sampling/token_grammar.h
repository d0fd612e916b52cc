// Constrained decoding's grammars: what a request's output must match (a JSON schema, any JSON
// object, a regular expression, an EBNF grammar, one of a list of strings, JSON between fixed
// strings such as a tool call's tags, or an xgrammar structural tag), optionally only after a
// reasoning block the model writes first, compiled once per
// request against the model's vocabulary by xgrammar's C++ core (THIRD_PARTY_NOTICES.md), then
// matched token by token per sequence (engine/sampling/token_constraint.h).
//
//   EXL3_ASSIGN_OR_RETURN(auto compiler, TokenGrammarCompiler::FromTokenizerJson(
//       tokenizer_json_text, /*vocab_size=*/cfg.vocab_size, /*stop_token_ids=*/info.eos_token_ids));
//   EXL3_ASSIGN_OR_RETURN(std::shared_ptr<const TokenGrammar> g,
//                         compiler->Compile({ConstraintKind::kJsonSchema, schema_text}));
//   params.sampling.grammar = g;   // engine/sampling/sampler.h SamplingParams
//
// The vocabulary comes from tokenizer.json (model.vocab and added_tokens: ids and token strings);
// its kind (byte-level BPE, byte fallback, raw) is detected from the same text. Masks cover the
// model's vocab_size (config.json), which may exceed the tokenizer's: ids past the tokenizer's
// vocabulary are never allowed. The stop tokens (the model's EOS ids) are what a completed grammar
// allows next: the sequence ends on one (engine/core/scheduler.h).
//
// Compile is thread-safe and caches what it compiled (xgrammar's cache): the router calls it on
// its gRPC threads, never on the engine's loop thread. Errors: INVALID_ARGUMENT with the library's
// message for a schema, regex or grammar that does not compile; a build configured with
// -DEXL3_WITH_STRUCTURED_OUTPUT=OFF refuses every constraint (UNIMPLEMENTED).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace exl3::engine {

enum class ConstraintKind {
  kJsonSchema,  // text: a JSON schema
  kJsonObject,  // any JSON object (OpenAI's response_format json_object); text unused
  kRegex,       // text: a regular expression the whole output matches
  kGrammar,     // text: an EBNF grammar (GBNF, as xgrammar takes it) whose root rule is `root`
  kChoice,      // choices: the output is exactly one of them
  kTaggedJson,  // tagged: the output is one alternative's begin, JSON of its schema, its end
  // text: xgrammar's structural tag, {"type": "structural_tag", "format": {...}} (the format tree
  // of xgrammar's docs/structural_tag/structural_tag.md: const strings, JSON schemas, regexes,
  // grammars, free text, tags, sequences, alternatives, repetitions)
  kStructuralTag,
};

inline const char* ConstraintKindName(ConstraintKind kind) {
  switch (kind) {
    case ConstraintKind::kJsonSchema: return "json_schema";
    case ConstraintKind::kJsonObject: return "json_object";
    case ConstraintKind::kRegex: return "regex";
    case ConstraintKind::kGrammar: return "grammar";
    case ConstraintKind::kChoice: return "choice";
    case ConstraintKind::kTaggedJson: return "tagged_json";
    case ConstraintKind::kStructuralTag: return "structural_tag";
  }
  return "unknown";
}

// JSON between two fixed strings: a tool call in the model's tags.
struct TaggedJson {
  std::string begin;
  std::string json_schema;
  std::string end;
};

// A thinking model's reasoning block (`<think>...</think>`): free text the constraint does not
// hold, before the constrained answer, as the front end's reasoning split reads it
// (clients/python/exl3serve_client/frontend/reasoning.py).
struct ReasoningBlock {
  enum class Opening {
    kOptional,      // the output may open with `start` (the block), else it is all answer
    kStartsInside,  // the output starts inside the block (its `start` was in the prompt)
  };
  std::string start;
  std::string end;
  Opening opening = Opening::kOptional;
};

// How a structural tag's JSON values are laid out.
enum class StructuralTagJson {
  kFreeWhitespace,  // xgrammar's structural tags: any whitespace between JSON tokens
  kCompact,         // as kJsonSchema: one space after ':' and ',', no other whitespace (the
                    // layout of templates' tojson); for json_schema nodes without options
};

struct ConstraintSpec {
  // Every field initialised, so that brace initialisers may stop after any of them.
  ConstraintKind kind = ConstraintKind::kJsonObject;
  std::string text{};
  std::vector<std::string> choices{};
  std::vector<TaggedJson> tagged{};
  // Set: the constraint holds only after the reasoning block (and at most a few whitespace
  // characters after its end).
  std::optional<ReasoningBlock> after_reasoning{};
  StructuralTagJson tag_json = StructuralTagJson::kFreeWhitespace;  // kStructuralTag only
};

// xgrammar's compiled grammar (engine/sampling/token_grammar_impl.h, which only the files that call
// xgrammar include).
struct TokenGrammarImpl;

// A compiled constraint: immutable, shared by every sequence that uses it.
class TokenGrammar {
 public:
  explicit TokenGrammar(std::unique_ptr<TokenGrammarImpl> impl, int vocab_size);
  ~TokenGrammar();

  int vocab_size() const { return vocab_size_; }  // the masks' length in tokens
  const TokenGrammarImpl& impl() const { return *impl_; }

 private:
  std::unique_ptr<TokenGrammarImpl> impl_;
  int vocab_size_;
};

class TokenGrammarCompiler {
 public:
  // INVALID_ARGUMENT when the text is no tokenizer.json xgrammar can read, or its vocabulary has
  // ids at or past vocab_size.
  static absl::StatusOr<std::unique_ptr<TokenGrammarCompiler>> FromTokenizerJson(
      std::string_view tokenizer_json, int vocab_size, std::vector<int32_t> stop_token_ids);
  ~TokenGrammarCompiler();

  absl::StatusOr<std::shared_ptr<const TokenGrammar>> Compile(const ConstraintSpec& spec) const;
  int vocab_size() const { return vocab_size_; }

 private:
  struct Impl;
  TokenGrammarCompiler(std::unique_ptr<Impl> impl, int vocab_size);
  std::unique_ptr<Impl> impl_;
  int vocab_size_;
};

}  // namespace exl3::engine
