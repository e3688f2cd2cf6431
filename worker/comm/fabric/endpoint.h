// One libfabric endpoint: an FI_EP_RDM endpoint with tagged messages on one provider
// ("shm", "tcp;ofi_rxm", "efa", or any other libfabric offers), with its address
// vector and completion queue, and a cache of memory registrations for providers that
// need buffers registered (FI_MR_LOCAL, as efa does).
//
// Progress is manual: nothing moves until some thread calls Progress(). Completions
// are reported through the Request each post carries, so any thread's Progress()
// completes any thread's requests; the owner watches Request::state.
//
// Thread-safety: every method is safe to call from several threads (one mutex around
// the provider's calls).
//
// The first endpoint loads libfabric (libfabric.h), keeping this process's actions for
// SIGSEGV, SIGTERM and the other fatal signals, whatever libinfinipath installs.

#pragma once

#include <rdma/fabric.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace meshtrain::comm::fabric {

// One posted send or receive. Must stay at one address until it completes or the
// endpoint closes (an abandoned request is handed to Endpoint::Abandon).
struct Request {
  fi_context2 context;  // handed back by the provider as op_context
  std::atomic<int> state{kPending};
  std::string error;  // set before state becomes kFailed

  static constexpr int kPending = 0, kDone = 1, kFailed = 2;
};

class Endpoint {
 public:
  // Opens provider `provider`; throws CommError saying what failed. `register_always`
  // registers buffers even when the provider does not ask for it (tests use it).
  Endpoint(const std::string& provider, bool register_always);
  ~Endpoint();
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  const std::string& provider() const { return provider_; }
  // The provider's name for the opened endpoint ("shm", "tcp;ofi_rxm").
  const std::string& opened_provider() const { return opened_provider_; }
  // This endpoint's address, to publish through the Store.
  std::string Address() const;
  // Makes a peer's published address usable as a destination.
  fi_addr_t Insert(const std::string& address);

  // Post a tagged send / receive; false when the provider is busy (-FI_EAGAIN):
  // progress and try again. Throws CommError on any other failure.
  bool PostSend(const void* buf, size_t bytes, fi_addr_t dest, uint64_t tag, Request* request);
  bool PostRecv(void* buf, size_t bytes, uint64_t tag, Request* request);
  // Reads completions, marking their requests done or failed. Returns how many.
  int Progress();
  // Cancels a pending request whose operation gave up, and keeps it alive until close.
  void Abandon(std::unique_ptr<Request> request);

  // Registrations made so far (each buffer range is registered once).
  int64_t registrations() const { return registrations_.load(); }

 private:
  void Release();
  void* Descriptor(const void* buf, size_t bytes, uint64_t access);

  std::string provider_;
  std::string opened_provider_;
  bool needs_registration_ = false;
  fi_info* info_ = nullptr;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_av* av_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_ep* ep_ = nullptr;
  bool peer_failed_ = false;  // a transfer failed in the provider (under mutex_)
  mutable std::mutex mutex_;
  struct Registration {
    uintptr_t end;
    fid_mr* mr;
  };
  std::map<uintptr_t, Registration> registered_;  // by start address
  std::vector<fid_mr*> registrations_made_;
  std::atomic<int64_t> registrations_{0};
  std::vector<std::unique_ptr<Request>> abandoned_;
};

}  // namespace meshtrain::comm::fabric
