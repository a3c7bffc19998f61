// SPDX-License-Identifier: Apache-2.0
#include "endpoint.h"

#include <poll.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sys/eventfd.h>
#include <sys/prctl.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>

#include "log.h"
#include "thread_name.h"

namespace ferry_ofi {
namespace {

constexpr uint64_t kDefaultChunk = 1ull << 20;
constexpr uint64_t kMinNapNs = 20'000;       // a thread that must poll sleeps this long first,
constexpr uint64_t kMaxNapNs = 1'000'000;    // doubling up to this
constexpr uint64_t kMinBellNapNs = 200'000;  // a doorbell sleeper with RMAs in flight expects
                                             // a ring; this is only its safety net
constexpr int kTrywaitRetries = 16;

std::string FiErr(ssize_t rc) { return fi_strerror(static_cast<int>(rc < 0 ? -rc : rc)); }

// What a failed RMA means for the policy: the target refused it (bad key or
// range), or the path to it broke.
int MapCqErr(int err) {
  switch (err) {
    case FI_EACCES:
    case FI_EPERM:
    case FI_EKEYREJECTED:
    case FI_EINVAL:
    case FI_EFAULT:
      return FERRY_ERR_REMOTE;
    default:
      return FERRY_ERR_TRANSPORT;
  }
}

std::string MrModeString(uint64_t m) {
  static const std::pair<uint64_t, const char*> kBits[] = {{FI_MR_LOCAL, "LOCAL"},
                                                           {FI_MR_RAW, "RAW"},
                                                           {FI_MR_VIRT_ADDR, "VIRT_ADDR"},
                                                           {FI_MR_ALLOCATED, "ALLOCATED"},
                                                           {FI_MR_PROV_KEY, "PROV_KEY"},
                                                           {FI_MR_MMU_NOTIFY, "MMU_NOTIFY"},
                                                           {FI_MR_RMA_EVENT, "RMA_EVENT"},
                                                           {FI_MR_ENDPOINT, "ENDPOINT"},
                                                           {FI_MR_HMEM, "HMEM"}};
  std::string s;
  for (const auto& [bit, name] : kBits) {
    if (m & bit) s += (s.empty() ? "" : "|") + std::string(name);
  }
  return s.empty() ? "none" : s;
}

}  // namespace

fi_info* GetInfo(const char* provider, const char* node, bool rma_event, std::string* why) {
  fi_info* hints = fi_allocinfo();
  if (hints == nullptr) throw std::bad_alloc();
  hints->caps = FI_MSG | FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
  if (rma_event) hints->caps |= FI_RMA_EVENT;
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  hints->ep_attr->type = FI_EP_RDM;
  hints->domain_attr->mr_mode =
      FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT | FI_MR_RAW;
  hints->domain_attr->threading = FI_THREAD_SAFE;
  // SUCCESS means delivered: a WRITE completes once the target holds the data.
  hints->tx_attr->op_flags = FI_DELIVERY_COMPLETE;
  if (provider != nullptr) hints->fabric_attr->prov_name = strdup(provider);
  fi_info* out = nullptr;
  const int rc = fi_getinfo(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), node, nullptr,
                            node != nullptr ? FI_SOURCE : 0, hints, &out);
  fi_freeinfo(hints);
  if (rc != 0) {
    if (why)
      *why = std::string("fi_getinfo(") + (provider ? provider : "any provider") +
             (node ? std::string(", ") + node : std::string()) +
             ") found no RDM endpoint with RMA: " + FiErr(rc);
    return nullptr;
  }
  return out;
}

Endpoint::Endpoint(const ferry_host_v1* host, const Settings& s) : host_(host), settings_(s) {}

std::unique_ptr<Endpoint> Endpoint::Open(const ferry_host_v1* host, const fi_info* info,
                                         const Settings& s, std::string* why) {
  std::unique_ptr<Endpoint> ep(new Endpoint(host, s));
  if (!ep->OpenAll(info, why)) return nullptr;
  return ep;
}

