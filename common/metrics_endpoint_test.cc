#include "common/metrics_endpoint.h"

#include <httplib.h>

#include "common/version.h"
#include "gtest/gtest.h"
#include "prometheus/counter.h"

namespace odyssey {
namespace {

TEST(ParseHostPortTest, AcceptsHostPortAndRejectsGarbage) {
  auto hp = ParseHostPort("127.0.0.1:0");
  ASSERT_TRUE(hp.ok());
  EXPECT_EQ(hp->first, "127.0.0.1");
  EXPECT_EQ(hp->second, 0);
  hp = ParseHostPort("[::1]:8080");
  ASSERT_TRUE(hp.ok());
  EXPECT_EQ(hp->first, "::1");
  EXPECT_FALSE(ParseHostPort("localhost").ok());
  EXPECT_FALSE(ParseHostPort("localhost:http").ok());
  EXPECT_FALSE(ParseHostPort("localhost:70000").ok());
}

TEST(MetricsEndpointTest, ServesRegistryAndCountersMove) {
  auto registry = std::make_shared<prometheus::Registry>();
  auto& counter = prometheus::BuildCounter()
                      .Name("odyssey_test_events_total")
                      .Help("test")
                      .Register(*registry)
                      .Add({});
  auto endpoint = MetricsEndpoint::Create("127.0.0.1:0", registry);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  ASSERT_GT((*endpoint)->port(), 0);

  httplib::Client client("127.0.0.1", (*endpoint)->port());
  counter.Increment(3);
  auto res = client.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
  EXPECT_NE(res->body.find("odyssey_test_events_total 3"), std::string::npos) << res->body;
  counter.Increment(2);
  res = client.Get("/metrics");
  ASSERT_TRUE(res);
  EXPECT_NE(res->body.find("odyssey_test_events_total 5"), std::string::npos) << res->body;
  res = client.Get("/healthz");
  ASSERT_TRUE(res);
  EXPECT_EQ(res->status, 200);
}

TEST(MetricsEndpointTest, ServesBuildInfoWithTheVersionTheBinariesPrint) {
  auto registry = std::make_shared<prometheus::Registry>();
  auto endpoint = MetricsEndpoint::Create("127.0.0.1:0", registry);
  ASSERT_TRUE(endpoint.ok()) << endpoint.status();
  RegisterBuildInfo(*registry);  // a second registration changes nothing
  httplib::Client client("127.0.0.1", (*endpoint)->port());
  auto res = client.Get("/metrics");
  ASSERT_TRUE(res);
  const std::string want = std::string("odyssey_build_info{revision=\"") + SourceRevision() + "\",version=\"" +
                           ProjectVersion() + "\"} 1";
  EXPECT_NE(res->body.find(want), std::string::npos) << res->body;
  EXPECT_EQ(res->body.find("odyssey_build_info{", res->body.find(want) + 1), std::string::npos) << res->body;
  EXPECT_EQ(VersionLine("odyssey").rfind(std::string("odyssey ") + ProjectVersion(), 0), 0u);
  EXPECT_STRNE(ProjectVersion(), "");
}

TEST(MetricsEndpointTest, BusyPortIsAnError) {
  auto registry = std::make_shared<prometheus::Registry>();
  auto first = MetricsEndpoint::Create("127.0.0.1:0", registry);
  ASSERT_TRUE(first.ok());
  auto second =
      MetricsEndpoint::Create("127.0.0.1:" + std::to_string((*first)->port()), registry);
  EXPECT_FALSE(second.ok());
}

}  // namespace
}  // namespace odyssey
