#include "engine/sampling/token_grammar.h"

#include <algorithm>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <variant>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "engine/sampling/token_grammar_impl.h"
#include "nlohmann/json.hpp"

namespace exl3::engine {
namespace {

// xgrammar reports errors by exception; they stop here, as statuses.
template <typename F>
auto CatchLibraryError(const char* what, F&& f) -> absl::StatusOr<decltype(f())> {
  try {
    return f();
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", e.what()));
  }
}

// The token strings of tokenizer.json by id (model.vocab and added_tokens); ids it does not name
// stay empty.
absl::StatusOr<std::vector<std::string>> EncodedVocab(std::string_view tokenizer_json,
                                                      int vocab_size) {
  const nlohmann::json doc = nlohmann::json::parse(tokenizer_json, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) {
    return absl::InvalidArgumentError("tokenizer.json is not a JSON object");
  }
  std::vector<std::string> vocab;
  auto put = [&](int64_t id, std::string token) -> absl::Status {
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.json names token id ", id,
                                                     ", outside the model's vocabulary [0, ",
                                                     vocab_size, ")"));
    }
    if (static_cast<size_t>(id) >= vocab.size()) vocab.resize(id + 1);
    vocab[id] = std::move(token);
    return absl::OkStatus();
  };
  const nlohmann::json* model_vocab = nullptr;
  if (const auto model = doc.find("model"); model != doc.end() && model->is_object()) {
    if (const auto v = model->find("vocab"); v != model->end()) model_vocab = &*v;
  }
  if (model_vocab == nullptr) return absl::InvalidArgumentError("tokenizer.json has no model.vocab");
  if (model_vocab->is_object()) {  // BPE, WordPiece, WordLevel: token -> id
    for (const auto& [token, id] : model_vocab->items()) {
      if (!id.is_number_integer()) return absl::InvalidArgumentError("tokenizer.json: a model.vocab id is no integer");
      if (absl::Status s = put(id.get<int64_t>(), token); !s.ok()) return s;
    }
  } else if (model_vocab->is_array()) {  // Unigram: [token, score] by id
    for (size_t id = 0; id < model_vocab->size(); ++id) {
      const auto& entry = (*model_vocab)[id];
      if (!entry.is_array() || entry.empty() || !entry[0].is_string()) {
        return absl::InvalidArgumentError("tokenizer.json: a model.vocab entry is no [token, score]");
      }
      if (absl::Status s = put(static_cast<int64_t>(id), entry[0].get<std::string>()); !s.ok()) return s;
    }
  } else {
    return absl::InvalidArgumentError("tokenizer.json: model.vocab is neither an object nor a list");
  }
  if (const auto added = doc.find("added_tokens"); added != doc.end() && added->is_array()) {
    for (const auto& t : *added) {
      const auto id = t.find("id");
      const auto content = t.find("content");
      if (id == t.end() || !id->is_number_integer() || content == t.end() || !content->is_string()) {
        return absl::InvalidArgumentError("tokenizer.json: an added token has no id or content");
      }
      if (absl::Status s = put(id->get<int64_t>(), content->get<std::string>()); !s.ok()) return s;
    }
  }
  return vocab;
}

// A string as an EBNF literal (xgrammar's escapes).
std::string EbnfLiteral(std::string_view s) {
  std::string out = "\"";
  for (const char c : s) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (u < 0x20 || u == 0x7f) {
      out += absl::StrFormat("\\x%02x", u);
    } else {
      out += c;  // UTF-8 bytes as they are: the literal is read as UTF-8
    }
  }
  return out + "\"";
}

// A structural tag's grammar; its errors thrown, as the library's other constructors throw theirs.
xgrammar::Grammar StructuralTagGrammar(const std::string& json,
                                       const std::optional<xgrammar::TokenizerInfo>& info) {
  auto grammar = xgrammar::Grammar::FromStructuralTag(json, info);
  if (auto* error = std::get_if<xgrammar::StructuralTagError>(&grammar)) {
    throw std::runtime_error(std::visit([](const auto& e) { return std::string(e.what()); }, *error));
  }
  return std::get<xgrammar::Grammar>(std::move(grammar));
}

