// The operator's Kubernetes layer against the in-process test API server: client
// errors and retries, informers through dropped watches and 410s, the work queue,
// configuration loading and leader election.

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <thread>

#include <cpprest/asyncrt_utils.h>
#include <gtest/gtest.h>

#include "operator/kube/client.h"
#include "operator/kube/config.h"
#include "operator/kube/informer.h"
#include "operator/kube/leader_election.h"
#include "operator/kube/work_queue.h"
#include "tests/support/kube/api_server.h"

namespace meshtrain::kube {
namespace {

using nlohmann::json;
using namespace std::chrono_literals;

class KubeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    testing::ApiServer::Options options;
    options.bookmark_interval_ms = 100;
    server_ = std::make_unique<testing::ApiServer>(options);
    server_->Start(0);
    KubeConfig config;
    config.server = server_->Url();
    ClientOptions client_options;
    client_options.initial_backoff = 10ms;
    client_ = std::make_unique<Client>(config, client_options);
  }
  static json ConfigMap(const std::string& name, const std::string& value) {
    return {{"apiVersion", "v1"}, {"kind", "ConfigMap"},
            {"metadata", {{"name", name}, {"labels", {{"app", "x"}}}}}, {"data", {{"k", value}}}};
  }
  std::unique_ptr<testing::ApiServer> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(KubeTest, TypedErrors) {
  const auto& cms = resources::ConfigMaps();
  try {
    client_->Get(cms, "default", "missing");
    FAIL() << "no error";
  } catch (const KubeError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kNotFound);
    EXPECT_EQ(e.code(), 404);
    EXPECT_NE(std::string(e.what()).find("\"missing\" not found"), std::string::npos) << e.what();
  }
  json created = client_->Create(cms, "default", ConfigMap("a", "1"));
  EXPECT_FALSE(created["metadata"].value("uid", "").empty());
  EXPECT_THROW(
      try { client_->Create(cms, "default", ConfigMap("a", "1")); } catch (const KubeError& e) {
        EXPECT_EQ(e.kind(), ErrorKind::kConflict);
        EXPECT_EQ(e.reason(), "AlreadyExists");
        throw;
      },
      KubeError);
  // A stale resourceVersion is a Conflict; the fresh one succeeds.
  json stale = created;
  client_->MergePatch(cms, "default", "a", {{"data", {{"k", "2"}}}});
  stale["data"]["k"] = "3";
  EXPECT_THROW(client_->Update(cms, "default", stale), KubeError);
  json fresh = client_->Get(cms, "default", "a");
  EXPECT_EQ(fresh["data"]["k"], "2");
  fresh["data"]["k"] = "3";
  EXPECT_EQ(client_->Update(cms, "default", fresh)["data"]["k"], "3");
  client_->Delete(cms, "default", "a");
  EXPECT_THROW(client_->Get(cms, "default", "a"), KubeError);
}

TEST_F(KubeTest, RetriesServerErrorsAndThrottling) {
  testing::Faults faults;
  faults.server_errors = 2;
  faults.throttles = 1;
  server_->SetFaults(faults);
  std::vector<int> codes;
  client_->SetRequestObserver([&](const std::string&, int code, double) { codes.push_back(code); });
  client_->Create(resources::ConfigMaps(), "default", ConfigMap("b", "1"));
  EXPECT_EQ(codes, (std::vector<int>{500, 500, 429, 201}));
  // More failures than retries surface as a ServerError.
  faults = {};
  faults.server_errors = 100;
  server_->SetFaults(faults);
  try {
    client_->Get(resources::ConfigMaps(), "default", "b");
    FAIL();
  } catch (const KubeError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kServerError);
  }
}

