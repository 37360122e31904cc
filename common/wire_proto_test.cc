#include "common/wire_proto.h"

#include <string>

#include "gtest/gtest.h"
#include "odyssey/v1/odyssey.pb.h"

namespace odyssey {
namespace {

namespace v1 = odyssey::v1;

TEST(WireProtoTest, AMessageWithInvalidUtf8ParsesAfterMakeWireSafe) {
  v1::WorkerMessage m;
  m.mutable_result()->set_job("jobs/3");
  m.mutable_result()->set_error("data.path: line 1: invalid JSON (\x8b\x08)");
  // What the receiver's parser does with the message as it stands: refuses it.
  v1::WorkerMessage parsed;
  std::string wire;
  ASSERT_TRUE(m.SerializeToString(&wire));  // serializing only logs the problem
  EXPECT_FALSE(parsed.ParseFromString(wire));

  EXPECT_EQ(MakeWireSafe(&m), 1);
  ASSERT_TRUE(m.SerializeToString(&wire));
  ASSERT_TRUE(parsed.ParseFromString(wire));
  EXPECT_EQ(parsed.result().error(), "data.path: line 1: invalid JSON (\\x8b\x08)");  // 0x08 is UTF-8
  EXPECT_EQ(parsed.result().job(), "jobs/3");
  EXPECT_EQ(MakeWireSafe(&m), 0);  // nothing left to change
}

TEST(WireProtoTest, RepeatedAndNestedStringsAreFixedAndBytesAreNot) {
  v1::WorkerMessage m;
  m.mutable_held()->add_jobs("jobs/1");
  m.mutable_held()->add_jobs("jobs/\xff");
  EXPECT_EQ(MakeWireSafe(&m), 1);
  EXPECT_EQ(m.held().jobs(1), "jobs/\\xff");
  EXPECT_EQ(m.held().jobs(0), "jobs/1");
}

}  // namespace
}  // namespace odyssey
