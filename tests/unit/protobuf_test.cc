// The test API server's protobuf decoding of the objects typed clients send that way.

#include <gtest/gtest.h>

#include "tests/support/kube/protobuf.h"

namespace meshtrain::testing {
namespace {

using nlohmann::json;

// Protobuf's wire format, enough to write what client-go writes.
std::string Varint(uint64_t v) {
  std::string out;
  while (v >= 0x80) {
    out += char((v & 0x7f) | 0x80);
    v >>= 7;
  }
  return out + char(v);
}
std::string Field(int number, const std::string& bytes) { return Varint(uint64_t(number) << 3 | 2) + Varint(bytes.size()) + bytes; }
std::string Entry(int number, const std::string& key, const std::string& value) {
  return Field(number, Field(1, key) + Field(2, value));
}
std::string Envelope(const std::string& kind, const std::string& raw) {
  return std::string("k8s\0", 4) + Field(1, Field(1, "v1") + Field(2, kind)) + Field(2, raw);
}

TEST(KubernetesProtobuf, DecodesHelmsReleaseSecret) {
  const std::string meta = Field(1, "sh.helm.release.v1.meshtrain.v1") + Field(3, "meshtrain") +
                           Entry(11, "owner", "helm") + Entry(11, "name", "meshtrain") + Varint(7 << 3) + Varint(2);
  const std::string secret = Field(1, meta) + Entry(2, "release", std::string("\x01\x02\xff", 3)) + Field(3, "helm.sh/release.v1");
  const json object = DecodeKubernetesProtobuf(Envelope("Secret", secret));
  EXPECT_EQ(object["kind"], "Secret");
  EXPECT_EQ(object["metadata"]["name"], "sh.helm.release.v1.meshtrain.v1");
  EXPECT_EQ(object["metadata"]["namespace"], "meshtrain");
  EXPECT_EQ(object["metadata"]["labels"], (json{{"owner", "helm"}, {"name", "meshtrain"}}));
  EXPECT_EQ(object["metadata"]["generation"], 2);
  EXPECT_EQ(object["data"]["release"], "AQL/");  // base64 of 01 02 ff
  EXPECT_EQ(object["type"], "helm.sh/release.v1");
}

TEST(KubernetesProtobuf, DecodesANamespaceAndAConfigMap) {
  EXPECT_EQ(DecodeKubernetesProtobuf(Envelope("Namespace", Field(1, Field(1, "meshtrain"))))["metadata"]["name"],
            "meshtrain");
  const json cm = DecodeKubernetesProtobuf(Envelope("ConfigMap", Field(1, Field(1, "c")) + Entry(2, "a.yaml", "x: 1")));
  EXPECT_EQ(cm["data"]["a.yaml"], "x: 1");
}

TEST(KubernetesProtobuf, BadBodiesAreRefusedWithTheReason) {
  auto error = [](const std::string& body) {
    try {
      DecodeKubernetesProtobuf(body);
    } catch (const std::runtime_error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(error("{\"kind\": \"Secret\"}"), "protobuf: the body lacks the k8s magic prefix");
  EXPECT_EQ(error(Envelope("Pod", "")), "protobuf: v1 Pod is not decoded here (v1 Secret, ConfigMap and Namespace are); send JSON");
  std::string truncated = Envelope("Secret", Field(1, Field(1, "name")));
  truncated.resize(truncated.size() - 3);
  EXPECT_NE(error(truncated).find("runs past the end"), std::string::npos) << error(truncated);
  EXPECT_NE(error(std::string("k8s\0", 4) + std::string(11, '\xff')).find("varint"), std::string::npos);
}

}  // namespace
}  // namespace meshtrain::testing
