// SPDX-License-Identifier: Apache-2.0
// The control plane's wire format. Every frame:
//   magic "FRYC" (u32 LE) | version u8 | type u8 | reserved u16 (0) | body length u32 | body
// Bodies are little-endian fields (wire_codec.h). A frame is at most kMaxCtrlBody
// bytes of body (kMaxHandshakeBody before the peer has been admitted); anything
// malformed closes the connection.
//
// Handshake (version 2: access by descriptor, link_auth.h). Always:
//   client: HELLO(key, Nc, flags)      Nc: 32 random bytes; flags bit 0: it has
//                                      a cluster token
//   server: AUTH_CHALLENGE(Ns, Ps)     Ps: the target's proof (64 bytes) over
//                                      "ferry-ctrl-v2 server" Nc Ns keys
//   client: checks Ps against the descriptor it registered for the server, then
//           AUTH_PROOF(Pc)             Pc: the initiator's proof over
//                                      "ferry-ctrl-v2 client" Nc Ns keys
//   server: checks Pc (its own secret; the client's too when it registered
//           that key) -> HELLO_OK(flags) | HELLO_REFUSED
//   client, when HELLO_OK asks for it (the server does not know its secret):
//           PEER_DESC(its EngineDesc sealed for the server, auth::seal), whose
//           secret must match the second half of Pc: the server learns the
//           client (one-way registration).
// (auth::ctrl_transcript). No secret travels. Version 1 peers are refused by
// the frame header's version.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace ferry {

constexpr uint32_t kCtrlMagic = 0x43595246;  // "FRYC" little-endian
// 3: NOTIFY names the receiver's life and is answered (NOTIFY_ACK).
// 4: NOTIFY carries its place in the sender's sequence (NotifySeq).
constexpr uint8_t kCtrlVersion = 4;
constexpr size_t kCtrlHeaderSize = 12;
constexpr uint32_t kMaxCtrlBody = 1u << 20;
constexpr uint32_t kMaxHandshakeBody = 512;
// A PEER_DESC: a sealed engine descriptor (at most 256 KiB, descriptors.cpp)
// and the seal's own bytes - before the sender is admitted.
constexpr uint32_t kMaxPeerDescBody = (256u << 10) + 4096;
constexpr size_t kCtrlNonceSize = 32;
constexpr size_t kCtrlProofSize = 64;  // LinkAuth::kProofSize
constexpr uint8_t kHelloHasToken = 1;

enum class CtrlType : uint8_t {
  HELLO = 1,          // body: str8 sender key, 32-byte nonce, u8 flags
  HELLO_OK = 2,       // body: empty, or u8 flags (kHelloOkSendDesc)
  HELLO_REFUSED = 3,  // body: str8 reason
  PLUGIN = 4,         // body: str8 plugin name, then the plugin's opaque payload
  // A transfer to the receiver landed (the core tells it where the backend
  // cannot). body: u64 uid, i32 status, u64 the receiver's instance the sender
  // means, then NotifySeq (u64 life, u64 seq, u64 floor). Answered on the same
  // connection by NOTIFY_ACK before the sender uses the connection again; a
  // resend is taken once (InboundTable: by its seq, else by its uid).
  NOTIFY = 5,
  AUTH_CHALLENGE = 6,  // body: 32-byte server nonce, 64-byte server proof
  AUTH_PROOF = 7,      // body: 64-byte client proof
  // The initiator gave up on WRITE attempts whose outcome it does not know; the
  // receiver (their target) must make sure none of their bytes lands from now
  // on and say what had landed. Sent on a connection of its own, answered on it.
  // body: u64 request id, u64 target instance, u32 n, n x (str8 backend, u64 attempt)
  FENCE = 8,
  // body: u64 request id, u64 instance, u32 n, n x (u64 attempt, u8 state, u64 landed)
  FENCE_REPLY = 9,
  PEER_DESC = 10,  // body: the sender's packed EngineDesc (only when HELLO_OK asked for it)
  // A notification message (Engine::send_notification, or one attached to a
  // transfer). body: u64 sender instance, u64 message id, then the payload (at
  // most kMaxNotifPayload bytes). Ids grow per (sender instance, receiver): the
  // sender has one message in flight per receiver, so the receiver keeps only
  // the highest id it has decided on (notif_inbox.h). Answered on the same
  // connection by MSG_ACK before the sender sends its next message.
  MSG = 11,
  MSG_ACK = 12,     // body: u64 message id, u8 MsgAck
  NOTIFY_ACK = 13,  // body: u64 uid, u8 NotifyAck
};
constexpr uint8_t kMaxCtrlType = 13;
constexpr size_t kMaxNotifPayload = 64 * 1024;
// In a FENCE, the entry that asks about a notification message: its attempt is
// the message id (the receiver refuses that id from now on if it has not taken it).
constexpr const char* kMsgFenceBackend = "@msg";

// The receiver's answer to a MSG.
enum class MsgAck : uint8_t {
  TAKEN = 0,   // in the inbox (now, or already: a resend of the last message)
  FULL = 1,    // refused: the inbox holds too much unread from this sender
  FENCED = 2,  // refused: a fence for this id came first (it will never be taken)
  STALE = 3,   // an id below one already decided: a resend from long ago, ignored
};
constexpr uint8_t kMaxMsgAck = 3;