TEST_F(KubeTest, SelectorsAndStatusSubresource) {
  server_->Create("/pods", "default", {{"metadata", {{"name", "p1"}, {"labels", {{"job", "a"}}}}}, {"spec", {{"nodeName", "n1"}}}});
  server_->Create("/pods", "default", {{"metadata", {{"name", "p2"}, {"labels", {{"job", "b"}}}}}, {"spec", {{"nodeName", "n2"}}}});
  EXPECT_EQ(client_->List(resources::Pods(), "default", {"job=a", "", ""})["items"].size(), 1u);
  EXPECT_EQ(client_->List(resources::Pods(), "default", {"job in (a,b)", "", ""})["items"].size(), 2u);
  EXPECT_EQ(client_->List(resources::Pods(), "", {"", "spec.nodeName=n2", ""})["items"][0]["metadata"]["name"], "p2");
  EXPECT_EQ(client_->List(resources::Pods(), "default", {"job!=a", "", ""})["items"].size(), 1u);
  // Writing status leaves the spec alone; writing the object leaves the status alone.
  json pod = client_->Get(resources::Pods(), "default", "p1");
  pod["status"]["phase"] = "Running";
  pod["spec"]["nodeName"] = "elsewhere";
  json after = client_->UpdateStatus(resources::Pods(), "default", pod);
  EXPECT_EQ(after["status"]["phase"], "Running");
  EXPECT_EQ(after["spec"]["nodeName"], "n1");
  after["status"]["phase"] = "Failed";
  after["spec"]["nodeName"] = "n3";
  after = client_->Update(resources::Pods(), "default", after);
  EXPECT_EQ(after["status"]["phase"], "Running");
  EXPECT_EQ(after["metadata"]["generation"], 2);
}

TEST_F(KubeTest, InformerFollowsChangesThroughDropsAndGone) {
  InformerOptions options;
  options.min_backoff = 20ms;
  options.watch_timeout_seconds = 5;
  Informer informer(*client_, resources::ConfigMaps(), "default", {"app=x", "", ""}, options);
  std::atomic<int> adds{0}, updates{0}, deletes{0};
  informer.AddHandler({[&](const json&) { ++adds; }, [&](const json&, const json&) { ++updates; },
                       [&](const json&) { ++deletes; }});
  // The objects by their value of k: an index kept through watch events and relists.
  informer.AddIndex("k", [](const json& object) {
    return std::vector<std::string>{object.value("data", json::object()).value("k", "")};
  });
  auto names = [&informer](const std::string& value) {
    std::vector<std::string> out;
    for (const json& object : informer.ByIndex("k", value)) out.push_back(object["metadata"]["name"]);
    return out;
  };
  client_->Create(resources::ConfigMaps(), "default", ConfigMap("before", "1"));
  informer.Start();
  ASSERT_TRUE(informer.WaitForSync(5s));
  EXPECT_EQ(informer.Size(), 1u);
  auto eventually = [](const std::function<bool()>& done) {
    for (int i = 0; i < 200 && !done(); ++i) std::this_thread::sleep_for(20ms);
    return done();
  };
  client_->Create(resources::ConfigMaps(), "default", ConfigMap("c1", "1"));
  EXPECT_TRUE(eventually([&] { return informer.Get("default/c1").has_value(); }));
  EXPECT_EQ(names("1"), (std::vector<std::string>{"before", "c1"}));
  client_->MergePatch(resources::ConfigMaps(), "default", "before", {{"data", {{"k", "2"}}}});
  EXPECT_TRUE(eventually([&] { return names("2") == std::vector<std::string>{"before"}; }));
  EXPECT_EQ(names("1"), (std::vector<std::string>{"c1"}));

  testing::Faults faults;
  faults.drop_watches = 1;
  faults.gone_watches = 1;  // the reconnect gets 410: relist
  server_->SetFaults(faults);
  client_->MergePatch(resources::ConfigMaps(), "default", "c1", {{"data", {{"k", "changed"}}}});
  client_->Delete(resources::ConfigMaps(), "default", "before");
  client_->Create(resources::ConfigMaps(), "default", ConfigMap("c2", "1"));
  EXPECT_TRUE(eventually([&] {
    auto c1 = informer.Get("default/c1");
    return c1 && (*c1)["data"]["k"] == "changed" && !informer.Get("default/before") && informer.Get("default/c2");
  }));
  EXPECT_GE(informer.relists(), 1);
  EXPECT_EQ(names("changed"), (std::vector<std::string>{"c1"}));
  EXPECT_EQ(names("1"), (std::vector<std::string>{"c2"}));
  EXPECT_TRUE(names("2").empty()) << "a deleted object leaves the index";
  EXPECT_GE(updates.load(), 1);
  EXPECT_GE(deletes.load(), 1);
  EXPECT_EQ(adds.load(), 3);
  informer.Stop();
}

