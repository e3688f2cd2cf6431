#include "worker/comm/fabric/endpoint.h"

#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <mutex>

#include "worker/comm/fabric/libfabric.h"
#include "worker/comm/types.h"

namespace meshtrain::comm::fabric {
namespace {

void Check(int result, const std::string& provider, const char* what) {
  if (result != 0) {
    throw CommError("libfabric provider \"" + provider + "\": " + what + " failed: " +
                    LibFabric::Get().strerror(-result));
  }
}

template <class T>
void Close(T*& object) {
  if (object != nullptr) fi_close(&object->fid);
  object = nullptr;
}

// libfabric's shm provider names its regions /dev/shm/<pid>:<n>:<m> and refuses
// (EBUSY) to create one whose name exists. A rank killed with SIGKILL leaves its regions
// behind, and a later process given the same pid then cannot open shm at all. Before this
// process makes its first shm endpoint, regions named with its pid can only be such
// leftovers (a live process's pid is its own), so they are removed.
void RemoveRegionsLeftUnderThisPid() {
  static std::once_flag once;
  std::call_once(once, [] {
    const std::string prefix = std::to_string(::getpid()) + ":";
    std::error_code error;
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", error)) {
      const std::string name = entry.path().filename().string();
      if (name.rfind(prefix, 0) == 0) std::filesystem::remove(entry.path(), error);
    }
  });
}

uintptr_t PageDown(uintptr_t address) {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  return address & ~(page - 1);
}

}  // namespace

Endpoint::Endpoint(const std::string& provider, bool register_always) : provider_(provider) {
  if (provider == "shm") RemoveRegionsLeftUnderThisPid();
  const LibFabric& libfabric = LibFabric::Get();
  fi_info* hints = libfabric.dupinfo(nullptr);  // fi_allocinfo()
  hints->caps = FI_TAGGED | FI_SEND | FI_RECV;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->ep_attr->type = FI_EP_RDM;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;  // our mutex serialises the calls
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
  hints->fabric_attr->prov_name = strdup(provider.c_str());
  int result = libfabric.getinfo(FI_VERSION(1, 17), nullptr, nullptr, 0, hints, &info_);
  libfabric.freeinfo(hints);
  if (result != 0) {
    throw ProviderUnavailable("libfabric has no RDM endpoint with tagged messages for provider \"" +
                    provider + "\": " + libfabric.strerror(-result) +
                    " (choose another with MESHTRAIN_FABRIC_INTRA_PROVIDER / "
                    "MESHTRAIN_FABRIC_INTER_PROVIDER)");
  }
  opened_provider_ = info_->fabric_attr->prov_name;
  needs_registration_ = register_always || (info_->domain_attr->mr_mode & FI_MR_LOCAL) != 0;
  try {
    Check(libfabric.fabric(info_->fabric_attr, &fabric_, nullptr), provider, "fi_fabric");
    Check(fi_domain(fabric_, info_, &domain_, nullptr), provider, "fi_domain");
    fi_cq_attr cq_attr{};
    cq_attr.format = FI_CQ_FORMAT_TAGGED;
    cq_attr.wait_obj = FI_WAIT_NONE;
    cq_attr.size = 4096;
    Check(fi_cq_open(domain_, &cq_attr, &cq_, nullptr), provider, "fi_cq_open");
    fi_av_attr av_attr{};
    av_attr.type = FI_AV_TABLE;
    Check(fi_av_open(domain_, &av_attr, &av_, nullptr), provider, "fi_av_open");
    Check(fi_endpoint(domain_, info_, &ep_, nullptr), provider, "fi_endpoint");
    Check(fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV), provider, "binding the queue");
    Check(fi_ep_bind(ep_, &av_->fid, 0), provider, "binding the address vector");
    Check(fi_enable(ep_), provider, "fi_enable");
  } catch (...) {
    Release();
    throw;
  }
}

Endpoint::~Endpoint() { Release(); }

void Endpoint::Release() {
  if (peer_failed_) {
    // Closing an rxm endpoint whose connections a dead peer broke can crash libfabric
    // 1.17 (seen as SIGSEGV in fi_close after "Broken pipe"). A failed communicator
    // ends its process, so the provider's objects are left for the exit to reclaim.
    ep_ = nullptr, av_ = nullptr, cq_ = nullptr, domain_ = nullptr, fabric_ = nullptr;
    registrations_made_.clear();
  }
  Close(ep_);
  for (fid_mr* mr : registrations_made_) fi_close(&mr->fid);
  registrations_made_.clear();
  registered_.clear();
  Close(av_);
  Close(cq_);
  Close(domain_);
  Close(fabric_);
  if (info_ != nullptr) LibFabric::Get().freeinfo(info_);
  info_ = nullptr;
}

