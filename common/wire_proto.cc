#include "common/wire_proto.h"

#include <string>

#include "common/wire_text.h"
#include "google/protobuf/descriptor.h"

namespace odyssey {

namespace pb = google::protobuf;

int MakeWireSafe(pb::Message* message) {
  const pb::Reflection* r = message->GetReflection();
  std::vector<const pb::FieldDescriptor*> fields;
  r->ListFields(*message, &fields);  // only the fields that are set
  int changed = 0;
  for (const pb::FieldDescriptor* f : fields) {
    if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
      if (f->is_repeated()) {
        for (int i = 0; i < r->FieldSize(*message, f); ++i) {
          changed += MakeWireSafe(r->MutableRepeatedMessage(message, f, i));
        }
      } else {
        changed += MakeWireSafe(r->MutableMessage(message, f));
      }
      continue;
    }
    if (f->type() != pb::FieldDescriptor::TYPE_STRING) continue;  // bytes may hold anything
    if (f->is_repeated()) {
      for (int i = 0; i < r->FieldSize(*message, f); ++i) {
        const std::string& s = r->GetRepeatedStringReference(*message, f, i, nullptr);
        std::string valid = ValidUtf8(s);
        if (valid != s) {
          r->SetRepeatedString(message, f, i, std::move(valid));
          ++changed;
        }
      }
    } else {
      std::string scratch;
      const std::string& s = r->GetStringReference(*message, f, &scratch);
      std::string valid = ValidUtf8(s);
      if (valid != s) {
        r->SetString(message, f, std::move(valid));
        ++changed;
      }
    }
  }
  return changed;
}

}  // namespace odyssey
