#include "tests/support/kube/protobuf.h"

#include <cstdint>
#include <functional>
#include <stdexcept>

#include "operator/kube/base64.h"

namespace meshtrain::testing {

using nlohmann::json;

namespace {

// One protobuf message's fields, read in order.
class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}

  // Calls `field(number, wire_type)` for each field; the callback reads the value with
  // Varint() or Bytes(), or leaves it to Skip().
  void ForEach(const std::function<void(int, int)>& field) {
    while (pos_ < data_.size()) {
      const uint64_t tag = Varint();
      const size_t before = pos_;
      field(static_cast<int>(tag >> 3), static_cast<int>(tag & 7));
      if (pos_ == before) Skip(static_cast<int>(tag & 7));
    }
  }
  uint64_t Varint() {
    uint64_t value = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= data_.size()) throw std::runtime_error("protobuf: a varint runs past the end");
      const uint8_t byte = static_cast<uint8_t>(data_[pos_++]);
      value |= uint64_t(byte & 0x7f) << shift;
      if (!(byte & 0x80)) return value;
    }
    throw std::runtime_error("protobuf: a varint longer than 10 bytes");
  }
  std::string_view Bytes() {
    const uint64_t n = Varint();
    if (n > data_.size() - pos_) throw std::runtime_error("protobuf: a length runs past the end");
    const std::string_view out = data_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  void Skip(int wire_type) {
    switch (wire_type) {
      case 0: Varint(); break;
      case 1: Advance(8); break;
      case 2: Bytes(); break;
      case 5: Advance(4); break;
      default: throw std::runtime_error("protobuf: unsupported wire type " + std::to_string(wire_type));
    }
  }

 private:
  void Advance(size_t n) {
    if (n > data_.size() - pos_) throw std::runtime_error("protobuf: a fixed field runs past the end");
    pos_ += n;
  }
  std::string_view data_;
  size_t pos_ = 0;
};

// A map<string, string|bytes> entry: key 1, value 2.
std::pair<std::string, std::string> MapEntry(std::string_view entry) {
  std::pair<std::string, std::string> kv;
  Reader r(entry);
  r.ForEach([&](int field, int type) {
    if (type != 2) return;
    if (field == 1) kv.first = std::string(r.Bytes());
    else if (field == 2) kv.second = std::string(r.Bytes());
  });
  return kv;
}

// ObjectMeta: the fields a client sets on create and update.
json DecodeMeta(std::string_view bytes) {
  json meta = json::object();
  Reader r(bytes);
  r.ForEach([&](int field, int type) {
    if (type == 2) {
      switch (field) {
        case 1: meta["name"] = std::string(r.Bytes()); break;
        case 2: meta["generateName"] = std::string(r.Bytes()); break;
        case 3: meta["namespace"] = std::string(r.Bytes()); break;
        case 5: meta["uid"] = std::string(r.Bytes()); break;
        case 6: meta["resourceVersion"] = std::string(r.Bytes()); break;
        case 11: {
          const auto [k, v] = MapEntry(r.Bytes());
          meta["labels"][k] = v;
          break;
        }
        case 12: {
          const auto [k, v] = MapEntry(r.Bytes());
          meta["annotations"][k] = v;
          break;
        }
        default: break;
      }
    } else if (type == 0 && field == 7) {
      meta["generation"] = static_cast<int64_t>(r.Varint());
    }
  });
  return meta;
}

}  // namespace

json DecodeKubernetesProtobuf(const std::string& body) {
  if (body.size() < 4 || body.compare(0, 4, std::string("k8s\0", 4)) != 0)
    throw std::runtime_error("protobuf: the body lacks the k8s magic prefix");
  std::string api_version, kind;
  std::string_view raw;
  Reader unknown(std::string_view(body).substr(4));
  unknown.ForEach([&](int field, int type) {
    if (type != 2) return;
    if (field == 1) {
      Reader meta(unknown.Bytes());
      meta.ForEach([&](int f, int t) {
        if (t != 2) return;
        if (f == 1) api_version = std::string(meta.Bytes());
        else if (f == 2) kind = std::string(meta.Bytes());
      });
    } else if (field == 2) {
      raw = unknown.Bytes();
    }
  });
  if (api_version != "v1" || (kind != "Secret" && kind != "ConfigMap" && kind != "Namespace"))
    throw std::runtime_error("protobuf: " + api_version + " " + kind +
                             " is not decoded here (v1 Secret, ConfigMap and Namespace are); send JSON");
  json object = {{"apiVersion", api_version}, {"kind", kind}, {"metadata", json::object()}};
  Reader r(raw);
  r.ForEach([&](int field, int type) {
    if (field == 1 && type == 2) {
      object["metadata"] = DecodeMeta(r.Bytes());
    } else if (kind == "Secret" && field == 2 && type == 2) {
      const auto [k, v] = MapEntry(r.Bytes());
      object["data"][k] = kube::EncodeBase64(v);
    } else if (kind == "Secret" && field == 3 && type == 2) {
      object["type"] = std::string(r.Bytes());
    } else if (kind == "Secret" && field == 4 && type == 2) {
      const auto [k, v] = MapEntry(r.Bytes());
      object["stringData"][k] = v;
    } else if (kind == "Secret" && field == 5 && type == 0) {
      object["immutable"] = r.Varint() != 0;
    } else if (kind == "ConfigMap" && field == 2 && type == 2) {
      const auto [k, v] = MapEntry(r.Bytes());
      object["data"][k] = v;
    } else if (kind == "ConfigMap" && field == 3 && type == 2) {
      const auto [k, v] = MapEntry(r.Bytes());
      object["binaryData"][k] = kube::EncodeBase64(v);
    }
  });
  return object;
}

}  // namespace meshtrain::testing