bool Endpoint::OpenAll(const fi_info* info, std::string* why) {
  info_ = fi_dupinfo(info);
  if (info_ == nullptr) throw std::bad_alloc();
  provider_ = info_->fabric_attr->prov_name ? info_->fabric_attr->prov_name : "?";
  domain_name_ = info_->domain_attr->name ? info_->domain_attr->name : "?";
  const std::string label = provider_ + " (" + domain_name_ + ")";
  auto fail = [&](const char* what, ssize_t rc) {
    *why = label + ": " + what + " failed: " + FiErr(rc);
    return false;
  };
  int rc = fi_fabric(info_->fabric_attr, &fabric_, nullptr);
  if (rc != 0) return fail("fi_fabric", rc);
  rc = fi_domain(fabric_, info_, &domain_, nullptr);
  if (rc != 0) return fail("fi_domain", rc);
  fi_av_attr av_attr{};
  av_attr.type = FI_AV_TABLE;
  rc = fi_av_open(domain_, &av_attr, &av_, nullptr);
  if (rc != 0) return fail("fi_av_open", rc);

  // A CQ with a wait fd when the provider has one; otherwise a doorbell.
  fi_cq_attr cq_attr{};
  cq_attr.format = FI_CQ_FORMAT_CONTEXT;
  cq_attr.wait_obj = FI_WAIT_FD;
  rc = fi_cq_open(domain_, &cq_attr, &cq_, nullptr);
  if (rc == 0 && fi_control(&cq_->fid, FI_GETWAIT, &cq_fd_) != 0) {
    fi_close(&cq_->fid);
    cq_ = nullptr;
    cq_fd_ = -1;
    rc = -FI_ENOSYS;
  }
  if (rc != 0) {
    cq_fd_ = -1;
    cq_attr.wait_obj = FI_WAIT_NONE;
    rc = fi_cq_open(domain_, &cq_attr, &cq_, nullptr);
    if (rc != 0) return fail("fi_cq_open", rc);
  }
  if (cq_fd_ < 0) {
    doorbell_ = Doorbell::Create(why);
    if (!doorbell_) {
      *why = label + ": no wait fd and no doorbell: " + *why;
      return false;
    }
  }
  if (cq_fd_ < 0 && (info_->caps & FI_RMA_EVENT)) {
    fi_cntr_attr ca{};
    ca.events = FI_CNTR_EVENTS_COMP;
    ca.wait_obj = FI_WAIT_NONE;
    if (fi_cntr_open(domain_, &ca, &cntr_, nullptr) != 0) cntr_ = nullptr;
  }
  rc = fi_endpoint(domain_, info_, &ep_, nullptr);
  if (rc != 0) return fail("fi_endpoint", rc);
  rc = fi_ep_bind(ep_, &av_->fid, 0);
  if (rc != 0) return fail("binding the address vector", rc);
  rc = fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV);
  if (rc != 0) return fail("binding the completion queue", rc);
  if (cntr_ != nullptr && fi_ep_bind(ep_, &cntr_->fid, FI_REMOTE_WRITE | FI_REMOTE_READ) != 0) {
    // Activity counting is an optimisation; the endpoint works without it.
    fi_close(&cntr_->fid);
    cntr_ = nullptr;
  }
  rc = fi_enable(ep_);
  if (rc != 0) return fail("fi_enable", rc);
  addr_.resize(blob::kMaxAddr);
  size_t len = addr_.size();
  rc = fi_getname(&ep_->fid, addr_.data(), &len);
  if (rc != 0 || len == 0 || len > blob::kMaxAddr)
    return fail("fi_getname", rc ? rc : -FI_ETOOSMALL);
  addr_.resize(len);
  addr_format_ = info_->addr_format;
  mr_mode_ = info_->domain_attr->mr_mode;
  chunk_ = settings_.chunk_bytes != 0 ? settings_.chunk_bytes : kDefaultChunk;
  if (info_->ep_attr->max_msg_size > 0)
    chunk_ = std::min<uint64_t>(chunk_, info_->ep_attr->max_msg_size);
  ep_window_ = static_cast<uint32_t>(std::clamp<size_t>(info_->tx_attr->size, 1, 65536));
  window_ = std::min<uint32_t>(static_cast<uint32_t>(settings_.window), ep_window_);
  event_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (event_fd_ < 0) {
    *why = label + ": eventfd failed: " + std::strerror(errno);
    return false;
  }
  return true;
}

Endpoint::~Endpoint() {
  if (thread_.joinable()) Stop(FERRY_ERR_BAD_STATE, "ofi plugin shutting down");
  StopGpu();
  CloseEp();
  for (Op* op : ops_) delete op;  // RMAs the provider never completed: it is gone now
  for (Op* op : free_ops_) delete op;
  if (cntr_) fi_close(&cntr_->fid);
  if (cq_) fi_close(&cq_->fid);
  if (av_) fi_close(&av_->fid);
  if (domain_) {
    if (int rc = fi_close(&domain_->fid); rc != 0)
      Log(host_, FERRY_LOG_WARN, "%s: closing the domain: %s", provider_.c_str(),
          FiErr(rc).c_str());
  }
  if (fabric_) fi_close(&fabric_->fid);
  if (info_) fi_freeinfo(info_);
  if (event_fd_ >= 0) close(event_fd_);
}

void Endpoint::CloseEp() {
  if (ep_ != nullptr) {
    fi_close(&ep_->fid);
    ep_ = nullptr;
  }
}

void Endpoint::Start() {
  // The GPU thread too, now: made lazily, by the progress thread that finished
  // a staged piece, a failure to start it (thread limits) ended the process.
  if (pool_) {
    std::lock_guard lk(gpu_mu_);
    gpu_thread_ = ferry::named_thread("ofi-gpu", [this] { GpuMain(); });
  }
  thread_ = ferry::named_thread("ofi-progress", [this] {
    // The life mark (doorbell.h) is this thread's: it ends with the endpoint.
    if (doorbell_) doorbell_->HoldLife();
    try {
      Main();
    } catch (const std::exception& e) {
      // Out of memory deep in the progress loop: no more progress here. What
      // is pending fails now and later posts fail at once, rather than the
      // process ending (nothing may throw out of a plugin's thread).
      Log(host_, FERRY_LOG_ERROR, "%s: progress thread stopped: %s", provider_.c_str(), e.what());
      std::vector<Done> done;
      {
        std::lock_guard lk(mu_);
        stopped_ = true;
        while (!active_.empty())
          EndLocked(active_.begin()->second, FERRY_ERR_INTERNAL,
                    provider_ + ": progress thread stopped: " + e.what(), &done);
        queue_.clear();
      }
      Deliver(&done);
    }
    if (doorbell_) doorbell_->ReleaseLife();
  });
}

void Endpoint::Stop(int status, const std::string& msg) {
  std::vector<Done> done;
  {
    std::lock_guard lk(mu_);
    stopped_ = true;
    while (!active_.empty()) {
      auto x = active_.begin()->second;
      EndLocked(x, status, msg, &done);
    }
    queue_.clear();
  }
  Deliver(&done);
  stop_.store(true);
  const uint64_t one = 1;
  if (event_fd_ >= 0) [[maybe_unused]]
    ssize_t w = write(event_fd_, &one, sizeof(one));
  if (doorbell_) doorbell_->Ring();
  if (thread_.joinable()) thread_.join();
  StopGpu();
}

std::string Endpoint::Describe() const {
  std::string s = provider_ + "@" + domain_name_ + " mr_mode=" + MrModeString(mr_mode_) +
                  " chunk=" + FormatBytes(chunk_) + " window=" + std::to_string(window_) + "/" +
                  std::to_string(ep_window_);
  if (cq_fd_ >= 0) {
    s += " progress=wait-fd";
  } else {
    s += " progress=doorbell";
    if (cntr_) s += "+remote-event-counter";
  }
  return s;
}