// kCompact: each json_schema node of the tag (JSON style, no other options) becomes a grammar
// node of the compact JSON of its schema, as kJsonSchema compiles it.
void CompactJsonNodes(nlohmann::json& node) {
  if (node.is_array()) {
    for (nlohmann::json& item : node) CompactJsonNodes(item);
    return;
  }
  if (!node.is_object()) return;
  const auto type = node.find("type");
  const auto schema = node.find("json_schema");
  const bool plain_json = type != node.end() && *type == "json_schema" && schema != node.end() &&
                          std::all_of(node.items().begin(), node.items().end(), [](const auto& kv) {
                            return kv.key() == "type" || kv.key() == "json_schema" ||
                                   (kv.key() == "style" && kv.value() == "json");
                          });
  if (plain_json) {
    const std::string schema_text = schema->is_string() ? schema->get<std::string>() : schema->dump();
    node = {{"type", "grammar"},
            {"grammar", xgrammar::Grammar::FromJSONSchema(schema_text, /*any_whitespace=*/false)
                            .ToString()}};
    return;
  }
  for (auto& [key, value] : node.items()) CompactJsonNodes(value);
}

// What the constraint alone matches.
xgrammar::Grammar ConstraintGrammar(const ConstraintSpec& spec, const xgrammar::TokenizerInfo& info) {
  using xgrammar::Grammar;
  switch (spec.kind) {
    case ConstraintKind::kJsonSchema:
      // Compact JSON (no free whitespace: a model cannot run on in blanks), strict: no
      // properties the schema does not name.
      return Grammar::FromJSONSchema(spec.text, /*any_whitespace=*/false);
    case ConstraintKind::kJsonObject:
      return Grammar::FromJSONSchema(R"({"type": "object"})", /*any_whitespace=*/false,
                                     std::nullopt, std::nullopt, /*strict_mode=*/false);
    case ConstraintKind::kRegex:
      return Grammar::FromRegex(spec.text);
    case ConstraintKind::kGrammar:
      return Grammar::FromEBNF(spec.text, "root");
    case ConstraintKind::kStructuralTag: {
      if (spec.tag_json == StructuralTagJson::kFreeWhitespace) {
        return StructuralTagGrammar(spec.text, info);
      }
      nlohmann::json tag = nlohmann::json::parse(spec.text);  // throws on bad JSON: refused
      CompactJsonNodes(tag);
      return StructuralTagGrammar(tag.dump(), info);
    }
    case ConstraintKind::kTaggedJson: {
      // Each alternative: its begin literal, the schema's JSON (as kJsonSchema compiles it),
      // its end literal; the alternatives' union.
      std::vector<Grammar> alternatives;
      for (const TaggedJson& t : spec.tagged) {
        std::vector<Grammar> parts;
        if (!t.begin.empty()) parts.push_back(Grammar::FromEBNF("root ::= " + EbnfLiteral(t.begin)));
        parts.push_back(Grammar::FromJSONSchema(t.json_schema, /*any_whitespace=*/false));
        if (!t.end.empty()) parts.push_back(Grammar::FromEBNF("root ::= " + EbnfLiteral(t.end)));
        alternatives.push_back(parts.size() == 1 ? parts[0] : Grammar::Concat(parts));
      }
      return alternatives.size() == 1 ? alternatives[0] : Grammar::Union(alternatives);
    }
    case ConstraintKind::kChoice:
      break;
  }
  std::string ebnf = "root ::= ";
  for (size_t i = 0; i < spec.choices.size(); ++i) {
    if (i > 0) ebnf += " | ";
    ebnf += EbnfLiteral(spec.choices[i]);
  }
  return Grammar::FromEBNF(ebnf, "root");
}

// The reasoning block before the constrained answer: any text up to the block's end string, then
// up to kWhitespaceAfterReasoning whitespace characters (templates write "</think>\n\n").
constexpr int kWhitespaceAfterReasoning = 4;

xgrammar::Grammar ReasoningGrammar(const ReasoningBlock& block) {
  nlohmann::json block_format;
  if (block.opening == ReasoningBlock::Opening::kStartsInside) {
    // Everything before the end string is reasoning (a repeated start string included).
    block_format = {{"type", "sequence"},
                    {"elements", {{{"type", "any_text"}, {"excludes", {block.end}}},
                                  {{"type", "const_string"}, {"value", block.end}}}}};
  } else {
    block_format = {{"type", "optional"},
                    {"content", {{"type", "tag"},
                                 {"begin", block.start},
                                 {"content", {{"type", "any_text"}}},
                                 {"end", block.end}}}};
  }
  const nlohmann::json tag = {
      {"type", "structural_tag"},
      {"format", {{"type", "sequence"},
                  {"elements", {block_format,
                                {{"type", "regex"},
                                 {"pattern", absl::StrCat("[ \\t\\r\\n]{0,", kWhitespaceAfterReasoning,
                                                          "}")}}}}}}};
  return StructuralTagGrammar(tag.dump(), std::nullopt);
}

}  // namespace