// A NOTIFY's place in its sender's sequence, stamped by the sender's control
// plane as it sends it: `life` names that sequence (random; one per peer the
// sender talks to, and a new one after it forgot that peer), `seq` numbers
// its NOTIFYs upwards from 1, and `floor` is the oldest seq still unanswered
// when it left (every seq below was answered, or given up). A receiver
// remembers the seqs it took from `floor` up and so knows a resend however
// many other landings came in between (InboundTable). seq 0: not sequenced
// (only the uid window knows a repeat).
struct NotifySeq {
  uint64_t life = 0, seq = 0, floor = 0;
};
// Where NotifySeq starts in a NOTIFY's body (after uid, status, instance).
constexpr size_t kNotifySeqAt = 20;

// The receiver's answer to a NOTIFY.
enum class NotifyAck : uint8_t {
  TAKEN = 0,       // recorded (now, or already: a resend)
  OTHER_LIFE = 1,  // meant for another instance of this engine: not recorded
};
constexpr uint8_t kMaxNotifyAck = 1;
constexpr uint8_t kHelloOkSendDesc = 1;
constexpr uint32_t kMaxFenceEntries = 4096;

// A FENCE entry, and what the target found for it (FenceState).
struct FenceEntry {
  std::string backend;
  uint64_t attempt = 0;
};
enum class FenceState : uint8_t {
  NONE = 0,         // no byte landed, and none will
  PARTIAL = 1,      // some bytes landed; no more will
  WHOLE = 2,        // every byte landed (and a notify transfer was recorded)
  UNSUPPORTED = 3,  // that backend cannot fence (not loaded there, or no fence op)
  UNKNOWN = 4,      // the target could not establish it by the deadline
};
struct FenceResult {
  uint64_t attempt = 0;
  FenceState state = FenceState::UNKNOWN;
  uint64_t landed = 0;
};

std::vector<uint8_t> encode_ctrl_frame(CtrlType type, const std::vector<uint8_t>& body);

struct CtrlFrame {
  CtrlType type;
  std::vector<uint8_t> body;
};

// Accumulates bytes from a stream and cuts frames; after an error it stays failed.
class CtrlFrameReader {
 public:
  // Feed bytes; complete frames are appended to out. Returns false (with error())
  // on a malformed header; frames cut before the error are still in out.
  bool feed(const uint8_t* data, size_t n, std::vector<CtrlFrame>& out);
  const std::string& error() const { return error_; }
  // Frames with a longer body are malformed (kMaxCtrlBody by default).
  void set_max_body(uint32_t n) { max_body_ = n < kMaxCtrlBody ? n : kMaxCtrlBody; }

 private:
  uint32_t max_body_ = kMaxCtrlBody;
  std::vector<uint8_t> buf_;
  std::string error_;
};

// Body decoders: false when the body does not have exactly the expected shape.
bool decode_hello(const std::vector<uint8_t>& body, std::string& key, uint8_t nonce[kCtrlNonceSize],
                  uint8_t* flags);
bool decode_challenge(const std::vector<uint8_t>& body, uint8_t nonce[kCtrlNonceSize],
                      uint8_t proof[kCtrlProofSize]);
bool decode_proof(const std::vector<uint8_t>& body, uint8_t proof[kCtrlProofSize]);
bool decode_refused(const std::vector<uint8_t>& body, std::string& reason);
bool decode_hello_ok(const std::vector<uint8_t>& body, uint8_t* flags);
bool decode_plugin(const std::vector<uint8_t>& body, std::string& plugin, size_t& payload_off);
bool decode_notify(const std::vector<uint8_t>& body, uint64_t& uid, int32_t& status,
                   uint64_t& instance, NotifySeq& seq);
bool decode_notify_ack(const std::vector<uint8_t>& body, uint64_t& uid, NotifyAck& ack);
// payload_off: where the payload starts in body.
bool decode_msg(const std::vector<uint8_t>& body, uint64_t& instance, uint64_t& id,
                size_t& payload_off);
bool decode_msg_ack(const std::vector<uint8_t>& body, uint64_t& id, MsgAck& ack);
bool decode_fence(const std::vector<uint8_t>& body, uint64_t& req, uint64_t& instance,
                  std::vector<FenceEntry>& entries);
bool decode_fence_reply(const std::vector<uint8_t>& body, uint64_t& req, uint64_t& instance,
                        std::vector<FenceResult>& results);

std::vector<uint8_t> hello_body(const std::string& key, const uint8_t nonce[kCtrlNonceSize],
                                uint8_t flags);
std::vector<uint8_t> challenge_body(const uint8_t nonce[kCtrlNonceSize],
                                    const uint8_t proof[kCtrlProofSize]);
std::vector<uint8_t> proof_body(const uint8_t proof[kCtrlProofSize]);
std::vector<uint8_t> refused_body(const std::string& reason);
std::vector<uint8_t> hello_ok_body(uint8_t flags);
std::vector<uint8_t> plugin_body(const std::string& plugin, const void* payload, size_t n);
std::vector<uint8_t> notify_body(uint64_t uid, int32_t status, uint64_t instance,
                                 const NotifySeq& seq = {});
std::vector<uint8_t> notify_ack_body(uint64_t uid, NotifyAck ack);
std::vector<uint8_t> msg_body(uint64_t instance, uint64_t id, const void* payload, size_t n);
std::vector<uint8_t> msg_ack_body(uint64_t id, MsgAck ack);
std::vector<uint8_t> fence_body(uint64_t req, uint64_t instance,
                                const std::vector<FenceEntry>& entries);
std::vector<uint8_t> fence_reply_body(uint64_t req, uint64_t instance,
                                      const std::vector<FenceResult>& results);

}  // namespace ferry