// ---- memory -------------------------------------------------------------------------

int Endpoint::RegWithFreshKey(void* addr, uint64_t len, uint64_t access, fid_mr** mr) {
  // Without FI_MR_PROV_KEY the key is ours to pick, unique within the domain.
  // Random, not 1, 2, 3: over tcp;ofi_rxm the key (and an offset) is all a
  // process that reaches the endpoint needs to write into the region.
  const size_t key_bytes = std::clamp<size_t>(info_->domain_attr->mr_key_size, 1, 8);
  const uint64_t mask = key_bytes >= 8 ? ~0ull : (1ull << (8 * key_bytes)) - 1;
  int rc = -FI_ENOKEY;
  for (int attempt = 0; attempt < 8 && (rc == -FI_ENOKEY || rc == -FI_EKEYREJECTED); ++attempt) {
    uint64_t requested;
    {
      std::lock_guard lk(key_mu_);
      requested = ((static_cast<uint64_t>(key_rng_()) << 32) ^ key_rng_()) & mask;
    }
    rc = fi_mr_reg(domain_, addr, len, access, 0, requested, 0, mr, nullptr);
  }
  return rc;
}

int Endpoint::RegisterMr(void* addr, uint64_t len, fid_mr** mr, blob::MemKey* key,
                         std::string* why) {
  int rc = RegWithFreshKey(addr, len, FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE, mr);
  if (rc != 0) {
    *why = provider_ + ": fi_mr_reg of " + std::to_string(len) + " bytes failed: " + FiErr(rc);
    return FERRY_ERR_TRANSPORT;
  }
  auto fail = [&](const std::string& what, int r) {
    *why = provider_ + ": " + what + ": " + FiErr(r);
    fi_close(&(*mr)->fid);
    *mr = nullptr;
    return FERRY_ERR_TRANSPORT;
  };
  if (mr_mode_ & FI_MR_ENDPOINT) {
    rc = fi_mr_bind(*mr, &ep_->fid, 0);
    if (rc == 0) rc = fi_mr_enable(*mr);
    if (rc != 0) return fail("binding the memory region to the endpoint", rc);
  }
  key->provider = provider_;
  if (mr_mode_ & FI_MR_RAW) {
    uint64_t base = 0;
    size_t size = 0;
    rc = fi_mr_raw_attr(*mr, &base, nullptr, &size, 0);
    if (rc != -FI_ETOOSMALL || size == 0 || size > blob::kMaxKey)
      return fail("fi_mr_raw_attr (size)", rc ? rc : -FI_EOTHER);
    key->key.resize(size);
    rc = fi_mr_raw_attr(*mr, &base, key->key.data(), &size, 0);
    if (rc != 0) return fail("fi_mr_raw_attr", rc);
    key->raw = true;
    key->base = base;
  } else {
    const uint64_t k = fi_mr_key(*mr);
    if (k == FI_KEY_NOTAVAIL) return fail("fi_mr_key", -FI_ENOKEY);
    key->raw = false;
    key->key.resize(8);
    for (int i = 0; i < 8; ++i) key->key[i] = static_cast<uint8_t>(k >> (8 * i));
    // Obey the returned mr_mode: virtual addresses, or offsets into the region.
    key->base = (mr_mode_ & FI_MR_VIRT_ADDR) ? reinterpret_cast<uint64_t>(addr) : 0;
  }
  return FERRY_OK;
}

int Endpoint::RegisterLocal(void* addr, uint64_t len, fid_mr** mr, std::string* why) {
  // Source of WRITEs, sink of READs: no remote access.
  int rc = RegWithFreshKey(addr, len, FI_READ | FI_WRITE, mr);
  if (rc == 0 && (mr_mode_ & FI_MR_ENDPOINT)) {
    rc = fi_mr_bind(*mr, &ep_->fid, 0);
    if (rc == 0) rc = fi_mr_enable(*mr);
    if (rc != 0) {
      fi_close(&(*mr)->fid);
      *mr = nullptr;
    }
  }
  if (rc != 0) {
    *why = provider_ + ": registering a " + FormatBytes(len) +
           " GPU staging buffer failed: " + FiErr(rc);
    return FERRY_ERR_TRANSPORT;
  }
  return FERRY_OK;
}

void Endpoint::SetStaging(std::shared_ptr<StagePool> pool, size_t index) {
  pool_ = std::move(pool);
  stage_index_ = index;
}

void Endpoint::DropOps() {
  std::lock_guard lk(mu_);
  for (Op* op : ops_) delete op;
  ops_.clear();
}

int Endpoint::ImportKey(const blob::MemKey& k, uint64_t region_size, uint64_t* rkey, uint64_t* base,
                        bool* mapped, std::string* why) {
  *mapped = false;
  if (k.raw) {
    if (!(mr_mode_ & FI_MR_RAW)) {
      *why = "the peer's " + provider_ + " uses raw keys, ours does not";
      return FERRY_ERR_INVALID_ARGS;
    }
    std::vector<uint8_t> raw = k.key;
    const int rc = fi_mr_map_raw(domain_, k.base, raw.data(), raw.size(), rkey, 0);
    if (rc != 0) {
      *why = provider_ + ": fi_mr_map_raw failed: " + FiErr(rc);
      return FERRY_ERR_INVALID_ARGS;
    }
    *mapped = true;
  } else {
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(k.key[i]) << (8 * i);
    *rkey = v;
  }
  if (k.base > UINT64_MAX - region_size) {
    if (*mapped) UnmapKey(*rkey);
    *why = "memory blob's base address overflows with the region size";
    return FERRY_ERR_INVALID_ARGS;
  }
  *base = k.base;
  return FERRY_OK;
}

