// SPDX-License-Identifier: Apache-2.0
// Writes the seed corpora (fuzz/corpus/<target>/) from valid encodings made by
// the real encoders, so each fuzzer starts from inputs that pass its decoders.
//   make_corpus SOURCE_DIR     (fuzz/run.sh --seed runs it; the output is committed)
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "cma_blob.h"
#include "control_frame.h"
#include "ferry/ferry.hpp"
#include "ofi/blob.h"
#include "rdma/wire.h"
#include "wire.h"
#include "xgmi_blob.h"

namespace fs = std::filesystem;
using Bytes = std::vector<uint8_t>;

namespace {

fs::path g_root;

void put(const std::string& target, const std::string& name, const Bytes& b) {
  fs::path dir = g_root / "fuzz" / "corpus" / target;
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary)
      .write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

Bytes cat(std::initializer_list<Bytes> parts) {
  Bytes out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

void ctrl() {
  using namespace ferry;
  uint8_t nonce[kCtrlNonceSize], mac[kCtrlProofSize];
  for (size_t i = 0; i < sizeof nonce; ++i) nonce[i] = static_cast<uint8_t>(i * 7);
  for (size_t i = 0; i < sizeof mac; ++i) mac[i] = static_cast<uint8_t>(255 - i);
  const std::string payload = "{\"op\":\"hello\"}";
  struct {
    const char* name;
    Bytes stream;
  } seeds[] = {
      {"hello", encode_ctrl_frame(CtrlType::HELLO, hello_body("prefill-0", nonce, 0))},
      {"hello_auth", encode_ctrl_frame(CtrlType::HELLO, hello_body("decode-1", nonce, 1))},
      {"challenge", encode_ctrl_frame(CtrlType::AUTH_CHALLENGE, challenge_body(nonce, mac))},
      {"proof", encode_ctrl_frame(CtrlType::AUTH_PROOF, proof_body(mac))},
      {"ok", encode_ctrl_frame(CtrlType::HELLO_OK, {})},
      {"ok_send_desc", encode_ctrl_frame(CtrlType::HELLO_OK, hello_ok_body(kHelloOkSendDesc))},
      {"refused", encode_ctrl_frame(CtrlType::HELLO_REFUSED, refused_body("not registered"))},
      {"session",
       cat({encode_ctrl_frame(CtrlType::HELLO, hello_body("a", nonce, 0)),
            encode_ctrl_frame(CtrlType::PLUGIN, plugin_body("tcp", payload.data(), payload.size())),
            encode_ctrl_frame(CtrlType::NOTIFY, notify_body(42, 0, 0x1234, {0x5eed, 3, 2}))})},
      {"notify_fail", encode_ctrl_frame(CtrlType::NOTIFY, notify_body(~0ull, -6, 0x1234))},
      {"notify_ack",
       encode_ctrl_frame(CtrlType::NOTIFY_ACK, notify_ack_body(42, NotifyAck::OTHER_LIFE))},
      {"msg", encode_ctrl_frame(CtrlType::MSG, msg_body(0x1234, 1, "req-7:8", 7))},
      {"msg_ack", encode_ctrl_frame(CtrlType::MSG_ACK, msg_ack_body(1, MsgAck::TAKEN))},
      {"fence",
       encode_ctrl_frame(CtrlType::FENCE, fence_body(7, 0x1234, {{"tcp", 41}, {"rdma", 42}}))},
      {"fence_reply",
       encode_ctrl_frame(CtrlType::FENCE_REPLY, fence_reply_body(7, 0x1234,
                                                                 {{41, FenceState::WHOLE, 1 << 20},
                                                                  {42, FenceState::NONE, 0}}))},
  };
  for (const auto& s : seeds) {
    put("ctrl_frame", std::string(s.name) + "_whole", cat({{0x3f}, s.stream}));  // one chunk
    put("ctrl_frame", std::string(s.name) + "_split", cat({{0x42}, s.stream}));  // 3-byte chunks
  }
}

void tcp() {
  namespace wire = ferry_tcp::wire;
  auto frame = [](wire::Header h, const std::vector<wire::Item>& items, const Bytes& payload) {
    Bytes b = wire::EncodeFrameHead(h, items);
    b.insert(b.end(), payload.begin(), payload.end());
    return b;
  };
  wire::Header h;
  h.type = wire::Type::kHello;
  h.payload_len = 6;
  put("tcp_wire", "hello", frame(h, {}, Bytes{'e', 'n', 'g', 'i', 'n', 'e'}));
  h.flags = wire::kFlagAuth;
  put("tcp_wire", "hello_auth", frame(h, {}, Bytes{'e', 'n', 'g', 'i', 'n', 'e'}));
  wire::Header a;
  a.type = wire::Type::kAuth;
  a.payload_len = 64;
  put("tcp_wire", "auth", frame(a, {}, Bytes(64, 0x5a)));
  wire::Header w;
  w.type = wire::Type::kWrite;
  w.flags = wire::kFlagNotify;
  w.n_items = 3;
  w.frame_count = 2;
  w.req_id = 9;
  w.region_id = 4;
  w.payload_len = 4096 + 1 + 100;
  w.xfer_seq = 12;
  w.uid = 77;
  w.low_seq = 10;
  put("tcp_wire", "write", frame(w, {{0, 4096}, {8192, 1}, {65536, 100}}, {}));
  wire::Header r = w;
  r.type = wire::Type::kRead;
  r.flags = 0;
  r.payload_len = 0;
  r.n_items = 1;
  put("tcp_wire", "read", frame(r, {{1 << 20, 1 << 16}}, {}));
  wire::Header ack;
  ack.type = wire::Type::kWriteAck;
  ack.req_id = 9;
  put("tcp_wire", "ack", frame(ack, {}, {}));
  wire::Header rd;
  rd.type = wire::Type::kReadData;
  rd.req_id = 10;
  rd.payload_len = 16;
  put("tcp_wire", "read_data", frame(rd, {}, Bytes(16, 1)));
  wire::Header e;
  e.type = wire::Type::kError;
  e.status = -2;
  e.payload_len = 13;
  put("tcp_wire", "error",
      frame(e, {}, Bytes{'n', 'o', 't', ' ', 'r', 'e', 'g', 'i', 's', 't', 'e', 'r', 'd'}));
  put("tcp_wire", "conn_blob", wire::EncodeConnBlob({"10.0.0.7", 40000, ""}));
  put("tcp_wire", "conn_blob_empty_host", wire::EncodeConnBlob({"", 1, ""}));
  put("tcp_wire", "conn_blob_unix",
      wire::EncodeConnBlob({"127.0.0.1", 40000, "ferry-tcp-0123456789abcdef"}));
  put("tcp_wire", "mem_blob", wire::EncodeMemBlob({3, 1 << 30, 0x1122334455667788ull}));
}

void descriptors() {
  ferry::EngineDesc d;
  d.key = "prefill-0";
  d.host = "10.1.2.3";
  d.port = 41000;
  d.node_id = "node-a";
  d.pid = 1234;
  d.secret = Bytes(32, 0x5a);
  d.backends["tcp"] = {1, 0x10, 0xa0, 0};
  d.backends["rdma"] = Bytes(40, 7);
  put("descriptors", "engine", d.pack());
  d.backends.clear();
  put("descriptors", "engine_no_backends", d.pack());
  ferry::MemoryDesc m;
  m.engine_key = "decode-3";
  m.id = 17;
  m.location = ferry::MemoryLocation::GPU;
  m.device = 1;
  m.bus_id = "0000:1b:00.0";
  m.addr = 0x7f0000000000;
  m.size = 1ull << 30;
  m.backends["tcp"] = ferry_tcp::wire::EncodeMemBlob({17, 1ull << 30, 0x0123456789abcdefull});
  put("descriptors", "memory", m.pack());
  m.location = ferry::MemoryLocation::CPU;
  m.device = -1;
  m.bus_id.clear();
  put("descriptors", "memory_cpu", m.pack());
}

void policy() {
  for (const auto& f : fs::directory_iterator(g_root / "config")) {
    if (f.path().extension() != ".yaml") continue;
    std::ifstream in(f.path(), std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    std::string s = ss.str();
    put("policy", f.path().stem().string(), Bytes(s.begin(), s.end()));
  }
  const char* small[] = {
      "rules:\n  - prefer: [tcp]\n",
      "timeout: 250ms\nfailover: { max_attempts: 2, quarantine: { after_failures: 1, within: 1s, "
      "for: 2s, max: 4s } }\n",
      "backends:\n  tcp: { lanes: 8, chunk_bytes: 64KiB }\nrules:\n  - match: { peer: "
      "\"decode-*\", "
      "min_bytes: 1MiB, op: read }\n    prefer: [tcp, \"*\"]\n",
  };
  int i = 0;
  for (const char* s : small)
    put("policy", "small_" + std::to_string(i++), Bytes(s, s + strlen(s)));
}

void xgmi() {
  auto bytes = [](const auto& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(&v);
    return Bytes(p, p + sizeof v);
  };
  ferry_xgmi::MemBlob b;
  b.device = 0;
  b.process = 4242;
  b.region_id = 7;
  b.addr = 0x7f0000000000;
  b.size = 1 << 20;
  b.offset = 4096;
  put("xgmi_wire", "mem_blob", bytes(b));
  ferry_xgmi::AfterEventMsg m;
  m.slot = 3;
  m.uid = 99;
  m.process = 4242;
  m.pool_id = 0x1234567890abcdef;
  put("xgmi_wire", "after_event", bytes(m));
  const uint64_t uids[3] = {99, 100, 1u << 31};
  put("xgmi_wire", "landed", ferry_xgmi::EncodeLanded(uids, 3));
}

void rdma() {
  namespace w = ferry_rdma::wire;
  w::PortInfo p;
  p.name = "rxe0";
  p.link_layer = 2;
  p.active_mtu = 3;
  p.gid_index = 1;
  for (size_t i = 0; i < sizeof p.gid; ++i) p.gid[i] = static_cast<uint8_t>(0xfe - i);
  w::PortInfo q = p;
  q.name = "mlx5_1";
  q.port = 2;
  q.numa_node = 1;
  put("rdma_wire", "conn_info", w::EncodeConnInfo({0x1122334455667788ull, {p, q}}));
  put("rdma_wire", "mem_info", w::EncodeMemInfo({0x7f0000000000, 1 << 20, 1, {0x1234, 0x5678}}));
  w::ConnectMsg req;
  req.conn_id = 7;
  req.target_nonce = 0x99;
  req.mtu = 3;
  req.rd_atomic = 16;
  req.qps = {{0x11, 0x22}, {0x33, 0x44}};
  put("rdma_wire", "connect_req", w::EncodeConnectMsg(req));
  w::ConnectMsg rep = req;
  rep.type = w::MsgType::kConnectRep;
  put("rdma_wire", "connect_rep", w::EncodeConnectMsg(rep));
  w::ConnectMsg nak;
  nak.type = w::MsgType::kConnectNak;
  nak.conn_id = 7;
  nak.reason = "no such port";
  put("rdma_wire", "connect_nak", w::EncodeConnectMsg(nak));
  w::ConnectMsg bye;
  bye.type = w::MsgType::kDisconnect;
  bye.conn_id = 7;
  put("rdma_wire", "disconnect", w::EncodeConnectMsg(bye));
  uint8_t n[w::kNotifySize];
  w::EncodeNotify(42, n);
  put("rdma_wire", "notify", Bytes(n, n + sizeof n));
}

void ofi() {
  namespace b = ferry_ofi::blob;
  b::ConnInfo c;
  c.eps.push_back({"shm", "/ferry-doorbell-1", 5, Bytes{'f', 'i', '_', 's', 'h', 'm', 0}});
  c.eps.push_back({"tcp;ofi_rxm", "", 2, Bytes(16, 0x7f)});
  put("ofi_blob", "conn", b::EncodeConn(c));
  b::MemInfo m;
  m.id = 3;
  m.size = 1 << 20;
  m.keys.push_back({"shm", 0x7f0000000000, false, Bytes(8, 0x42)});
  m.keys.push_back({"tcp;ofi_rxm", 0, true, Bytes(24, 0x17)});
  put("ofi_blob", "mem", b::EncodeMem(m));
  b::MemInfo gpu;
  gpu.id = 4;
  gpu.size = 4096;
  gpu.gpu_local_only = true;
  put("ofi_blob", "mem_gpu_local_only", b::EncodeMem(gpu));
}

void cma() {
  const char node[] = "node-a";
  cma_conn c{4242, 123456789, 4026531836ull, node, sizeof node - 1};
  Bytes conn(cma_conn_blob_len(c.node_len));
  cma_conn_encode(conn.data(), conn.size(), &c);
  put("cma_blob", "conn", conn);
  Bytes mem(CMA_MEM_BLOB_LEN);
  cma_mem_encode(mem.data(), 9, 0x7f0000001000, 1 << 20);
  put("cma_blob", "mem", mem);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s SOURCE_DIR\n", argv[0]);
    return 2;
  }
  g_root = argv[1];
  ctrl();
  tcp();
  descriptors();
  policy();
  xgmi();
  rdma();
  ofi();
  cma();
  return 0;
}