std::string Endpoint::Address() const {
  std::lock_guard lock(mutex_);
  char buf[256];
  size_t length = sizeof(buf);
  Check(fi_getname(&ep_->fid, buf, &length), provider_, "fi_getname");
  return std::string(buf, length);
}

fi_addr_t Endpoint::Insert(const std::string& address) {
  std::lock_guard lock(mutex_);
  fi_addr_t result = FI_ADDR_UNSPEC;
  int inserted = fi_av_insert(av_, address.data(), 1, &result, 0, nullptr);
  if (inserted != 1) {
    throw CommError("libfabric provider \"" + provider_ + "\": a peer's address (" +
                    std::to_string(address.size()) + " bytes) was refused by fi_av_insert");
  }
  return result;
}

void* Endpoint::Descriptor(const void* buf, size_t bytes, uint64_t access) {
  if (!needs_registration_ || bytes == 0) return nullptr;
  uintptr_t start = reinterpret_cast<uintptr_t>(buf), end = start + bytes;
  auto it = registered_.upper_bound(start);
  if (it != registered_.begin()) {
    --it;
    if (it->first <= start && end <= it->second.end) return fi_mr_desc(it->second.mr);
  }
  // Register whole pages, so neighbouring slices of one buffer share the registration.
  uintptr_t page_start = PageDown(start);
  fid_mr* mr = nullptr;
  // A unique requested key, for providers that do not choose keys themselves.
  uint64_t key = static_cast<uint64_t>(registrations_.load()) + 1;
  Check(fi_mr_reg(domain_, reinterpret_cast<void*>(page_start), end - page_start, access, 0, key,
                  0, &mr, nullptr),
        provider_, "fi_mr_reg");
  registrations_made_.push_back(mr);  // kept until close: posted requests may use it
  registrations_.fetch_add(1);
  registered_.insert_or_assign(page_start, Registration{end, mr});
  return fi_mr_desc(mr);
}

bool Endpoint::PostSend(const void* buf, size_t bytes, fi_addr_t dest, uint64_t tag,
                        Request* request) {
  std::lock_guard lock(mutex_);
  void* desc = Descriptor(buf, bytes, FI_SEND | FI_RECV);
  ssize_t result = fi_tsend(ep_, buf, bytes, desc, dest, tag, &request->context);
  if (result == -FI_EAGAIN) return false;
  peer_failed_ = peer_failed_ || result != 0;
  if (result != 0) Check(static_cast<int>(result), provider_, "fi_tsend");
  return true;
}

bool Endpoint::PostRecv(void* buf, size_t bytes, uint64_t tag, Request* request) {
  std::lock_guard lock(mutex_);
  void* desc = Descriptor(buf, bytes, FI_SEND | FI_RECV);
  ssize_t result = fi_trecv(ep_, buf, bytes, desc, FI_ADDR_UNSPEC, tag, 0, &request->context);
  if (result == -FI_EAGAIN) return false;
  peer_failed_ = peer_failed_ || result != 0;
  if (result != 0) Check(static_cast<int>(result), provider_, "fi_trecv");
  return true;
}

int Endpoint::Progress() {
  std::lock_guard lock(mutex_);
  fi_cq_tagged_entry entries[32];
  int completed = 0;
  for (int batch = 0; batch < 8; ++batch) {
    ssize_t n = fi_cq_read(cq_, entries, 32);
    if (n == -FI_EAGAIN) break;
    if (n == -FI_EAVAIL) {
      fi_cq_err_entry error{};
      if (fi_cq_readerr(cq_, &error, 0) != 1) break;
      auto* request = reinterpret_cast<Request*>(error.op_context);
      if (request != nullptr) {
        if (error.err == FI_ECANCELED) {
          request->error = "cancelled";
        } else {
          peer_failed_ = true;
          request->error = std::string(LibFabric::Get().strerror(error.err)) + " (" +
                           fi_cq_strerror(cq_, error.prov_errno, error.err_data, nullptr, 0) +
                           ")";
        }
        request->state.store(Request::kFailed, std::memory_order_release);
      }
      ++completed;
      continue;
    }
    if (n < 0) Check(static_cast<int>(n), provider_, "fi_cq_read");
    for (ssize_t i = 0; i < n; ++i) {
      reinterpret_cast<Request*>(entries[i].op_context)
          ->state.store(Request::kDone, std::memory_order_release);
    }
    completed += static_cast<int>(n);
    if (n < 32) break;
  }
  return completed;
}

void Endpoint::Abandon(std::unique_ptr<Request> request) {
  std::lock_guard lock(mutex_);
  if (request->state.load() == Request::kPending) fi_cancel(&ep_->fid, &request->context);
  abandoned_.push_back(std::move(request));
}

}  // namespace meshtrain::comm::fabric