void Endpoint::UnmapKey(uint64_t rkey) { fi_mr_unmap_key(domain_, rkey); }

// ---- peers ----------------------------------------------------------------------------

int Endpoint::InsertPeer(const std::string& key, const blob::EpInfo& info,
                         std::shared_ptr<PeerEp>* out, std::string* why) {
  if (info.addr_format != addr_format_) {
    *why = provider_ + ": the peer's address format " + std::to_string(info.addr_format) +
           " is not ours (" + std::to_string(addr_format_) + ")";
    return FERRY_ERR_INVALID_ARGS;
  }
  std::vector<uint8_t> addr = info.addr;
  if (addr_format_ == FI_ADDR_STR && addr.back() != 0) addr.push_back(0);
  auto p = std::make_shared<PeerEp>();
  p->key = key;
  p->ep = this;
  if (!info.doorbell.empty()) {
    // Its progress thread sleeps on a doorbell: without it, it would not see our RMAs.
    std::string bwhy;
    p->doorbell = Doorbell::Open(info.doorbell, &bwhy);
    if (!p->doorbell) {
      *why = provider_ + ": " + bwhy;
      return FERRY_ERR_TRANSPORT;
    }
  }
  const int n = fi_av_insert(av_, addr.data(), 1, &p->addr, 0, nullptr);
  if (n != 1) {
    *why = provider_ + ": fi_av_insert of the peer's address failed" +
           (n < 0 ? ": " + FiErr(n) : std::string());
    return FERRY_ERR_TRANSPORT;
  }
  if (p->doorbell) {
    std::lock_guard lk(mu_);
    bell_peers_.push_back(p);
  }
  *out = std::move(p);
  return FERRY_OK;
}

void Endpoint::RemovePeer(const std::shared_ptr<PeerEp>& p) {
  std::vector<Done> done;
  bool quiet;
  {
    std::lock_guard lk(mu_);
    p->removed = true;
    quiet = !stopped_;
    bell_peers_.erase(std::remove(bell_peers_.begin(), bell_peers_.end(), p), bell_peers_.end());
    std::vector<std::shared_ptr<Xfer>> mine;
    for (const auto& [k, x] : active_) {
      if (x->peer == p) mine.push_back(x);
    }
    for (const auto& x : mine)
      EndLocked(x, FERRY_ERR_BAD_STATE, "peer " + p->key + " was removed", &done);
    quiet = quiet && p->inflight == 0;
  }
  Deliver(&done);
  // An address with RMAs still inside the provider stays in the table until
  // the last of them completes (FinishOpLocked).
  if (quiet) {
    std::lock_guard lk(mu_);
    if (p->addr != FI_ADDR_UNSPEC) fi_av_remove(av_, &p->addr, 1, 0);
    p->addr = FI_ADDR_UNSPEC;
  }
}

// ---- transfers ------------------------------------------------------------------------

void Endpoint::Post(const std::shared_ptr<Xfer>& x) {
  std::vector<Done> done;
  std::vector<std::shared_ptr<PeerEp>> posted_to;
  {
    std::lock_guard lk(mu_);
    x->active_key = {x->deadline_ns != 0 ? x->deadline_ns : UINT64_MAX, ++seq_};
    active_.emplace(x->active_key, x);
    if (stopped_) {
      EndLocked(x, FERRY_ERR_BAD_STATE, "ofi plugin shutting down", &done);
    } else {
      queue_.push_back(x);
      bool again = false;
      PumpLocked(&done, &again, &posted_to);
    }
  }
  RingAll(posted_to);
  Deliver(&done);
  Kick();
}

void Endpoint::RingAll(const std::vector<std::shared_ptr<PeerEp>>& peers) {
  for (const auto& p : peers) {
    if (p->doorbell) p->doorbell->Ring();
  }
}

void Endpoint::Kick() {
  gen_.fetch_add(1);
  if (doorbell_) {
    doorbell_->RingIfSleeping();
  } else if (sleeping_.load()) {
    const uint64_t one = 1;
    [[maybe_unused]] ssize_t w = write(event_fd_, &one, sizeof(one));
  }
}

ssize_t Endpoint::PostRmaLocked(const std::shared_ptr<Xfer>& x, uint8_t* local, void* desc,
                                uint64_t remote, uint64_t n, int slot) {
  PeerEp* p = x->peer.get();
  if (p->doorbell && p->doorbell->OwnerDied()) {
    // Its shm region may be locked for ever (doorbell.h): never call the
    // provider for it again. What is in flight to it ends by its deadline.
    if (!p->died) {
      p->died = true;
      Log(host_, FERRY_LOG_WARN, "%s: the process of peer %s died: no more RMAs to it",
          provider_.c_str(), p->key.c_str());
    }
    x->failed = true;
    x->status = FERRY_ERR_TRANSPORT;
    x->msg = "the process of " + p->key + " died: no more RMAs to it over " + provider_;
    return -FI_EIO;
  }
  Op* op;
  if (!free_ops_.empty()) {
    op = free_ops_.back();
    free_ops_.pop_back();
  } else {
    op = new Op();
  }
  std::memset(&op->fctx, 0, sizeof(op->fctx));
  op->xfer = x;
  op->len = n;
  op->slot = slot;
  iovec iov{local, static_cast<size_t>(n)};
  fi_rma_iov riov{remote, static_cast<size_t>(n), x->rkey};
  fi_msg_rma msg{};
  msg.msg_iov = &iov;
  msg.desc = &desc;
  msg.iov_count = 1;
  msg.addr = p->addr;
  msg.rma_iov = &riov;
  msg.rma_iov_count = 1;
  msg.context = op;
  const ssize_t rc = x->op == FERRY_OP_WRITE
                         ? fi_writemsg(ep_, &msg, FI_COMPLETION | FI_DELIVERY_COMPLETE)
                         : fi_readmsg(ep_, &msg, FI_COMPLETION);
  if (rc != 0) {
    op->xfer.reset();
    free_ops_.push_back(op);
    if (rc != -FI_EAGAIN) {
      x->failed = true;
      x->status = FERRY_ERR_TRANSPORT;
      x->msg = std::string(x->op == FERRY_OP_WRITE ? "fi_writemsg" : "fi_readmsg") + " to " +
               p->key + " over " + provider_ + " failed: " + FiErr(rc);
    }
    return rc;
  }
  ops_.insert(op);
  ++inflight_;
  ++p->inflight;
  ++x->inflight;
  return 0;
}

