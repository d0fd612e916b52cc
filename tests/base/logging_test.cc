// base/logging.h: the two formats of a line (text, JSON), an event's fields in each, and the
// quoting that keeps a line one line (and a JSON line valid JSON) whatever a client sent.
#include "base/logging.h"

#include <string>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace exl3 {
namespace {

// Logs with `format` at info while `write` runs; the captured stderr.
template <typename F>
std::string Captured(LogFormat format, F write) {
  SetLogLevel(LogLevel::kInfo);
  SetLogFormat(format);
  ::testing::internal::CaptureStderr();
  write();
  std::string out = ::testing::internal::GetCapturedStderr();
  SetLogFormat(LogFormat::kText);
  return out;
}

TEST(QuoteLogValueTest, QuotesWhatWouldBreakALine) {
  EXPECT_EQ(QuoteLogValue("chatcmpl-abc.1_2"), "chatcmpl-abc.1_2");
  EXPECT_EQ(QuoteLogValue(""), "\"\"");
  EXPECT_EQ(QuoteLogValue("a b"), "\"a b\"");
  EXPECT_EQ(QuoteLogValue("k=v"), "\"k=v\"");
  EXPECT_EQ(QuoteLogValue("say \"hi\"\\"), "\"say \\\"hi\\\"\\\\\"");
  EXPECT_EQ(QuoteLogValue("two\nlines\x7f"), "\"two\\x0alines\\x7f\"");
  EXPECT_EQ(QuoteLogValue("\xc3\xa9"), "\"\\xc3\\xa9\"");
  EXPECT_EQ(QuoteLogValue(std::string(600, 'x')), "\"" + std::string(512, 'x') + "...\"");
  EXPECT_EQ(QuoteLogValue("abcdef", 3), "\"abc...\"");
}

TEST(JsonStringTest, EscapesControlsAndKeepsValidUtf8) {
  EXPECT_EQ(JsonString("plain"), "\"plain\"");
  EXPECT_EQ(JsonString("a\"b\\c"), "\"a\\\"b\\\\c\"");
  EXPECT_EQ(JsonString("tab\tnl\n\x7f"), "\"tab\\u0009nl\\u000a\\u007f\"");
  EXPECT_EQ(JsonString("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"),
            "\"caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\"");
  // A stray continuation byte, a truncated sequence, an overlong form, a surrogate: U+FFFD each.
  EXPECT_EQ(JsonString("a\x80z"), "\"a\\ufffdz\"");
  EXPECT_EQ(JsonString("a\xc3"), "\"a\\ufffd\"");
  EXPECT_EQ(JsonString("\xc0\xaf"), "\"\\ufffd\\ufffd\"");
  EXPECT_EQ(JsonString("\xed\xa0\x80"), "\"\\ufffd\\ufffd\\ufffd\"");
  for (const char* s : {"a\x80z", "\xff\xfe", "x\xe2\x82"}) {
    EXPECT_TRUE(nlohmann::json::accept(JsonString(s))) << s;
  }
}

TEST(LogEventTest, FieldsAreKeyValueInTextAndMembersInJson) {
  const std::vector<LogField> fields = {
      LogField::Text("id", "chatcmpl-1"), LogField::Int("tokens", 16),
      LogField::Seconds("ttft_s", 0.01214), LogField::Seconds("never_s", std::nullopt),
      LogField::Text("error", "bad \"value\"")};
  EXPECT_EQ(EventText("request end", fields),
            "request end id=chatcmpl-1 tokens=16 ttft_s=0.0121 never_s=none "
            "error=\"bad \\\"value\\\"\"");
  const nlohmann::json j = nlohmann::json::parse("{" + EventJson("request end", fields) + "}");
  EXPECT_EQ(j["event"], "request end");
  EXPECT_EQ(j["message"], EventText("request end", fields));
  EXPECT_EQ(j["id"], "chatcmpl-1");
  EXPECT_EQ(j["tokens"], 16);
  EXPECT_DOUBLE_EQ(j["ttft_s"].get<double>(), 0.0121);
  EXPECT_TRUE(j["never_s"].is_null());
  EXPECT_EQ(j["error"], "bad \"value\"");
}

TEST(LogEventTest, ACutTextIsMarkedInBothFormats) {
  const std::vector<LogField> fields = {LogField::Text("id", "abcdef", 3)};
  EXPECT_EQ(EventText("e", fields), "e id=\"abc...\"");
  EXPECT_EQ(nlohmann::json::parse("{" + EventJson("e", fields) + "}")["id"], "abc...");
}

TEST(LogFormatTest, JsonLinesAreOneObjectEachWithTimeAndLevel) {
  const std::string out = Captured(LogFormat::kJson, [] {
    LogInfo("loaded %d experts in %.2f s \"quoted\"\n", 8, 0.21);
    LogWarning("second");
    LogDebug("not at info");
    LogEvent(LogLevel::kError, "request end", {LogField::Int("tokens", 3)});
  });
  std::vector<nlohmann::json> lines;
  size_t start = 0;
  for (size_t nl; (nl = out.find('\n', start)) != std::string::npos; start = nl + 1) {
    lines.push_back(nlohmann::json::parse(out.substr(start, nl - start)));
  }
  EXPECT_EQ(start, out.size()) << "the output ends with a whole line: " << out;
  ASSERT_EQ(lines.size(), 3u) << out;
  EXPECT_EQ(lines[0]["level"], "INFO");
  EXPECT_EQ(lines[0]["message"], "loaded 8 experts in 0.21 s \"quoted\"\n");
  EXPECT_EQ(lines[1]["level"], "WARNING");
  EXPECT_EQ(lines[2]["level"], "ERROR");
  EXPECT_EQ(lines[2]["message"], "request end tokens=3");
  EXPECT_EQ(lines[2]["event"], "request end");
  EXPECT_EQ(lines[2]["tokens"], 3);
  for (const nlohmann::json& j : lines) {
    const std::string t = j["time"];  // 2026-12-07T12:00:00.000Z
    ASSERT_EQ(t.size(), 24u) << t;
    EXPECT_EQ(t[10], 'T');
    EXPECT_EQ(t.back(), 'Z');
  }
}

TEST(LogFormatTest, TextLinesStartWithTheLevelLetterAndTime) {
  const std::string out = Captured(LogFormat::kText, [] {
    LogInfo("hello");
    LogEvent(LogLevel::kWarning, "request start", {LogField::Text("id", "a b")});
  });
  // "I 12:00:00.000 hello\nW 12:00:00.000 request start id=\"a b\"\n"
  const size_t nl = out.find('\n');
  ASSERT_NE(nl, std::string::npos) << out;
  EXPECT_EQ(out.substr(0, 2), "I ");
  EXPECT_EQ(out.substr(15, nl - 15), "hello");
  EXPECT_EQ(out.substr(nl + 1, 2), "W ");
  EXPECT_EQ(out.substr(nl + 16), "request start id=\"a b\"\n");
}

TEST(LogFormatTest, NamesParse) {
  LogFormat f = LogFormat::kText;
  EXPECT_TRUE(ParseLogFormat("json", &f));
  EXPECT_EQ(f, LogFormat::kJson);
  EXPECT_TRUE(ParseLogFormat("text", &f));
  EXPECT_EQ(f, LogFormat::kText);
  EXPECT_FALSE(ParseLogFormat("JSON", &f));
  LogLevel l = LogLevel::kInfo;
  EXPECT_TRUE(ParseLogLevel("warning", &l));
  EXPECT_EQ(l, LogLevel::kWarning);
  EXPECT_FALSE(ParseLogLevel("warn", &l));
}

}  // namespace
}  // namespace exl3