// A list parsed through an item transform: each item as the transform made it, the rest
// of the List as it came.
TEST_F(KubeTest, ListTransformsEachItemAsItIsParsed) {
  for (const char* name : {"a", "b", "c"}) client_->Create(resources::ConfigMaps(), "default", ConfigMap(name, name));
  int calls = 0;
  const json list = client_->List(resources::ConfigMaps(), "default", {"app=x", "", ""}, [&calls](json item) {
    ++calls;
    return json{{"metadata", {{"name", item["metadata"]["name"]}}}, {"k", item["data"]["k"]}};
  });
  EXPECT_EQ(calls, 3);
  EXPECT_FALSE(list["metadata"].value("resourceVersion", "").empty());
  EXPECT_EQ(list["items"], json::parse(R"([{"metadata": {"name": "a"}, "k": "a"}, {"metadata": {"name": "b"}, "k": "b"},
                                           {"metadata": {"name": "c"}, "k": "c"}])"));
  EXPECT_EQ(client_->List(resources::ConfigMaps(), "default", {"app=x", "", ""}, nullptr),
            client_->List(resources::ConfigMaps(), "default", {"app=x", "", ""}));
}

// A transform (as client-go's SetTransform) decides what the cache keeps: listed and
// watched objects alike, and what indexes, handlers and lookups see.
TEST_F(KubeTest, InformerKeepsWhatItsTransformMakes) {
  auto with_extra = [](json object) {
    object["metadata"]["annotations"] = {{"big", std::string(1000, 'x')}};
    object["data"]["other"] = "dropped";
    return object;
  };
  client_->Create(resources::ConfigMaps(), "default", with_extra(ConfigMap("listed", "1")));
  InformerOptions options;
  options.min_backoff = 20ms;
  Informer informer(*client_, resources::ConfigMaps(), "default", {"app=x", "", ""}, options);
  informer.SetTransform([](json object) {
    json& meta = object["metadata"];
    return json{{"metadata",
                 {{"name", meta.value("name", "")},
                  {"namespace", meta.value("namespace", "")},
                  {"resourceVersion", meta.value("resourceVersion", "")}}},
                {"data", {{"k", object["data"].value("k", "")}}}};
  });
  auto kept = [](const json& object) {
    return !object.contains("apiVersion") && !object["metadata"].contains("annotations") &&
           !object["metadata"].contains("labels") && object["data"].size() == 1 && object["data"].contains("k");
  };
  std::mutex mu;
  std::vector<json> handled;
  informer.AddHandler({[&](const json& object) {
                         std::lock_guard lock(mu);
                         handled.push_back(object);
                       },
                       [&](const json& old_object, const json& object) {
                         std::lock_guard lock(mu);
                         handled.push_back(old_object);
                         handled.push_back(object);
                       },
                       [&](const json& object) {
                         std::lock_guard lock(mu);
                         handled.push_back(object);
                       }});
  informer.AddIndex("k", [](const json& object) {
    return std::vector<std::string>{object.value("data", json::object()).value("k", "")};
  });
  informer.Start();
  ASSERT_TRUE(informer.WaitForSync(5s));
  client_->Create(resources::ConfigMaps(), "default", with_extra(ConfigMap("watched", "2")));
  client_->MergePatch(resources::ConfigMaps(), "default", "listed", {{"data", {{"k", "3"}}}});
  auto eventually = [](const std::function<bool()>& done) {
    for (int i = 0; i < 200 && !done(); ++i) std::this_thread::sleep_for(20ms);
    return done();
  };
  EXPECT_TRUE(eventually([&] {
    const auto listed = informer.Get("default/listed");
    return informer.Get("default/watched").has_value() && listed && (*listed)["data"]["k"] == "3";
  }));
  for (const char* key : {"default/listed", "default/watched"}) {
    const auto object = informer.Get(key);
    ASSERT_TRUE(object.has_value()) << key;
    EXPECT_TRUE(kept(*object)) << object->dump();
    EXPECT_FALSE((*object)["metadata"].value("resourceVersion", "").empty()) << key;
  }
  ASSERT_EQ(informer.ByIndex("k", "2").size(), 1u);
  EXPECT_TRUE(kept(informer.ByIndex("k", "2")[0]));
  EXPECT_TRUE(informer.ByIndex("k", "1").empty());
  client_->Delete(resources::ConfigMaps(), "default", "watched");
  EXPECT_TRUE(eventually([&] { return !informer.Get("default/watched").has_value(); }));
  informer.Stop();
  std::lock_guard lock(mu);
  EXPECT_EQ(handled.size(), 5u) << "two adds, an update (old and new), a delete";
  for (const json& object : handled) EXPECT_TRUE(kept(object)) << object.dump();
}