bool Endpoint::PumpLocked(std::vector<Done>* done, bool* again,
                          std::vector<std::shared_ptr<PeerEp>>* posted_to) {
  bool did = false;
  std::vector<PeerEp*> blocked;  // peers whose RMA got -FI_EAGAIN in this pass
  auto note = [&](const std::shared_ptr<PeerEp>& peer) {
    if (peer->doorbell && std::find(posted_to->begin(), posted_to->end(), peer) == posted_to->end())
      posted_to->push_back(peer);
  };
  for (auto it = queue_.begin(); it != queue_.end();) {
    const std::shared_ptr<Xfer> x = *it;
    if (x->ended) {
      it = queue_.erase(it);
      continue;
    }
    PeerEp* p = x->peer.get();
    if (std::find(blocked.begin(), blocked.end(), p) != blocked.end()) {
      ++it;
      continue;
    }
    if (x->staged) {
      bool blocked_peer = false;
      did |= PumpStagedLocked(x, again, &blocked_peer, posted_to);
      if (blocked_peer) blocked.push_back(p);
      if (x->failed && x->Settled()) EndLocked(x, x->status, x->msg, done);
      if (x->ended) {
        it = queue_.erase(it);
      } else {
        if (inflight_ >= ep_window_) break;
        ++it;
      }
      continue;
    }
    while (!x->AllPosted() && inflight_ < ep_window_ && p->inflight < window_) {
      const ferry_iov_v1& v = x->iov[x->item];
      const uint64_t n = std::min(chunk_, v.len - x->item_off);
      const ssize_t rc = PostRmaLocked(x, x->local_base + v.local_off + x->item_off, x->local_desc,
                                       x->remote_base + v.remote_off + x->item_off, n, -1);
      if (rc != 0) {
        if (rc == -FI_EAGAIN) {
          *again = true;
          blocked.push_back(p);
          // The provider may wait for the peer (shm connects through the peer's
          // progress): make sure it is awake.
          note(x->peer);
        }
        break;
      }
      note(x->peer);
      x->item_off += n;
      if (x->item_off == v.len) {
        ++x->item;
        x->item_off = 0;
      }
      did = true;
    }
    if (x->AllPosted()) {
      if (x->failed && x->inflight == 0) EndLocked(x, x->status, x->msg, done);
      it = queue_.erase(it);
    } else {
      if (inflight_ >= ep_window_) break;
      ++it;
    }
  }
  return did;
}

// ---- GPU staging -------------------------------------------------------------------------

bool Endpoint::PumpStagedLocked(const std::shared_ptr<Xfer>& x, bool* again, bool* blocked_peer,
                                std::vector<std::shared_ptr<PeerEp>>* posted_to) {
  if (x->failed) return false;
  if (!x->stage) {
    std::unique_ptr<Stage> st = pool_ ? pool_->TryAcquire(x->device) : nullptr;
    if (!st) return false;  // every stage is in use: wait for one (StagePool::Return wakes us)
    x->stage = StageLease(pool_, std::move(st));
  }
  if (!x->stage_ready) {
    if (!x->bind_queued) {
      x->bind_queued = true;
      ++x->copying;
      QueueGpuLocked({x, -1, false});
    }
    return false;
  }
  Stage* st = x->stage.get();
  const uint64_t piece = pool_->piece();
  PeerEp* p = x->peer.get();
  bool did = false;
  for (int s = 0; s < 2; ++s) {
    StageSlot& sl = x->slot[s];
    if (sl.state == StageSlot::kFree && x->item < x->iov.size()) {
      // The next piece: items (or parts of them) up to one bounce buffer.
      sl.segs.clear();
      sl.seg = 0;
      sl.seg_off = 0;
      uint64_t used = 0;
      while (x->item < x->iov.size() && used < piece) {
        const ferry_iov_v1& v = x->iov[x->item];
        const uint64_t take = std::min(v.len - x->item_off, piece - used);
        sl.segs.push_back({v.local_off + x->item_off, v.remote_off + x->item_off, take, used});
        used += take;
        x->item_off += take;
        if (x->item_off == v.len) {
          ++x->item;
          x->item_off = 0;
        }
      }
      if (x->op == FERRY_OP_WRITE) {
        sl.state = StageSlot::kToHost;
        ++x->copying;
        QueueGpuLocked({x, s, false});
      } else {
        sl.state = StageSlot::kRma;
      }
      did = true;
    }
    if (sl.state != StageSlot::kRma) continue;
    uint8_t* buf = st->buf + static_cast<size_t>(s) * piece;
    void* desc = st->mrs[stage_index_] ? fi_mr_desc(st->mrs[stage_index_]) : nullptr;
    while (sl.seg < sl.segs.size() && inflight_ < ep_window_ && p->inflight < window_) {
      const StageSlot::Seg& g = sl.segs[sl.seg];
      const uint64_t n = std::min(chunk_, g.len - sl.seg_off);
      const ssize_t rc = PostRmaLocked(x, buf + g.buf_off + sl.seg_off, desc,
                                       x->remote_base + g.remote_off + sl.seg_off, n, s);
      if (rc != 0) {
        if (rc == -FI_EAGAIN) {
          *again = true;
          *blocked_peer = true;
          if (p->doorbell) posted_to->push_back(x->peer);
        }
        return did;
      }
      ++sl.inflight;
      if (p->doorbell &&
          std::find(posted_to->begin(), posted_to->end(), x->peer) == posted_to->end())
        posted_to->push_back(x->peer);
      sl.seg_off += n;
      if (sl.seg_off == g.len) {
        ++sl.seg;
        sl.seg_off = 0;
      }
      did = true;
    }
    if (inflight_ >= ep_window_ || p->inflight >= window_) break;
  }
  return did;
}

