#include "model/index_ranges.h"

#include <algorithm>
#include <cctype>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace exl3 {

namespace {

std::string Trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

bool ParseInt(const std::string& s, int64_t* out) {
  if (s.empty() || s.size() > 12) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  *out = std::stoll(s);
  return true;
}

}  // namespace

absl::StatusOr<std::vector<int32_t>> ParseIndexRanges(std::string_view text, int limit) {
  const std::string t = Trim(text);
  std::vector<int32_t> out;
  if (t == "all") {
    for (int i = 0; i < limit; ++i) out.push_back(i);
    return out;
  }
  if (t.empty()) return absl::InvalidArgumentError("empty range");
  size_t pos = 0;
  while (pos <= t.size()) {
    size_t comma = t.find(',', pos);
    if (comma == std::string::npos) comma = t.size();
    const std::string part = Trim(std::string_view(t).substr(pos, comma - pos));
    pos = comma + 1;
    int64_t lo, hi;
    const size_t dash = part.find('-', 1);
    if (dash == std::string::npos) {
      if (!ParseInt(part, &lo)) {
        return absl::InvalidArgumentError(absl::StrCat("bad index \"", part, "\""));
      }
      hi = lo;
    } else if (!ParseInt(Trim(std::string_view(part).substr(0, dash)), &lo) ||
               !ParseInt(Trim(std::string_view(part).substr(dash + 1)), &hi)) {
      return absl::InvalidArgumentError(absl::StrCat("bad range \"", part, "\""));
    }
    if (hi < lo || hi >= limit) {
      return absl::InvalidArgumentError(
          absl::StrCat("range \"", part, "\" outside 0..", limit - 1));
    }
    for (int64_t i = lo; i <= hi; ++i) out.push_back(static_cast<int32_t>(i));
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::string FormatIndexRanges(const std::vector<int32_t>& v) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < v.size();) {
    size_t j = i;
    while (j + 1 < v.size() && v[j + 1] == v[j] + 1) ++j;
    parts.push_back(j == i ? absl::StrCat(v[i]) : absl::StrCat(v[i], "-", v[j]));
    i = j + 1;
  }
  return absl::StrJoin(parts, ",");
}

}  // namespace exl3
