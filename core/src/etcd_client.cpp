// SPDX-License-Identifier: Apache-2.0
#include "etcd_client.h"

#include <curl/curl.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <nlohmann/json.hpp>

namespace ferry::etcd {

namespace {

using json = nlohmann::json;

// curl_global_init is not thread-safe before libcurl 7.84; do it once.
void global_init() {
  static const bool done = [] { return curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK; }();
  (void)done;
}

struct Body {
  std::string text;
  bool too_big = false;
};

size_t collect(char* p, size_t size, size_t n, void* user) {
  auto* b = static_cast<Body*>(user);
  if (b->text.size() + size * n > kMaxMessageBytes) {
    b->too_big = true;
    return 0;  // aborts the transfer
  }
  b->text.append(p, size * n);
  return size * n;
}

std::string trim_slash(std::string s) {
  while (!s.empty() && s.back() == '/') s.pop_back();
  return s;
}

using Easy = std::unique_ptr<CURL, void (*)(CURL*)>;
using Headers = std::unique_ptr<curl_slist, void (*)(curl_slist*)>;

Easy make_easy(const std::string& url, const std::string& body, curl_slist* headers) {
  Easy e(curl_easy_init(), curl_easy_cleanup);
  if (!e) return e;
  curl_easy_setopt(e.get(), CURLOPT_URL, url.c_str());
  curl_easy_setopt(e.get(), CURLOPT_POST, 1L);
  curl_easy_setopt(e.get(), CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
  curl_easy_setopt(e.get(), CURLOPT_COPYPOSTFIELDS, body.c_str());
  curl_easy_setopt(e.get(), CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(e.get(), CURLOPT_NOSIGNAL, 1L);  // no SIGALRM in a library
  // Only plain HTTP(S) to the configured endpoints: no redirects elsewhere.
  curl_easy_setopt(e.get(), CURLOPT_PROTOCOLS_STR, "http,https");
  curl_easy_setopt(e.get(), CURLOPT_FOLLOWLOCATION, 0L);
  return e;
}

// One request's answer collected into *b (err: CURL_ERROR_SIZE bytes), the
// whole request, connect included, bounded by `timeout`.
void bounded_answer(CURL* e, Body* b, char* err, std::chrono::milliseconds timeout) {
  curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, collect);
  curl_easy_setopt(e, CURLOPT_WRITEDATA, b);
  curl_easy_setopt(e, CURLOPT_ERRORBUFFER, err);
  curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, static_cast<long>(timeout.count()));
  curl_easy_setopt(e, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(timeout.count()));
}

// CURLOPT_XFERINFOFUNCTION: non-zero aborts the transfer.
int stop_if_interrupted(void* flag, curl_off_t, curl_off_t, curl_off_t, curl_off_t) {
  return static_cast<const std::atomic<bool>*>(flag)->load() ? 1 : 0;
}

}  // namespace

std::string prefix_end(const std::string& prefix) {
  std::string end = prefix;
  while (!end.empty()) {
    if (static_cast<uint8_t>(end.back()) < 0xff) {
      end.back() = static_cast<char>(static_cast<uint8_t>(end.back()) + 1);
      return end;
    }
    end.pop_back();
  }
  return std::string(1, '\0');  // every key
}

Client::Client(std::vector<std::string> endpoints, std::chrono::milliseconds timeout)
    : endpoints_([&] {
        for (auto& e : endpoints) e = trim_slash(e);
        return endpoints;
      }()),
      timeout_(timeout) {
  global_init();
}

Client::~Client() = default;

Result Client::post(const std::string& path, const std::string& body, std::string& answer) {
  if (endpoints_.empty()) return {StatusCode::ERR_BAD_STATE, "etcd: no endpoints configured"};
  Headers h(curl_slist_append(nullptr, "Content-Type: application/json"), curl_slist_free_all);
  std::string errors;
  const size_t first = preferred_.load(std::memory_order_relaxed);
  for (size_t k = 0; k < endpoints_.size(); ++k) {
    if (interrupted_.load())
      return {StatusCode::ERR_TRANSPORT, "etcd POST " + path + ": the client is shutting down"};
    const size_t i = (first + k) % endpoints_.size();
    const std::string& ep = endpoints_[i];
    Easy e = make_easy(ep + path, body, h.get());
    if (!e) return {StatusCode::ERR_BAD_STATE, "etcd: curl_easy_init failed"};
    Body b;
    char err[CURL_ERROR_SIZE] = {};
    bounded_answer(e.get(), &b, err, timeout_);
    // interrupt() ends a request within curl's progress interval (about 1 s),
    // so a shutdown does not wait out the timeout on every endpoint.
    curl_easy_setopt(e.get(), CURLOPT_NOPROGRESS, 0L);
    curl_easy_setopt(e.get(), CURLOPT_XFERINFOFUNCTION, stop_if_interrupted);
    curl_easy_setopt(e.get(), CURLOPT_XFERINFODATA, &interrupted_);
    const CURLcode rc = curl_easy_perform(e.get());
    std::string why;
    if (b.too_big) {
      why = "answer larger than " + std::to_string(kMaxMessageBytes) + " bytes";
    } else if (rc != CURLE_OK) {
      why = err[0] ? err : curl_easy_strerror(rc);
    } else {
      long code = 0;
      curl_easy_getinfo(e.get(), CURLINFO_RESPONSE_CODE, &code);
      if (code == 200) {
        preferred_.store(i, std::memory_order_relaxed);
        answer = std::move(b.text);
        return {};
      }
      // The store answered and refused: that is its answer, not an outage.
      std::string m = error_message(b.text);
      preferred_.store(i, std::memory_order_relaxed);
      return {StatusCode::ERR_INVALID_ARGS, "etcd " + ep + " POST " + path + ": HTTP " +
                                                std::to_string(code) + (m.empty() ? "" : ": " + m)};
    }
    errors += (errors.empty() ? "" : "; ") + ("etcd " + ep + " POST " + path + ": " + why);
  }
  return {StatusCode::ERR_TRANSPORT, errors + " (metadata store unreachable)"};
}

Result Client::grant(std::chrono::seconds ttl, int64_t& lease) {
  std::string a;
  if (Result r = post("/v3/lease/grant", json{{"TTL", ttl.count()}}.dump(), a); !r) return r;
  int64_t t = 0;
  std::string why;
  if (!parse_lease(a, lease, t, &why) || lease == 0)
    return {StatusCode::ERR_TRANSPORT, "etcd lease grant: " + (why.empty() ? "no lease ID" : why)};
  return {};
}

Result Client::keepalive(int64_t lease, int64_t& ttl) {
  std::string a;
  if (Result r = post("/v3/lease/keepalive", json{{"ID", std::to_string(lease)}}.dump(), a); !r)
    return r;
  int64_t id = 0;
  std::string why;
  if (!parse_lease(a, id, ttl, &why)) return {StatusCode::ERR_TRANSPORT, "etcd keepalive: " + why};
  return {};
}

Result Client::revoke(int64_t lease) {
  std::string a;
  return post("/v3/lease/revoke", json{{"ID", std::to_string(lease)}}.dump(), a);
}

Result Client::put(const std::string& key, const std::string& value, int64_t lease) {
  json body{{"key", base64_encode(key)}, {"value", base64_encode(value)}};
  if (lease != 0) body["lease"] = std::to_string(lease);
  std::string a;
  return post("/v3/kv/put", body.dump(), a);
}

Result Client::get(const std::string& key, std::optional<KeyValue>& kv, int64_t* revision) {
  kv.reset();
  std::string a;
  if (Result r = post("/v3/kv/range", json{{"key", base64_encode(key)}}.dump(), a); !r) return r;
  std::vector<KeyValue> kvs;
  int64_t rev = 0;
  std::string why;
  if (!parse_range(a, kvs, rev, &why)) return {StatusCode::ERR_TRANSPORT, why};
  if (revision) *revision = rev;
  for (auto& k : kvs)
    if (k.key == key) kv = std::move(k);
  return {};
}

Result Client::get_prefix(const std::string& prefix, std::vector<KeyValue>& kvs,
                          int64_t* revision) {
  std::string a;
  json body{{"key", base64_encode(prefix)}, {"range_end", base64_encode(prefix_end(prefix))}};
  if (Result r = post("/v3/kv/range", body.dump(), a); !r) return r;
  int64_t rev = 0;
  std::string why;
  if (!parse_range(a, kvs, rev, &why)) return {StatusCode::ERR_TRANSPORT, why};
  if (revision) *revision = rev;
  return {};
}

Result Client::remove(const std::string& key) {
  std::string a;
  return post("/v3/kv/deleterange", json{{"key", base64_encode(key)}}.dump(), a);
}

Result Client::create_if_absent(const std::string& key, const std::string& value, int64_t lease,
                                bool& created) {
  created = false;
  json put{{"key", base64_encode(key)}, {"value", base64_encode(value)}};
  if (lease != 0) put["lease"] = std::to_string(lease);
  // create_revision 0: the key does not exist.
  json txn{{"compare", json::array({{{"key", base64_encode(key)},
                                     {"result", "EQUAL"},
                                     {"target", "CREATE"},
                                     {"create_revision", "0"}}})},
           {"success", json::array({{{"request_put", put}}})}};
  std::string a;
  if (Result r = post("/v3/kv/txn", txn.dump(), a); !r) return r;
  json j = json::parse(a, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    return {StatusCode::ERR_TRANSPORT, "malformed etcd txn answer"};
  auto it = j.find("succeeded");
  created = it != j.end() && it->is_boolean() && it->get<bool>();
  return {};
}

namespace {

struct WatchState {
  ObjectSplitter splitter;
  const std::function<bool(const WatchMessage&)>* on_message = nullptr;
  std::string error;  // the stream was malformed
  bool stop = false;  // on_message asked to stop
  bool got_any = false;
};

size_t on_watch_bytes(char* p, size_t size, size_t n, void* user) {
  auto* s = static_cast<WatchState*>(user);
  std::vector<std::string> objects;
  if (!s->splitter.feed(p, size * n, objects, &s->error)) return 0;
  for (const auto& o : objects) {
    WatchMessage m;
    if (!parse_watch_message(o, m, &s->error)) return 0;
    s->got_any = true;
    if (!(*s->on_message)(m)) {
      s->stop = true;
      return 0;
    }
  }
  return size * n;
}

}  // namespace

Result Client::watch(const std::string& prefix, int64_t start_revision,
                     const std::function<bool(const WatchMessage&)>& on_message,
                     std::chrono::milliseconds probe_every) {
  if (endpoints_.empty()) return {StatusCode::ERR_BAD_STATE, "etcd: no endpoints configured"};
  json req{{"create_request",
            {{"key", base64_encode(prefix)}, {"range_end", base64_encode(prefix_end(prefix))}}}};
  if (start_revision > 0) req["create_request"]["start_revision"] = std::to_string(start_revision);
  const std::string body = req.dump();
  const size_t wi = watch_ep_.load(std::memory_order_relaxed) % endpoints_.size();
  const std::string& ep = endpoints_[wi];
  Headers h(curl_slist_append(nullptr, "Content-Type: application/json"), curl_slist_free_all);
  Easy e = make_easy(ep + "/v3/watch", body, h.get());
  std::unique_ptr<CURLM, CURLMcode (*)(CURLM*)> multi(curl_multi_init(), curl_multi_cleanup);
  if (!e || !multi) return {StatusCode::ERR_BAD_STATE, "etcd: curl init failed"};
  WatchState st;
  st.on_message = &on_message;
  char err[CURL_ERROR_SIZE] = {};
  curl_easy_setopt(e.get(), CURLOPT_WRITEFUNCTION, on_watch_bytes);
  curl_easy_setopt(e.get(), CURLOPT_WRITEDATA, &st);
  curl_easy_setopt(e.get(), CURLOPT_ERRORBUFFER, err);
  curl_easy_setopt(e.get(), CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(timeout_.count()));
  // A stream stays open for ever; TCP keep-alive notices a peer that vanished
  // (not one that is frozen: its kernel still answers - the probe below does).
  curl_easy_setopt(e.get(), CURLOPT_TCP_KEEPALIVE, 1L);
  curl_easy_setopt(e.get(), CURLOPT_TCP_KEEPIDLE, 5L);
  curl_easy_setopt(e.get(), CURLOPT_TCP_KEEPINTVL, 2L);
  curl_multi_add_handle(multi.get(), e.get());
  {
    std::lock_guard lk(watch_mu_);
    watch_multi_ = multi.get();
  }
  // The probe: a one-key range (the prefix itself, keys only) on the same
  // endpoint, every probe_every, bounded by the request timeout.
  const std::string probe_body =
      json{{"key", base64_encode(prefix)}, {"limit", 1}, {"keys_only", true}}.dump();
  Easy probe(nullptr, curl_easy_cleanup);
  Body probe_answer;
  char probe_err[CURL_ERROR_SIZE] = {};
  auto next_probe = std::chrono::steady_clock::now() + probe_every;
  std::string probe_failed;
  Result out;
  for (;;) {
    if (interrupted_.load()) break;
    if (!probe && std::chrono::steady_clock::now() >= next_probe) {
      probe = make_easy(ep + "/v3/kv/range", probe_body, h.get());
      if (!probe) {
        out = {StatusCode::ERR_BAD_STATE, "etcd: curl_easy_init failed"};
        break;
      }
      probe_answer = Body{};
      probe_err[0] = '\0';
      bounded_answer(probe.get(), &probe_answer, probe_err, timeout_);
      curl_multi_add_handle(multi.get(), probe.get());
    }
    int running = 0;
    curl_multi_perform(multi.get(), &running);
    bool watch_done = false;
    CURLcode rc = CURLE_OK;
    int left = 0;
    while (CURLMsg* m = curl_multi_info_read(multi.get(), &left)) {
      if (m->msg != CURLMSG_DONE) continue;
      if (probe && m->easy_handle == probe.get()) {
        long code = 0;
        curl_easy_getinfo(probe.get(), CURLINFO_RESPONSE_CODE, &code);
        if (m->data.result != CURLE_OK)
          probe_failed = probe_err[0] ? probe_err : curl_easy_strerror(m->data.result);
        else if (code != 200)
          probe_failed = "HTTP " + std::to_string(code);
        curl_multi_remove_handle(multi.get(), probe.get());
        probe.reset();
        next_probe = std::chrono::steady_clock::now() + probe_every;
      } else if (m->easy_handle == e.get()) {
        watch_done = true;
        rc = m->data.result;
      }
    }
    if (watch_done) {
      long code = 0;
      curl_easy_getinfo(e.get(), CURLINFO_RESPONSE_CODE, &code);
      if (st.stop) break;
      std::string why = !st.error.empty() ? st.error
                        : rc != CURLE_OK  ? std::string(err[0] ? err : curl_easy_strerror(rc))
                        : code != 200     ? "HTTP " + std::to_string(code)
                                          : std::string("the store closed the stream");
      out = {StatusCode::ERR_TRANSPORT, "etcd " + ep + " watch: " + why};
      break;
    }
    if (!probe_failed.empty()) {
      out = {StatusCode::ERR_TRANSPORT, "etcd " + ep + " watch: the endpoint did not answer a " +
                                            "request beside the stream (" + probe_failed + ")"};
      break;
    }
    // Blocks until the stream has bytes, curl needs a timer, the next probe is
    // due, or interrupt().
    const auto until_probe = std::chrono::duration_cast<std::chrono::milliseconds>(
        next_probe - std::chrono::steady_clock::now());
    const long wait_ms = probe ? 30000 : std::clamp<long>(until_probe.count(), 0, 30000);
    curl_multi_poll(multi.get(), nullptr, 0, static_cast<int>(wait_ms), nullptr);
  }
  {
    std::lock_guard lk(watch_mu_);
    watch_multi_ = nullptr;
  }
  if (probe) curl_multi_remove_handle(multi.get(), probe.get());
  curl_multi_remove_handle(multi.get(), e.get());
  if (out.ok() && !st.got_any && !interrupted_.load() && !st.stop)
    out = {StatusCode::ERR_TRANSPORT, "etcd " + ep + " watch: no answer"};
  // The next watch tries the next endpoint (a member that is down, frozen or
  // refusing is left; with one endpoint this is the same one).
  if (!out.ok() && !interrupted_.load())
    watch_ep_.store((wi + 1) % endpoints_.size(), std::memory_order_relaxed);
  return out;
}

void Client::interrupt() {
  interrupted_.store(true);
  std::lock_guard lk(watch_mu_);
  if (watch_multi_) curl_multi_wakeup(static_cast<CURLM*>(watch_multi_));
}

}  // namespace ferry::etcd