void Endpoint::QueueGpuLocked(GpuJob job) {
  std::lock_guard lk(gpu_mu_);  // the GPU thread runs from Start() on (staged transfers need pool_)
  gpu_jobs_.push_back(std::move(job));
  gpu_cv_.notify_one();
}

bool Endpoint::IssueCopy(const GpuJob& j, std::string* why) {
  const ferry_gpu_v1* gpu = host_->gpu;
  void* ctx = gpu->gpu_ctx;
  const Xfer& x = *j.xfer;
  Stage* st = x.stage.get();
  const char* what = j.to_device ? "host-to-device copy" : "device-to-host copy";
  auto fail = [&](const char* w) {
    const char* e = gpu->last_error ? gpu->last_error(ctx) : nullptr;
    *why = std::string("GPU staging: ") + w + " failed" + (e ? std::string(": ") + e : "");
    // Nothing of this stage may still be copying once the transfer lets go of it.
    gpu->stream_sync(ctx, st->stream);
    return false;
  };
  if (gpu->set_device(ctx, st->device) != FERRY_OK) return fail("selecting the device");
  const StageSlot& sl = x.slot[j.slot];
  uint8_t* buf = st->buf + static_cast<size_t>(j.slot) * pool_->piece();
  std::vector<void*> dst, src;
  std::vector<size_t> len;
  for (const auto& g : sl.segs) {
    void* dev = x.local_base + g.local_off;
    void* host = buf + g.buf_off;
    dst.push_back(j.to_device ? dev : host);
    src.push_back(j.to_device ? host : dev);
    len.push_back(static_cast<size_t>(g.len));
  }
  int rc = FERRY_ERR_UNSUPPORTED;
  if (len.size() > 1 && gpu->memcpy_batch_async != nullptr)
    rc = gpu->memcpy_batch_async(ctx, dst.data(), src.data(), len.data(), len.size(), st->stream);
  if (rc == FERRY_ERR_UNSUPPORTED) {
    rc = FERRY_OK;
    for (size_t i = 0; i < len.size() && rc == FERRY_OK; ++i)
      rc = gpu->memcpy_async(ctx, dst[i], src[i], len[i], st->stream);
  }
  if (rc != FERRY_OK) return fail(what);
  if (gpu->event_record(ctx, st->event[j.slot], st->stream) != FERRY_OK)
    return fail("recording an event");
  return true;
}

bool Endpoint::WaitCopy(const GpuJob& j, std::string* why) {
  const ferry_gpu_v1* gpu = host_->gpu;
  void* ctx = gpu->gpu_ctx;
  Stage* st = j.xfer->stage.get();
  void* ev = st->event[j.slot];
  // A piece's copy is short and a blocking wait is slow to wake from: poll a little first.
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(300);
  int rc;
  do {
    rc = gpu->event_query(ctx, ev);
  } while (rc == 1 && std::chrono::steady_clock::now() < until);
  if (rc == 1) rc = gpu->event_sync(ctx, ev);
  if (rc == FERRY_OK) return true;
  const char* e = gpu->last_error ? gpu->last_error(ctx) : nullptr;
  *why = std::string("GPU staging: ") + (j.to_device ? "host-to-device" : "device-to-host") +
         " copy failed" + (e ? std::string(": ") + e : "");
  gpu->stream_sync(ctx, st->stream);
  return false;
}

void Endpoint::GpuJobDone(const GpuJob& j, bool ok, const std::string& why) {
  std::vector<Done> done;
  std::vector<std::shared_ptr<PeerEp>> posted_to;
  {
    std::lock_guard lk(mu_);
    Xfer& x = *j.xfer;
    --x.copying;
    if (!x.ended) {
      if (!ok) {
        if (!x.failed) {
          x.failed = true;
          x.status = FERRY_ERR_GPU;
          x.msg = why;
        }
      } else if (j.slot < 0) {
        x.stage_ready = true;
      } else {
        x.slot[j.slot].state = j.to_device ? StageSlot::kFree : StageSlot::kRma;
      }
      if (x.Settled()) EndLocked(j.xfer, x.failed ? x.status : FERRY_OK, x.msg, &done);
      bool again = false;
      if (!stopped_ && !queue_.empty()) PumpLocked(&done, &again, &posted_to);
    }
  }
  RingAll(posted_to);
  Deliver(&done);
  Kick();
}

void Endpoint::GpuMain() {
  std::deque<GpuJob> issued;  // copies queued on their streams, oldest first
  for (;;) {
    std::deque<GpuJob> fresh;
    {
      std::unique_lock lk(gpu_mu_);
      if (issued.empty()) gpu_cv_.wait(lk, [&] { return gpu_stop_ || !gpu_jobs_.empty(); });
      if (gpu_stop_) break;
      fresh.swap(gpu_jobs_);
    }
    for (auto& j : fresh) {
      std::string why;
      bool ended;
      {
        std::lock_guard lk(mu_);
        ended = j.xfer->ended || j.xfer->failed;
      }
      if (ended) {
        GpuJobDone(j, true, "");
        continue;
      }
      if (j.slot < 0) {
        const bool ok = pool_->Bind(j.xfer->stage.get(), j.xfer->device, &why);
        GpuJobDone(j, ok, why);
      } else if (IssueCopy(j, &why)) {
        issued.push_back(std::move(j));
      } else {
        GpuJobDone(j, false, why);
      }
    }
    if (!issued.empty()) {
      GpuJob j = std::move(issued.front());
      issued.pop_front();
      std::string why;
      const bool ok = WaitCopy(j, &why);
      GpuJobDone(j, ok, why);
    }
  }
  // Stopping: no copy may outlive the transfers (their regions go away next).
  for (auto& j : issued) host_->gpu->stream_sync(host_->gpu->gpu_ctx, j.xfer->stage.get()->stream);
}

