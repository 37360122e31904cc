#include "client/spec.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "yaml-cpp/yaml.h"

namespace odyssey::client {
namespace {

// YAML -> JSON with every scalar as a string (protobuf's JSON mapping converts strings to the
// field's number/bool/enum type and reports the field when it cannot).
absl::StatusOr<nlohmann::json> ToJson(const YAML::Node& node, const std::string& path) {
  switch (node.Type()) {
    case YAML::NodeType::Null:
    case YAML::NodeType::Undefined:
      return nlohmann::json();
    case YAML::NodeType::Scalar:
      return nlohmann::json(node.Scalar());
    case YAML::NodeType::Sequence: {
      nlohmann::json out = nlohmann::json::array();
      for (size_t i = 0; i < node.size(); ++i) {
        auto item = ToJson(node[i], absl::StrCat(path, "[", i, "]"));
        if (!item.ok()) return item.status();
        out.push_back(std::move(*item));
      }
      return out;
    }
    case YAML::NodeType::Map: {
      nlohmann::json out = nlohmann::json::object();
      for (const auto& kv : node) {
        if (!kv.first.IsScalar()) {
          return absl::InvalidArgumentError(absl::StrCat(path.empty() ? "(top)" : path, ": keys must be plain names"));
        }
        const std::string key = kv.first.Scalar();
        auto value = ToJson(kv.second, path.empty() ? key : absl::StrCat(path, ".", key));
        if (!value.ok()) return value.status();
        if (!value->is_null()) out[key] = std::move(*value);
      }
      return out;
    }
  }
  return nlohmann::json();
}

// protobuf's "(optimizer) lrr: Cannot find field." -> "optimizer.lrr: unknown field";
// "(steps): invalid value 1.5 for type TYPE_INT64" -> "steps: invalid value 1.5 for type int64".
// Plain string surgery (no std::regex: GCC 12/13 warn falsely inside it under -Werror).
std::string Humanize(const std::string& message) {
  std::string path, rest = message;
  if (!rest.empty() && rest[0] == '(') {
    const size_t close = rest.find(')');
    if (close == std::string::npos) return message;
    path = rest.substr(1, close - 1);
    rest = rest.substr(close + 1);
  }
  const std::string kUnknown = ": Cannot find field";
  if (const size_t at = rest.find(kUnknown); at != std::string::npos) {
    std::string name(absl::StripAsciiWhitespace(rest.substr(0, at)));
    return absl::StrCat(path, path.empty() || name.empty() ? "" : ".", name, ": unknown field");
  }
  if (path.empty() || rest.rfind(": ", 0) != 0) return message;
  std::string rule = rest.substr(2);
  if (const size_t t = rule.find("TYPE_"); t != std::string::npos) {
    size_t end = t + 5;
    while (end < rule.size() && (absl::ascii_isupper(rule[end]) || absl::ascii_isdigit(rule[end]))) ++end;
    rule = absl::StrCat(rule.substr(0, t), absl::AsciiStrToLower(rule.substr(t + 5, end - t - 5)), rule.substr(end));
  }
  rule = absl::StrReplaceAll(rule, {{"type.googleapis.com/odyssey.v1.", "enum "}});
  return absl::StrCat(path, ": ", rule);
}

}  // namespace

absl::StatusOr<odyssey::v1::JobSpec> ParseJobSpec(const std::string& text, const std::string& source) {
  std::string json_text;
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && text[first] == '{') {
    json_text = text;
  } else {
    YAML::Node root;
    try {
      root = YAML::Load(text);
    } catch (const YAML::Exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": not valid YAML: ", e.what()));
    }
    if (!root.IsMap()) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": must be a mapping of JobSpec fields (model, optimizer, data, steps, ...)"));
    }
    auto json = ToJson(root, "");
    if (!json.ok()) return absl::InvalidArgumentError(absl::StrCat(source, ": ", json.status().message()));
    json_text = json->dump();
  }
  odyssey::v1::JobSpec spec;
  google::protobuf::util::JsonParseOptions options;
  auto status = google::protobuf::util::JsonStringToMessage(json_text, &spec, options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", Humanize(std::string(status.message()))));
  }
  return spec;
}

absl::StatusOr<odyssey::v1::JobSpec> LoadJobSpec(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot read the spec file"));
  std::stringstream buffer;
  buffer << in.rdbuf();
  return ParseJobSpec(buffer.str(), path);
}

}  // namespace odyssey::client