TokenGrammar::TokenGrammar(std::unique_ptr<TokenGrammarImpl> impl, int vocab_size)
    : impl_(std::move(impl)), vocab_size_(vocab_size) {}
TokenGrammar::~TokenGrammar() = default;

struct TokenGrammarCompiler::Impl {
  xgrammar::TokenizerInfo info;  // the vocabulary (structural tags name tokens by their strings)
  xgrammar::GrammarCompiler compiler;
};

TokenGrammarCompiler::TokenGrammarCompiler(std::unique_ptr<Impl> impl, int vocab_size)
    : impl_(std::move(impl)), vocab_size_(vocab_size) {}
TokenGrammarCompiler::~TokenGrammarCompiler() = default;

absl::StatusOr<std::unique_ptr<TokenGrammarCompiler>> TokenGrammarCompiler::FromTokenizerJson(
    std::string_view tokenizer_json, int vocab_size, std::vector<int32_t> stop_token_ids) {
  if (vocab_size < 1) return absl::InvalidArgumentError("the vocabulary size must be >= 1");
  for (int32_t id : stop_token_ids) {
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("stop token ", id, " is outside the vocabulary"));
    }
  }
  auto vocab = EncodedVocab(tokenizer_json, vocab_size);
  if (!vocab.ok()) return vocab.status();
  auto impl = CatchLibraryError("tokenizer.json", [&] {
    const std::string metadata = xgrammar::TokenizerInfo::DetectMetadataFromHF(std::string(tokenizer_json));
    const nlohmann::json m = nlohmann::json::parse(metadata);
    const auto vocab_type = static_cast<xgrammar::VocabType>(m.at("vocab_type").get<int>());
    const bool add_prefix_space = m.at("add_prefix_space").get<bool>();
    xgrammar::TokenizerInfo info(*vocab, vocab_type, vocab_size, stop_token_ids, add_prefix_space);
    // Compiling a grammar precomputes masks over the vocabulary: a few threads, and a bounded
    // cache of compiled grammars (requests repeat their schemas).
    xgrammar::GrammarCompiler compiler(info, /*max_threads=*/4, /*cache_enabled=*/true,
                                       /*max_memory_bytes=*/int64_t{256} << 20);
    return std::make_unique<Impl>(Impl{std::move(info), std::move(compiler)});
  });
  if (!impl.ok()) return impl.status();
  return std::unique_ptr<TokenGrammarCompiler>(
      new TokenGrammarCompiler(*std::move(impl), vocab_size));
}

absl::StatusOr<std::shared_ptr<const TokenGrammar>> TokenGrammarCompiler::Compile(
    const ConstraintSpec& spec) const {
  if (spec.kind == ConstraintKind::kChoice && spec.choices.empty()) {
    return absl::InvalidArgumentError("the choice constraint needs at least one choice");
  }
  if (spec.kind == ConstraintKind::kTaggedJson && spec.tagged.empty()) {
    return absl::InvalidArgumentError("the tagged_json constraint needs at least one alternative");
  }
  if (spec.after_reasoning.has_value() &&
      (spec.after_reasoning->start.empty() || spec.after_reasoning->end.empty())) {
    return absl::InvalidArgumentError(absl::StrCat("the ", ConstraintKindName(spec.kind),
                                                   " constraint: a reasoning block before it "
                                                   "needs its start and end strings"));
  }
  xgrammar::GrammarCompiler& c = impl_->compiler;
  const std::string what = absl::StrCat("the ", ConstraintKindName(spec.kind), " constraint");
  auto compiled = CatchLibraryError(what.c_str(), [&]() -> xgrammar::CompiledGrammar {
    xgrammar::Grammar grammar = ConstraintGrammar(spec, impl_->info);
    if (spec.after_reasoning.has_value()) {
      grammar = xgrammar::Grammar::Concat({ReasoningGrammar(*spec.after_reasoning), grammar});
    }
    // Cached by the grammar's text (xgrammar's cache): a repeated constraint compiles once.
    return c.CompileGrammar(grammar);
  });
  if (!compiled.ok()) return compiled.status();
  return std::make_shared<const TokenGrammar>(
      std::make_unique<TokenGrammarImpl>(TokenGrammarImpl{std::move(*compiled)}), vocab_size_);
}

}  // namespace exl3::engine