void Endpoint::StopGpu() {
  std::thread t;
  {
    std::lock_guard lk(gpu_mu_);
    gpu_stop_ = true;
    gpu_cv_.notify_all();
    t = std::move(gpu_thread_);
  }
  if (t.joinable()) t.join();
  std::lock_guard lk(gpu_mu_);
  gpu_jobs_.clear();
}

void Endpoint::EndLocked(const std::shared_ptr<Xfer>& x, int status, const std::string& msg,
                         std::vector<Done>* done) {
  if (x->ended) return;
  x->ended = true;
  if (status != FERRY_OK) x->failed = true;
  active_.erase(x->active_key);
  x->peer->stuck += x->inflight;
  done->push_back({x->ctx, status, msg});
}

void Endpoint::FinishOpLocked(Op* op, int status, const std::string& msg, std::vector<Done>* done) {
  ops_.erase(op);
  std::shared_ptr<Xfer> x = std::move(op->xfer);
  const int slot = op->slot;
  free_ops_.push_back(op);
  PeerEp* p = x->peer.get();
  --inflight_;
  --p->inflight;
  --x->inflight;
  if (p->removed && p->inflight == 0 && p->addr != FI_ADDR_UNSPEC) {
    // Its last RMA has left the provider: the address RemovePeer had to keep
    // goes now (peers restarted with stuck RMAs left one entry each, for good).
    fi_av_remove(av_, &p->addr, 1, 0);
    p->addr = FI_ADDR_UNSPEC;
  }
  if (x->ended) {
    --p->stuck;  // a late completion of a transfer that timed out or was removed
    return;
  }
  if (status != FERRY_OK && !x->failed) {
    x->failed = true;
    x->status = status;
    x->msg = msg;
  }
  if (slot >= 0) {
    StageSlot& sl = x->slot[slot];
    --sl.inflight;
    if (!x->failed && sl.inflight == 0 && sl.seg >= sl.segs.size()) {
      if (x->op == FERRY_OP_WRITE) {
        sl.state = StageSlot::kFree;  // delivered: the buffer takes the next piece
      } else {
        sl.state = StageSlot::kToDevice;
        ++x->copying;
        QueueGpuLocked({x, slot, true});
      }
    }
  }
  if (x->Settled()) EndLocked(x, x->failed ? x->status : FERRY_OK, x->msg, done);
}

void Endpoint::ExpireLocked(uint64_t now, std::vector<Done>* done) {
  while (!active_.empty() && active_.begin()->first.first <= now) {
    const std::shared_ptr<Xfer> x = active_.begin()->second;
    std::string msg = "transfer uid " + std::to_string(x->uid) + " to " + x->peer->key + " over " +
                      provider_ + " passed its deadline (" +
                      std::to_string((now - x->posted_ns) / 1'000'000) + " ms after post)";
    if (x->inflight > 0)
      msg += "; " + std::to_string(x->inflight) + " of its RMAs had not completed by then";
    if (x->peer->stuck > 0)
      msg += "; " + std::to_string(x->peer->stuck) +
             " earlier RMAs to this peer never completed either: the peer may be gone";
    if (x->inflight == 0 && x->copying == 0) {
      EndLocked(x, FERRY_ERR_TIMEOUT, msg, done);
      continue;
    }
    // Some of it is still inside the provider (or on the GPU): a READ's RMAs
    // may still write into the local region, a WRITE's still read it. Told
    // now, the core would hand the region back (or fail over, or report
    // another backend's success) with bytes still to land - 32 MiB of a
    // stopped target's READ landed after such a report. It ends when the last
    // of them does, reported late; the core's watchdog has told the
    // application the outcome is unknown meanwhile and keeps the region until
    // then. Nothing more of it is posted (failed), and it leaves the deadline
    // order (peer_remove and fini still end it).
    if (!x->failed) {
      x->failed = true;
      x->status = FERRY_ERR_TIMEOUT;
      x->msg = msg + " (reported once they had)";
    }
    active_.erase(x->active_key);
    x->active_key.first = UINT64_MAX;
    active_.emplace(x->active_key, x);
  }
}

void Endpoint::Deliver(std::vector<Done>* done) {
  for (auto& d : *done)
    host_->complete(host_->host_ctx, d.ctx, d.status,
                    d.status == FERRY_OK ? nullptr : d.msg.c_str());
  done->clear();
}

