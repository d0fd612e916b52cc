// The text of token ids under a byte-level BPE tokenizer.json (the test models' tokenizers,
// tests/fixtures/tokenizer): model.vocab's token strings map back to bytes through GPT-2's
// byte-to-character table; added tokens are their content. For tests that read what a model
// generated.
#pragma once

#include <cstdint>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"

namespace exl3::engine::testing {

class ByteLevelVocab {
 public:
  static ByteLevelVocab Load(const std::string& tokenizer_json_path) {
    std::ifstream in(tokenizer_json_path);
    const nlohmann::json doc = nlohmann::json::parse(in);
    // GPT-2's table: printable bytes stand for themselves, the others for U+0100 onwards.
    std::map<char32_t, uint8_t> byte_of;
    int next = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      byte_of[printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + next++)] =
          static_cast<uint8_t>(b);
    }
    ByteLevelVocab v;
    for (const auto& [token, id] : doc["model"]["vocab"].items()) {
      std::string bytes;
      for (char32_t c : DecodeUtf8(token)) bytes += static_cast<char>(byte_of.at(c));
      v.Put(id.get<int>(), bytes);
    }
    for (const auto& t : doc["added_tokens"]) v.Put(t["id"].get<int>(), t["content"].get<std::string>());
    return v;
  }

  int size() const { return static_cast<int>(text_.size()); }
  const std::string& Text(int32_t id) const { return text_.at(id); }
  std::string Decode(const std::vector<int32_t>& ids) const {
    std::string out;
    for (int32_t id : ids) out += Text(id);
    return out;
  }

 private:
  void Put(int id, std::string text) {
    if (id >= static_cast<int>(text_.size())) text_.resize(id + 1);
    text_[id] = std::move(text);
  }
  static std::u32string DecodeUtf8(const std::string& s) {
    std::u32string out;
    for (size_t i = 0; i < s.size();) {
      const unsigned char c = s[i];
      const int n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
      char32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
      for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
      out += cp;
      i += n;
    }
    return out;
  }
  std::vector<std::string> text_;
};

}  // namespace exl3::engine::testing
