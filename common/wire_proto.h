// The proto side of common/wire_text.h: a message made safe to send.
#pragma once

#include "google/protobuf/message.h"

namespace odyssey {

// Replaces, in place, every `string` field of `message` (nested messages, repeated fields and
// map values included; `bytes` fields untouched) that is not valid UTF-8 with ValidUtf8 of it,
// so the receiver's parser never refuses the message. Returns the number of fields changed.
// A process calls it on each message it writes to a stream whose text it does not fully
// control (the worker: job errors, engine messages, paths).
int MakeWireSafe(google::protobuf::Message* message);

}  // namespace odyssey
