// SPDX-License-Identifier: Apache-2.0
#include "metrics_text.h"

#include <cstdio>
#include <sstream>

namespace ferry {

std::string prometheus_label_escape(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

namespace {

// One metric family: HELP and TYPE once, then its samples.
class Family {
 public:
  Family(std::ostringstream& o, const char* name, const char* type, const char* help)
      : o_(o), name_(name) {
    o_ << "# HELP " << name << ' ' << help << "\n# TYPE " << name << ' ' << type << '\n';
  }
  // labels: already formatted `a="x",b="y"` (empty: none).
  void sample(const std::string& labels, uint64_t v, const char* suffix = "") {
    o_ << name_ << suffix;
    if (!labels.empty()) o_ << '{' << labels << '}';
    o_ << ' ' << v << '\n';
  }
  void sample_double(const std::string& labels, double v, const char* suffix) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.9g", v);
    o_ << name_ << suffix << '{' << labels << "} " << buf << '\n';
  }

 private:
  std::ostringstream& o_;
  const char* name_;
};

std::string backend_label(const std::string& name) {
  return "backend=\"" + prometheus_label_escape(name) + "\"";
}

void render_backends(std::ostringstream& o, const MetricsInput& in) {
  {
    Family f(o, "ferry_transfer_bytes_total", "counter",
             "Bytes moved by transfers that succeeded, by backend and op.");
    for (const auto& [name, c] : in.counters)
      for (size_t op = 0; op < TransferMetrics::kOps; ++op)
        f.sample(backend_label(name) + ",op=\"" + TransferMetrics::op_name(op) + "\"",
                 c->metrics.bytes(op));
  }
  {
    Family f(o, "ferry_transfers_total", "counter", "Transfers that succeeded, by backend and op.");
    for (const auto& [name, c] : in.counters)
      for (size_t op = 0; op < TransferMetrics::kOps; ++op)
        f.sample(backend_label(name) + ",op=\"" + TransferMetrics::op_name(op) + "\"",
                 c->metrics.transfers(op));
  }
  struct Simple {
    const char* name;
    const char* help;
    std::atomic<uint64_t> BackendCounters::*field;
  };
  const Simple simple[] = {
      {"ferry_transfer_failures_total", "Transfer attempts that failed on the backend.",
       &BackendCounters::failures},
      {"ferry_failovers_total", "Transfers re-run on another backend after failing on this one.",
       &BackendCounters::failovers},
      {"ferry_quarantines_total", "Times a peer was quarantined on the backend.",
       &BackendCounters::quarantines},
  };
  for (const auto& s : simple) {
    Family f(o, s.name, "counter", s.help);
    for (const auto& [name, c] : in.counters)
      f.sample(backend_label(name), ((*c).*(s.field)).load(std::memory_order_relaxed));
  }
  Family h(o, "ferry_transfer_duration_seconds", "histogram",
           "Time from submit to landed for transfers that succeeded, by backend, op and size "
           "class (le4KiB .. gt16MiB).");
  for (const auto& [name, c] : in.counters)
    for (size_t op = 0; op < TransferMetrics::kOps; ++op)
      for (size_t sc = 0; sc < TransferMetrics::kSizeClasses; ++sc) {
        const TransferMetrics::Cell& cell = c->metrics.cell(op, sc);
        const std::string base = backend_label(name) + ",op=\"" + TransferMetrics::op_name(op) +
                                 "\",size_class=\"" + TransferMetrics::kSizeNames[sc] + "\"";
        uint64_t cumulative = 0;
        std::string lines;
        for (size_t b = 0; b < TransferMetrics::kBuckets; ++b) {
          cumulative += cell.buckets[b].load(std::memory_order_relaxed);
          char le[32];
          std::snprintf(le, sizeof le, "%g", TransferMetrics::kBucketUs[b] / 1e6);
          h.sample(base + ",le=\"" + le + "\"", cumulative, "_bucket");
        }
        cumulative += cell.buckets[TransferMetrics::kBuckets].load(std::memory_order_relaxed);
        h.sample(base + ",le=\"+Inf\"", cumulative, "_bucket");
        h.sample_double(base, cell.sum_ns.load(std::memory_order_relaxed) / 1e9, "_sum");
        h.sample(base, cumulative, "_count");
      }
}

}  // namespace

std::string render_prometheus(const MetricsInput& in) {
  std::ostringstream o;
  const EngineStats& s = in.stats;
  {
    Family f(o, "ferry_engine_info", "gauge", "This engine's key (always 1).");
    f.sample("engine=\"" + prometheus_label_escape(in.engine_key) + "\"", 1);
  }
  render_backends(o, in);
  struct Plain {
    const char* name;
    const char* type;
    const char* help;
    uint64_t value;
  };
  const Plain plain[] = {
      {"ferry_inbound_table_size", "gauge",
       "Inbound transfer statuses waiting for pop_inbound_transfer_status().", in.inbound_pending},
      {"ferry_inbound_notifications_total", "counter", "Inbound transfer statuses recorded.",
       s.inbound_notifications},
      {"ferry_inbound_dropped_total", "counter",
       "Inbound statuses dropped before they were popped (cap or age).", s.inbound_dropped},
      {"ferry_notifications_received_total", "counter",
       "Notification messages taken into the inbox.", s.notifications_received},
      {"ferry_notifications_dropped_total", "counter",
       "Notification messages refused: too much unread from their sender.",
       s.notifications_refused},
      {"ferry_notifications_unread", "gauge", "Notification messages in the inbox now.",
       s.notifications_unread},
      {"ferry_control_rejected_total", "counter", "Control-plane connections refused.",
       s.ctrl_rejected},
      {"ferry_notifies_resent_total", "counter",
       "Core NOTIFYs sent again on a new control connection (theirs broke unanswered).",
       s.notifies_resent},
      {"ferry_notifies_unanswered_total", "counter",
       "Core NOTIFYs given up unanswered (peer forgotten, or too many waiting).",
       s.notifies_unanswered},
      {"ferry_fences_total", "counter", "FENCE requests sent after attempts with unknown outcome.",
       s.fences},
      {"ferry_fence_unknown_total", "counter",
       "Attempts whose fence got no answer by their deadline.", s.fence_unknown},
      {"ferry_fenced_peers", "gauge", "Peers no transfer may start to now.", s.fenced_peers},
  };
  for (const auto& p : plain) Family(o, p.name, p.type, p.help).sample("", p.value);
  if (in.metadata) {
    const MetadataCounts& m = *in.metadata;
    const Plain meta[] = {
        {"ferry_metadata_store_up", "gauge",
         "1 when the last request to the metadata store (etcd) succeeded.", m.store_up ? 1u : 0u},
        {"ferry_metadata_store_errors_total", "counter",
         "Requests to the metadata store that failed.", m.store_errors},
        {"ferry_metadata_watched_peers", "gauge", "Peers fetched from the store and followed.",
         m.watched_peers},
        {"ferry_metadata_peers_expired_total", "counter",
         "Peers deregistered because their lease expired or their key was deleted.",
         m.peers_expired},
        {"ferry_metadata_peers_replaced_total", "counter",
         "New instances of known peers picked up from the store.", m.peers_replaced},
    };
    for (const auto& p : meta) Family(o, p.name, p.type, p.help).sample("", p.value);
  }
  return o.str();
}

}  // namespace ferry