TEST(WorkQueueTest, DeduplicatesAndNeverRunsAKeyTwiceAtOnce) {
  WorkQueue queue;
  queue.Add("a");
  queue.Add("a");
  queue.Add("b");
  EXPECT_EQ(queue.Len(), 2u);
  auto first = queue.Get();
  ASSERT_EQ(*first, "a");
  queue.Add("a");  // while processing: held back until Done
  EXPECT_EQ(*queue.Get(), "b");
  EXPECT_EQ(queue.Len(), 0u);
  queue.Done("a");
  EXPECT_EQ(queue.Len(), 1u);
  EXPECT_EQ(*queue.Get(), "a");
  queue.ShutDown();
  EXPECT_FALSE(queue.Get().has_value());
}

TEST(WorkQueueTest, PerItemBackoffGrowsAndForgetResets) {
  WorkQueueOptions options;
  options.base_delay = 20ms;
  options.qps = 0;  // unlimited global bucket: only the per-item backoff
  WorkQueue queue(options);
  auto timed_get = [&] {
    const auto start = std::chrono::steady_clock::now();
    auto key = queue.Get();
    queue.Done(*key);
    return std::chrono::steady_clock::now() - start;
  };
  queue.AddRateLimited("k");
  EXPECT_GE(timed_get(), 19ms);
  queue.AddRateLimited("k");
  queue.AddRateLimited("k");  // failures 2 -> 80 ms; the earlier 40 ms delay wins
  EXPECT_EQ(queue.NumRequeues("k"), 3);
  queue.Forget("k");
  EXPECT_EQ(queue.NumRequeues("k"), 0);
  EXPECT_GE(timed_get(), 39ms);
}

TEST(TokenBucketTest, BurstThenRate) {
  TokenBucket bucket(100, 5);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(bucket.Reserve(), TokenBucket::Clock::duration::zero());
  const auto wait = bucket.Reserve();
  EXPECT_GT(wait, 5ms);
  EXPECT_LT(wait, 15ms);
}

TEST(KubeConfigTest, KubeconfigWithDataAndFiles) {
  const auto dir = std::filesystem::temp_directory_path() / "meshtrain-kubeconfig-test";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "ca.pem") << "CA-PEM";
  const std::string text = R"(apiVersion: v1
kind: Config
current-context: prod
contexts:
- name: prod
  context: {cluster: eks, user: admin, namespace: training}
clusters:
- name: eks
  cluster: {server: "https://eks.example:443", certificate-authority: ca.pem}
users:
- name: admin
  user: {token: abc, client-certificate-data: Q0VSVA==, client-key-data: S0VZ}
)";
  KubeConfig c = ParseKubeconfig(text, (dir / "config").string());
  EXPECT_EQ(c.server, "https://eks.example:443");
  EXPECT_EQ(c.ca_pem, "CA-PEM");
  EXPECT_EQ(c.token, "abc");
  EXPECT_EQ(c.client_cert_pem, "CERT");
  EXPECT_EQ(c.client_key_pem, "KEY");
  EXPECT_EQ(c.namespace_, "training");
  EXPECT_FALSE(c.insecure_skip_tls_verify);

  try {
    ParseKubeconfig("current-context: nowhere\ncontexts: []\n", "/x/config");
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("no entry named \"nowhere\""), std::string::npos) << e.what();
  }
}

TEST(KubeConfigTest, InCluster) {
  const auto dir = std::filesystem::temp_directory_path() / "meshtrain-sa-test";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "token") << "sa-token\n";
  std::ofstream(dir / "ca.crt") << "CA";
  std::ofstream(dir / "namespace") << "ops";
  setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1", 1);
  setenv("KUBERNETES_SERVICE_PORT", "443", 1);
  KubeConfig c = InClusterConfig(dir.string());
  EXPECT_EQ(c.server, "https://10.0.0.1:443");
  EXPECT_EQ(c.token, "sa-token");
  EXPECT_EQ(c.namespace_, "ops");
  unsetenv("KUBERNETES_SERVICE_HOST");
  EXPECT_THROW(InClusterConfig(dir.string()), ConfigError);
}

