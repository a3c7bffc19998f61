// SPDX-License-Identifier: Apache-2.0
#include "instance.h"

#include <algorithm>
#include <cstring>

#include "handshake.h"
#include "hot_path.h"
#include "log.h"
#include "wire.h"

namespace ferry_tcp {
namespace {

// A deregistration waits this long for I/O in progress before cutting its socket.
constexpr std::chrono::milliseconds kRevokeGrace{200};

bool IsWildcard(const std::string& h) { return h == "0.0.0.0" || h == "::" || h == "[::]"; }

}  // namespace

Instance::Instance(const ferry_host_v1* host, std::string engine_key, Settings settings)
    : host_(host),
      engine_key_(std::move(engine_key)),
      settings_(WithRuntimeDefaults(std::move(settings), RuntimePins(host))),
      stages_(host, settings_.gpu_stage_bytes, settings_.gpu_pinned_bytes,
              StagesInRing(settings_, RuntimePins(host))),
      push_waiter_(host),
      watcher_(host, &Instance::OnExpired),
      pool_(settings_.io_threads > 0 ? settings_.io_threads : IoPool::DefaultThreads(),
            // Stalls are looked for a few times per io_timeout, at most every 250 ms.
            std::clamp(std::chrono::milliseconds(settings_.io_timeout_ms / 4),
                       std::chrono::milliseconds(5), std::chrono::milliseconds(250)),
            // After its last work a thread polls this long: frames queued by
            // post() go out and arriving ones are read without a wake-up.
            // target_spin_us: only after serving a ring lane as the target.
            std::chrono::microseconds(settings_.sender_spin_us > 0 ? settings_.sender_spin_us
                                                                   : settings_.target_spin_us),
            /*poll_every_turn=*/settings_.sender_spin_us > 0),
      reaper_(std::chrono::milliseconds(settings_.lane_idle_ms)),
      target_(host, engine_key_, settings_, &regions_, &stages_, &pool_),
      // Idle this long after the last post, the flusher sleeps until the next.
      posts_(std::chrono::microseconds(settings_.post_flush_us), std::chrono::milliseconds(50)) {}

Instance::~Instance() {
  // Posted transfers to their lanes first, then the initiator side: it fails
  // our own pending transfers with BAD_STATE.
  posts_.Stop();
  std::set<PeerHandle*> peers;
  {
    std::lock_guard lk(handles_mu_);
    peers.swap(peers_);
  }
  for (PeerHandle* p : peers) p->peer->Stop(FERRY_ERR_BAD_STATE, "tcp plugin shutting down");
  // Failed direct READs whose target still copies: until it is done, or
  // io_timeout_ms (then completed anyway, with an error in the log).
  push_waiter_.Stop(std::chrono::milliseconds(settings_.io_timeout_ms));
  target_.Stop();
  pool_.Stop();
  reaper_.Stop();
  connector_.Stop();
  watcher_.Stop();
  for (PeerHandle* p : peers) delete p;
  for (auto& r : regions_.TakeAll()) r->Revoke(kRevokeGrace);
  std::lock_guard lk(handles_mu_);
  for (LocalMem* m : locals_) delete m;
  for (RemoteMem* m : remotes_) delete m;
}

void Instance::OnExpired(const std::shared_ptr<Xfer>& x) {
  auto peer = x->peer.lock();
  if (!peer) return;
  // Before MarkError: from then on a lane may drop the transfer's frames and
  // complete it, and the application post the next one, which is not doomed.
  const uint64_t keep_from = peer->PostedSoFar();
  const uint64_t now = x->host->now_ns(x->host->host_ctx);
  const std::string msg = "transfer uid " + std::to_string(x->uid) + " to " + peer->info().label +
                          " passed its deadline (" +
                          std::to_string((now - x->posted_ns) / 1000000) + " ms after post)";
  x->MarkError(FERRY_ERR_TIMEOUT, msg);
  Log(x->host, FERRY_LOG_WARN, "%s; resetting its lanes", msg.c_str());
  // A peer that lets one transfer hang is not trusted with the others either.
  peer->ResetLanes(FERRY_ERR_TIMEOUT,
                   "lanes to " + peer->info().label + " were reset after a transfer timed out",
                   keep_from);
}

std::unique_ptr<Instance> Instance::Create(const ferry::plugin_kit::InitArgs& a, int* code,
                                           std::string* why) {
  if (std::strlen(a.engine_key) > wire::kMaxKeyLen) {
    *code = FERRY_ERR_INVALID_ARGS;
    *why = "engine key must be 1.." + std::to_string(wire::kMaxKeyLen) + " bytes";
    return nullptr;
  }
  return ferry::plugin_kit::ParseAndStart<Instance, Settings>(a, ParseSettings, FERRY_ERR_TRANSPORT,
                                                              code, why);
}

bool Instance::Start(std::string* err) {
  if (!pool_.Start(err)) return false;
  if (!reaper_.Start(err)) return false;
  if (!target_.Start(err)) return false;
  if (PostQueueOn() && !posts_.Start(err)) return false;
  watcher_.Start();
  return true;
}

int Instance::ConnInfo(void* buf, size_t* len) {
  if (buf == nullptr || len == nullptr) return FERRY_ERR_INVALID_ARGS;
  wire::ConnInfo ci;
  ci.port = target_.port();
  ci.host = settings_.advertise_host.empty() ? settings_.listen_host : settings_.advertise_host;
  // A wildcard address is not somewhere to dial: let peers use the core's host.
  if (IsWildcard(ci.host)) ci.host.clear();
  ci.unix_name = target_.unix_name();
  const std::vector<uint8_t> blob = wire::EncodeConnBlob(ci);
  if (*len < blob.size()) return FERRY_ERR_INVALID_ARGS;
  std::memcpy(buf, blob.data(), blob.size());
  *len = blob.size();
  return FERRY_OK;
}

int Instance::PeerAdd(const ferry_peer_v1* p, void** handle) {
  if (p == nullptr || handle == nullptr || !FERRY_HAS_FIELD(ferry_peer_v1, p, conn_blob_len) ||
      p->key == nullptr || p->key[0] == '\0') {
    return FERRY_ERR_INVALID_ARGS;
  }
  if (p->conn_blob_len == 0) return FERRY_ERR_NOT_FOUND;
  wire::ConnInfo ci;
  std::string why;
  if (!wire::DecodeConnBlob(p->conn_blob, p->conn_blob_len, &ci, &why)) {
    Log(host_, FERRY_LOG_WARN, "peer %s: %s", p->key, why.c_str());
    return FERRY_ERR_INVALID_ARGS;
  }
  if (ci.host.empty()) ci.host = p->host != nullptr ? p->host : "";
  if (ci.host.empty()) {
    Log(host_, FERRY_LOG_WARN, "peer %s: no host to connect to", p->key);
    return FERRY_ERR_INVALID_ARGS;
  }
  PeerInfo info;
  info.host = host_;
  info.key = p->key;
  info.addr = ci.host;
  info.port = ci.port;
  info.label = info.key + " (" + ci.host + ":" + std::to_string(ci.port) + ")";
  info.my_key = engine_key_;
  info.connect_timeout_ms = settings_.connect_timeout_ms;
  info.keepalive_s = settings_.keepalive_s;
  info.idle_close_ms = settings_.lane_idle_ms;
  info.stages = &stages_;
  // Same node id: the target's unix socket, and then shared rings, if it has one
  // (another network namespace of this host falls back to TCP on the first lane).
  if (p->same_host != 0 && settings_.same_host_rings) info.unix_name = ci.unix_name;
  info.ring_bytes = settings_.ring_bytes;
  info.ring_spin_us = settings_.ring_spin_us;
  info.sender_spin_us = settings_.sender_spin_us;
  info.sender_polls_caught = &sender_polls_caught_;
  info.ring_lanes_opened = &ring_lanes_opened_;
  info.offer_direct = settings_.same_host_direct;
  info.direct_min_bytes = settings_.direct_min_bytes;
  info.direct_lanes_opened = &direct_lanes_opened_;
  info.direct_frames = &direct_frames_;
  info.push_waiter = &push_waiter_;
  info.pool = &pool_;
  info.progress = &progress_;
  info.reaper = &reaper_;
  info.connector = &connector_;
  info.posts = PostQueueOn() ? &posts_ : nullptr;

  if (!target_.AddPeer(info.key, p->same_host != 0)) {
    Log(host_, FERRY_LOG_WARN, "peer %s is already added", p->key);
    return FERRY_ERR_BAD_STATE;
  }
  try {
    auto h = std::make_unique<PeerHandle>();
    // Frames to a same-host peer are smaller: its lanes copy in parallel.
    const uint64_t chunk = info.unix_name.empty()
                               ? settings_.chunk_bytes
                               : std::min(settings_.chunk_bytes, settings_.ring_chunk_bytes);
    h->peer = std::make_shared<Peer>(std::move(info), settings_.lanes, chunk,
                                     settings_.gpu_chunk_bytes, &watcher_, &xfer_seqs_);
    std::lock_guard lk(handles_mu_);
    peers_.insert(h.get());
    *handle = h.release();
  } catch (...) {
    target_.RemovePeer(p->key);
    throw;
  }
  return FERRY_OK;
}

void Instance::PeerRemove(void* handle) {
  auto* h = static_cast<PeerHandle*>(handle);
  if (h == nullptr) return;
  {
    std::lock_guard lk(handles_mu_);
    if (peers_.erase(h) == 0) return;
  }
  h->peer->Stop(FERRY_ERR_BAD_STATE, "peer " + h->peer->info().key + " was removed");
  // Its transfers still on the post queue fail on its stopped lanes now:
  // plugin.h, every transfer to it is completed before peer_remove returns.
  posts_.Barrier();
  // And its failed direct READs whose target still copied into them (bounded).
  push_waiter_.Drain(h->peer.get(), std::chrono::milliseconds(settings_.io_timeout_ms));
  target_.RemovePeer(h->peer->info().key);
  delete h;
}

int Instance::MemRegister(const ferry_mem_v1* m, void** handle, void* blob, size_t* blob_len) {
  if (m == nullptr || handle == nullptr || !FERRY_HAS_FIELD(ferry_mem_v1, m, size)) {
    return FERRY_ERR_INVALID_ARGS;
  }
  int device = -1;
  if (m->location == FERRY_MEM_GPU) {
    // Staged through host buffers, so the GPU runtime must be there to copy.
    const bool runtime = FERRY_HAS_FIELD(ferry_host_v1, host_, gpu) && host_->gpu != nullptr;
    if (!runtime || !FERRY_HAS_FIELD(ferry_mem_v1, m, device)) return FERRY_ERR_UNSUPPORTED;
    device = m->device;
    if (device < 0) return FERRY_ERR_INVALID_ARGS;
  } else if (m->location != FERRY_MEM_CPU) {
    return FERRY_ERR_INVALID_ARGS;
  }
  if (m->addr == nullptr || m->size == 0) return FERRY_ERR_INVALID_ARGS;
  if (blob == nullptr || blob_len == nullptr || *blob_len < wire::kMemBlobSize) {
    return FERRY_ERR_INVALID_ARGS;
  }
  uint64_t key = 0;
  if (!RandomBytes(&key, sizeof key)) return FERRY_ERR_INTERNAL;
  const std::vector<uint8_t> b = wire::EncodeMemBlob({m->id, m->size, key, device < 0});
  auto r = std::make_shared<Region>(m->id, static_cast<uint8_t*>(m->addr), m->size, device, key);
  auto h = std::make_unique<LocalMem>();
  h->region = r;
  {
    std::lock_guard lk(handles_mu_);
    locals_.insert(h.get());
  }
  if (!regions_.Add(r)) {
    std::lock_guard lk(handles_mu_);
    locals_.erase(h.get());
    Log(host_, FERRY_LOG_WARN, "memory id %llu is already registered",
        static_cast<unsigned long long>(m->id));
    return FERRY_ERR_INVALID_ARGS;
  }
  std::memcpy(blob, b.data(), b.size());
  *blob_len = b.size();
  *handle = h.release();
  return FERRY_OK;
}

void Instance::MemDeregister(void* handle) {
  auto* h = static_cast<LocalMem*>(handle);
  if (h == nullptr) return;
  {
    std::lock_guard lk(handles_mu_);
    if (locals_.erase(h) == 0) return;
  }
  // Out of the table first, so requests arriving from now on find nothing.
  regions_.Remove(h->region->id());
  h->region->Revoke(kRevokeGrace);
  delete h;
}

int Instance::MemImport(void* peer, uint64_t remote_id, uint64_t remote_size, const void* blob,
                        size_t blob_len, void** handle) {
  if (peer == nullptr || handle == nullptr) return FERRY_ERR_INVALID_ARGS;
  wire::MemInfo mi;
  std::string why;
  if (!wire::DecodeMemBlob(blob, blob_len, &mi, &why)) {
    Log(host_, FERRY_LOG_WARN, "import of memory %llu: %s",
        static_cast<unsigned long long>(remote_id), why.c_str());
    return FERRY_ERR_INVALID_ARGS;
  }
  if (mi.id != remote_id || mi.size != remote_size) {
    Log(host_, FERRY_LOG_WARN,
        "import of memory %llu: blob describes memory %llu of %llu bytes, descriptor says %llu",
        static_cast<unsigned long long>(remote_id), static_cast<unsigned long long>(mi.id),
        static_cast<unsigned long long>(mi.size), static_cast<unsigned long long>(remote_size));
    return FERRY_ERR_INVALID_ARGS;
  }
  auto h = std::make_unique<RemoteMem>(
      RemoteMem{static_cast<PeerHandle*>(peer), mi.id, mi.size, mi.key, mi.host});
  std::lock_guard lk(handles_mu_);
  remotes_.insert(h.get());
  *handle = h.release();
  return FERRY_OK;
}

void Instance::MemRelease(void* handle) {
  auto* h = static_cast<RemoteMem*>(handle);
  if (h == nullptr) return;
  std::lock_guard lk(handles_mu_);
  if (remotes_.erase(h) != 0) delete h;
}

FERRY_HOT int Instance::Post(const ferry_xfer_v1* x) {
  if (x == nullptr || !FERRY_HAS_FIELD(ferry_xfer_v1, x, xfer_ctx)) return FERRY_ERR_INVALID_ARGS;
  auto* peer = static_cast<PeerHandle*>(x->peer);
  auto* local = static_cast<LocalMem*>(x->local_mem);
  auto* remote = static_cast<RemoteMem*>(x->remote_mem);
  std::string why;
  int rc = FERRY_ERR_INVALID_ARGS;
  if (peer == nullptr || local == nullptr || remote == nullptr) {
    why = "missing peer or memory handle";
  } else if (remote->peer != peer) {
    why = "remote memory was imported for another peer";
  } else {
    rc = peer->peer->Post(*x, local->region, remote->id, remote->key, remote->host, &why);
    if (rc == FERRY_OK) return rc;
  }
  Log(host_, FERRY_LOG_WARN, "post refused: %s", why.c_str());
  ferry::plugin_kit::TellRefusal(x, why.c_str());
  return rc;
}

int Instance::Describe(char* buf, size_t len) {
  if (buf == nullptr || len == 0) return FERRY_ERR_INVALID_ARGS;
  std::string s = "lanes=" + std::to_string(settings_.lanes) +
                  " chunk=" + FormatBytes(settings_.chunk_bytes) +
                  " listen=" + settings_.listen_host + ":" + std::to_string(target_.port());
  if (!settings_.advertise_host.empty()) s += " advertise=" + settings_.advertise_host;
  s += " connect_timeout=" + std::to_string(settings_.connect_timeout_ms) +
       "ms io_timeout=" + std::to_string(settings_.io_timeout_ms) +
       "ms lane_idle=" + std::to_string(settings_.lane_idle_ms) + "ms";
  if (settings_.sender_spin_us > 0)
    s += " sender_spin=" + std::to_string(settings_.sender_spin_us) + "us";
  else if (settings_.target_spin_us > 0)
    s += " target_spin=" + std::to_string(settings_.target_spin_us) + "us";
  if (FERRY_HAS_FIELD(ferry_host_v1, host_, gpu) && host_->gpu != nullptr) {
    s += " gpu_chunk=" + FormatBytes(settings_.gpu_chunk_bytes) +
         " gpu_stage=" + FormatBytes(settings_.gpu_stage_bytes) +
         " gpu_pinned=" + FormatBytes(stages_.pinned_bytes()) + "/" +
         FormatBytes(settings_.gpu_pinned_bytes) +
         (settings_.gpu_stage_in_ring ? " gpu_in_ring" : "");
  }
  s += target_.unix_name().empty()
           ? std::string(" same_host=tcp")
           : " same_host=rings(@" + target_.unix_name() + ", " + FormatBytes(settings_.ring_bytes) +
                 " x2 per lane, chunk " + FormatBytes(settings_.ring_chunk_bytes) + ", spin " +
                 std::to_string(settings_.ring_spin_us) + "us, direct " +
                 (settings_.same_host_direct ? "from " + FormatBytes(settings_.direct_min_bytes)
                                             : std::string("off")) +
                 ")";
  s += std::string(" auth=") + (LinkAuthAvailable(host_) ? "descriptor" : "off") +
       " rejected_lanes=" + std::to_string(target_.rejected());
  std::snprintf(buf, len, "%s", s.c_str());
  return FERRY_OK;
}

int Instance::Counters(char* buf, size_t len) {
  size_t peers = 0, locals = 0, remotes = 0;
  {
    std::lock_guard lk(handles_mu_);
    peers = peers_.size();
    locals = locals_.size();
    remotes = remotes_.size();
  }
  const StageTimes& t = stages_.times();
  auto u = [](const std::atomic<uint64_t>& v) { return static_cast<unsigned long long>(v.load()); };
  std::snprintf(
      buf, len,
      "{\"peers\":%zu,\"local_regions\":%zu,\"remote_regions\":%zu,"
      "\"rejected_lanes\":%llu,\"gpu_pinned_bytes\":%llu,"
      "\"ring_lanes_opened\":%llu,\"ring_lanes_served\":%llu,"
      "\"direct_lanes_opened\":%llu,\"direct_lanes_served\":%llu,\"direct_frames_sent\":%llu,"
      "\"gpu_frames_sent\":%llu,\"gpu_send_ns\":%llu,\"gpu_send_wait_ns\":%llu,"
      "\"gpu_frames_received\":%llu,\"gpu_recv_ns\":%llu,\"gpu_recv_read_ns\":%llu,"
      "\"gpu_recv_wait_ns\":%llu,\"gpu_acquires\":%llu,\"gpu_acquire_ns\":%llu,"
      "\"gpu_ring_frames\":%llu,\"gpu_ring_pins\":%llu,\"gpu_ring_pin_fails\":%llu,"
      "\"progress_frames\":%llu,\"sender_polls_caught\":%llu,"
      "\"posts_by_waiters\":%llu,\"posts_by_flusher\":%llu,\"post_flusher_wakeups\":%llu,"
      "\"post_flusher_asleep\":%d,\"pool_turn_waits\":%llu,\"pool_watch_turns\":%llu}",
      peers, locals, remotes, static_cast<unsigned long long>(target_.rejected()),
      static_cast<unsigned long long>(stages_.pinned_bytes()),
      static_cast<unsigned long long>(ring_lanes_opened_.load()),
      static_cast<unsigned long long>(target_.ring_lanes()), u(direct_lanes_opened_),
      static_cast<unsigned long long>(target_.direct_lanes()), u(direct_frames_), u(t.frames_sent),
      u(t.send_ns), u(t.send_wait_ns), u(t.frames_received), u(t.recv_ns), u(t.recv_read_ns),
      u(t.recv_wait_ns), u(t.acquires), u(t.acquire_ns), u(t.ring_frames), u(t.ring_pins),
      u(t.ring_pin_fails), static_cast<unsigned long long>(progress_.frames()),
      u(sender_polls_caught_) + static_cast<unsigned long long>(pool_.kicks_caught()),
      static_cast<unsigned long long>(posts_.by_waiters()),
      static_cast<unsigned long long>(posts_.by_flusher()),
      static_cast<unsigned long long>(posts_.wakeups()), !PostQueueOn() || posts_.asleep() ? 1 : 0,
      static_cast<unsigned long long>(pool_.turn_waits()),
      static_cast<unsigned long long>(pool_.watch_turns()));
  return FERRY_OK;
}

int Instance::Fence(const char* peer_key, const uint64_t* ids, size_t n, uint64_t deadline_ns,
                    ferry_fence_result_v1* out) {
  if (peer_key == nullptr || (n > 0 && (ids == nullptr || out == nullptr)))
    return FERRY_ERR_INVALID_ARGS;
  // deadline_ns is on host->now_ns()'s clock, which is steady_clock's.
  const uint64_t now = host_->now_ns(host_->host_ctx);
  const auto left = std::chrono::nanoseconds(deadline_ns > now ? deadline_ns - now : 0);
  return target_.Fence(peer_key, ids, n, std::chrono::steady_clock::now() + left, out);
}

}  // namespace ferry_tcp