bool Endpoint::Drain(std::vector<Done>* done) {
  fi_cq_entry entries[32];
  const ssize_t n = fi_cq_read(cq_, entries, 32);
  if (n > 0) {
    std::lock_guard lk(mu_);
    for (ssize_t i = 0; i < n; ++i) {
      Op* op = static_cast<Op*>(entries[i].op_context);
      if (op != nullptr && ops_.count(op) != 0) FinishOpLocked(op, FERRY_OK, "", done);
    }
    return true;
  }
  if (n == -FI_EAGAIN) return false;
  if (n != -FI_EAVAIL) {
    Log(host_, FERRY_LOG_WARN, "%s: fi_cq_read: %s", provider_.c_str(), FiErr(n).c_str());
    return false;
  }
  fi_cq_err_entry err{};
  if (fi_cq_readerr(cq_, &err, 0) != 1) return false;
  char buf[256] = {0};
  const char* text = fi_cq_strerror(cq_, err.prov_errno, err.err_data, buf, sizeof(buf));
  const std::string detail = text != nullptr && *text ? text : "no provider detail";
  std::lock_guard lk(mu_);
  Op* op = static_cast<Op*>(err.op_context);
  if (op == nullptr || ops_.count(op) == 0) {
    Log(host_, FERRY_LOG_WARN, "%s: completion error without a transfer: %s (%s)",
        provider_.c_str(), fi_strerror(err.err), detail.c_str());
    return true;
  }
  const Xfer& x = *op->xfer;
  const std::string msg = std::string(x.op == FERRY_OP_WRITE ? "RMA write of " : "RMA read of ") +
                          std::to_string(op->len) + " bytes " +
                          (x.op == FERRY_OP_WRITE ? "to " : "from ") + x.peer->key + " over " +
                          provider_ + " failed: " + fi_strerror(err.err) + " (" + detail + ")";
  FinishOpLocked(op, MapCqErr(err.err), msg, done);
  return true;
}

bool Endpoint::CounterMoved() {
  if (cntr_ == nullptr) return false;
  const uint64_t c = fi_cntr_read(cntr_);
  if (c == last_cntr_) return false;
  last_cntr_ = c;
  return true;
}

void Endpoint::Main() {
  // Short naps should be short: the default 50 us timer slack would dominate them.
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  std::vector<Done> done;
  std::vector<std::shared_ptr<PeerEp>> to_ring;
  const uint64_t spin_ns = static_cast<uint64_t>(settings_.spin_us) * 1000ull;
  uint64_t last_act = Now();
  uint64_t nap_ns = 0;
  last_cntr_ = cntr_ ? fi_cntr_read(cntr_) : 0;
  int trywait_fails = 0;
  bool nudge = false;          // the last sleep ended by its timeout
  bool served_before = false;  // the counter moved during the last look before sleeping
  while (!stop_.load()) {
    const uint64_t seen_gen = gen_.load();
    bool act = Drain(&done);
    // RMAs this target served: their initiators may be asleep waiting for them.
    const bool served = CounterMoved() || served_before;
    served_before = false;
    bool again = false, busy;
    uint64_t next_deadline;
    const uint64_t now = Now();
    {
      std::lock_guard lk(mu_);
      if (!queue_.empty()) act |= PumpLocked(&done, &again, &to_ring);
      ExpireLocked(now, &done);
      next_deadline = active_.empty() ? UINT64_MAX : active_.begin()->first.first;
      busy = inflight_ > 0 || !queue_.empty();
      // Initiators whose RMAs we served wait for this ring. After a nap that
      // no ring cut short, nudge the peers that owe us completions: a
      // multi-step protocol (shm's segmented copy) needs both sides awake.
      for (const auto& p : bell_peers_) {
        if (served || (nudge && p->inflight > 0)) p->doorbell->RingIfSleeping();
      }
    }
    nudge = false;
    RingAll(to_ring);
    to_ring.clear();
    if (!done.empty()) {
      Deliver(&done);
      act = true;
    }
    if (act || served) {
      last_act = now;
      nap_ns = 0;
      trywait_fails = 0;
      continue;
    }
    if (now - last_act < spin_ns) continue;

    // Nothing happened for a while: block.
    int64_t timeout_ns = next_deadline == UINT64_MAX ? -1
                         : next_deadline > now       ? static_cast<int64_t>(next_deadline - now)
                                                     : 0;
    // Where progress cannot be waited for (-FI_EAGAIN; a provider without wait
    // fd with RMAs in flight, whose target rings us when it served them - but
    // a ring is not a promise), sleep in growing naps.
    bool nap = again || (doorbell_ && busy);
    bool use_fd = cq_fd_ >= 0;
    if (use_fd && !nap) {
      fid* f = &cq_->fid;
      if (fi_trywait(fabric_, &f, 1) != FI_SUCCESS) {
        if (++trywait_fails < kTrywaitRetries) continue;
        nap = true;  // the provider keeps asking to be polled
      } else {
        trywait_fails = 0;
      }
    }
    if (nap) {
      const uint64_t first = doorbell_ && !again ? kMinBellNapNs : kMinNapNs;
      nap_ns = nap_ns == 0 ? first : std::min(std::max(nap_ns * 2, first), kMaxNapNs);
      timeout_ns = timeout_ns < 0 ? static_cast<int64_t>(nap_ns)
                                  : std::min<int64_t>(timeout_ns, static_cast<int64_t>(nap_ns));
    }
    if (doorbell_) {
      const uint32_t armed = doorbell_->Arm();
      // One last look: a post or a peer's RMA may have come before we armed.
      served_before = CounterMoved();
      if (served_before || gen_.load() != seen_gen || stop_.load() || Drain(&done)) {
        doorbell_->Disarm();
        last_act = Now();
        continue;
      }
      nudge = !doorbell_->Sleep(armed, timeout_ns) && busy;
      last_act = Now();
      continue;
    }
    sleeping_.store(true);
    if (gen_.load() != seen_gen || stop_.load()) {
      sleeping_.store(false);
      continue;
    }
    pollfd pfd[2] = {{event_fd_, POLLIN, 0}, {cq_fd_, POLLIN, 0}};
    timespec ts{static_cast<time_t>(timeout_ns / 1'000'000'000),
                static_cast<long>(timeout_ns % 1'000'000'000)};
    ppoll(pfd, use_fd && !nap ? 2 : 1, timeout_ns < 0 ? nullptr : &ts, nullptr);
    sleeping_.store(false);
    if (pfd[0].revents & POLLIN) {
      uint64_t v;
      [[maybe_unused]] ssize_t r = read(event_fd_, &v, sizeof(v));
    }
    if (pfd[0].revents || (use_fd && !nap && pfd[1].revents)) last_act = Now();
  }
}

}  // namespace ferry_ofi