TEST_F(KubeTest, LeaderElectionHasOneLeader) {
  LeaderElectionOptions options;
  options.lease_duration = 1000ms;
  options.renew_deadline = 600ms;
  options.retry_period = 100ms;
  options.identity = "a";
  LeaderElector a(*client_, options);
  options.identity = "b";
  LeaderElector b(*client_, options);
  std::stop_source stop_a, stop_b;
  std::atomic<bool> a_led{false}, b_led{false};
  std::thread ta([&] { a.Run(stop_a.get_token(), [&](std::stop_token t) { a_led = true; while (!t.stop_requested()) std::this_thread::sleep_for(10ms); }); });
  std::this_thread::sleep_for(300ms);
  std::thread tb([&] { b.Run(stop_b.get_token(), [&](std::stop_token t) { b_led = true; while (!t.stop_requested()) std::this_thread::sleep_for(10ms); }); });
  std::this_thread::sleep_for(1500ms);
  EXPECT_TRUE(a_led.load());
  EXPECT_FALSE(b_led.load()) << "b took a lease that a kept renewing";
  stop_a.request_stop();  // a releases the lease
  ta.join();
  for (int i = 0; i < 100 && !b_led; ++i) std::this_thread::sleep_for(20ms);
  EXPECT_TRUE(b_led.load());
  EXPECT_EQ(client_->Get(resources::Leases(), "default", "meshtrain-operator")["spec"]["holderIdentity"], "b");
  stop_b.request_stop();
  tb.join();
}


std::string Base64File(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::vector<unsigned char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return utility::conversions::to_base64(bytes);
}

// The client against the test server over HTTPS, with the PKI of make-test-certs.sh.
class TlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    pki_ = new std::filesystem::path(std::filesystem::temp_directory_path() /
                                     ("meshtrain-pki-" + std::to_string(::getpid())));
    const std::string command = "bash tests/support/kube/make-test-certs.sh " + pki_->string();
    ASSERT_EQ(std::system(command.c_str()), 0) << command;
  }
  static void TearDownTestSuite() {
    std::filesystem::remove_all(*pki_);
    delete pki_;
  }
  std::string Pki(const std::string& file) const { return (*pki_ / file).string(); }

  // Starts the server over TLS, accepting client certificates signed by ca.crt.
  void StartServer() {
    testing::ApiServer::Options options;
    options.tls = {Pki("server.crt"), Pki("server.key"), Pki("ca.crt")};
    options.ca_file = Pki("ca.crt");
    server_ = std::make_unique<testing::ApiServer>(options);
    server_->Start(0);
  }
  // Lists nodes with a kubeconfig for the server whose user and cluster entries are given.
  json List(const std::string& cluster_extra, const std::string& user) {
    const std::string kubeconfig = "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: " +
                                   server_->Url() + "\n" + cluster_extra +
                                   "contexts:\n- name: c\n  context: {cluster: c, user: u}\ncurrent-context: c\n"
                                   "users:\n- name: u\n  user:\n" + user;
    ClientOptions options;
    options.max_retries = 0;
    options.request_timeout = 5s;
    Client client(ParseKubeconfig(kubeconfig, Pki("kubeconfig")), options);
    return client.List(resources::Nodes(), "");
  }
  const std::string token_ = "    token: test-token\n";

  static std::filesystem::path* pki_;
  std::unique_ptr<testing::ApiServer> server_;
};
std::filesystem::path* TlsTest::pki_ = nullptr;

TEST_F(TlsTest, TheKubeconfigCaVerifiesTheServer) {
  StartServer();
  EXPECT_EQ(server_->Url().rfind("https://", 0), 0u);
  const json list = List("    certificate-authority: ca.crt\n", token_);  // relative to the kubeconfig
  EXPECT_TRUE(list["items"].is_array()) << list.dump();
}

TEST_F(TlsTest, AServerSignedByAnotherCaIsRefused) {
  StartServer();
  try {
    List("    certificate-authority: other-ca.crt\n", token_);
    FAIL() << "a server the kubeconfig's CA did not sign was trusted";
  } catch (const KubeError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnavailable) << e.what();
  }
  // Without a CA the system's roots apply, and they do not know this server either.
  EXPECT_THROW(List("", token_), KubeError);
}

TEST_F(TlsTest, InsecureSkipTlsVerifyIsTheOnlyWayToSkipVerification) {
  StartServer();
  const json list = List("    insecure-skip-tls-verify: true\n", token_);
  EXPECT_TRUE(list["items"].is_array()) << list.dump();
}

TEST_F(TlsTest, AClientCertificateAuthenticatesAndNothingElseDoes) {
  StartServer();
  const std::string ca = "    certificate-authority-data: " + Base64File(Pki("ca.crt")) + "\n";
  const json list = List(ca, "    client-certificate: client.crt\n    client-key: client.key\n");
  EXPECT_TRUE(list["items"].is_array()) << list.dump();
  try {
    List(ca, "    token: wrong\n");
    FAIL() << "a wrong token was accepted";
  } catch (const KubeError& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kUnauthorized) << e.what();
    EXPECT_EQ(e.code(), 401);
  }
}

}  // namespace
}  // namespace meshtrain::kube
