// SPDX-License-Identifier: Apache-2.0
// The control plane's frame reader under hostile input.
#include "control_frame.h"

#include <gtest/gtest.h>

#include <random>

using namespace ferry;

TEST(ControlFrame, RoundTripAcrossArbitrarySplits) {
  const uint8_t nonce[kCtrlNonceSize] = {9, 8, 7};
  auto a = encode_ctrl_frame(CtrlType::HELLO, hello_body("engine-a", nonce, kHelloHasToken));
  auto b = encode_ctrl_frame(CtrlType::NOTIFY, notify_body(77, 0, 0xfeed, {0xabc, 12, 9}));
  auto c = encode_ctrl_frame(CtrlType::PLUGIN, plugin_body("tcp", "xyz", 3));
  std::vector<uint8_t> all;
  for (auto* f : {&a, &b, &c}) all.insert(all.end(), f->begin(), f->end());
  for (size_t step = 1; step <= all.size(); ++step) {
    CtrlFrameReader r;
    std::vector<CtrlFrame> out;
    for (size_t i = 0; i < all.size(); i += step)
      ASSERT_TRUE(r.feed(all.data() + i, std::min(step, all.size() - i), out));
    ASSERT_EQ(out.size(), 3u);
    std::string key;
    uint8_t got[kCtrlNonceSize], flags = 0;
    EXPECT_TRUE(decode_hello(out[0].body, key, got, &flags));
    EXPECT_EQ(key, "engine-a");
    EXPECT_EQ(flags, kHelloHasToken);
    EXPECT_EQ(std::vector<uint8_t>(got, got + 3), std::vector<uint8_t>({9, 8, 7}));
    uint64_t uid, instance;
    int32_t st;
    NotifySeq seq;
    EXPECT_TRUE(decode_notify(out[1].body, uid, st, instance, seq));
    EXPECT_EQ(uid, 77u);
    EXPECT_EQ(instance, 0xfeedu);
    EXPECT_EQ(seq.life, 0xabcu);
    EXPECT_EQ(seq.seq, 12u);
    EXPECT_EQ(seq.floor, 9u);
    std::string plugin;
    size_t off;
    EXPECT_TRUE(decode_plugin(out[2].body, plugin, off));
    EXPECT_EQ(plugin, "tcp");
    EXPECT_EQ(out[2].body.size() - off, 3u);
  }
}

TEST(ControlFrame, MalformedHeadersAreErrors) {
  auto good = encode_ctrl_frame(CtrlType::NOTIFY, notify_body(1, 0, 1));
  struct Mut {
    size_t at;
    uint8_t val;
    const char* expect;
  } muts[] = {{0, 0x00, "magic"}, {4, 9, "version"},  {5, 0, "type"},
              {5, 200, "type"},   {6, 1, "reserved"}, {11, 0xff, "exceeds"}};
  for (const auto& m : muts) {
    auto f = good;
    f[m.at] = m.val;
    CtrlFrameReader r;
    std::vector<CtrlFrame> out;
    EXPECT_FALSE(r.feed(f.data(), f.size(), out));
    EXPECT_NE(r.error().find(m.expect), std::string::npos) << r.error();
    EXPECT_FALSE(r.feed(good.data(), good.size(), out)) << "a failed reader stays failed";
  }
}

TEST(ControlFrame, BodyDecodersRejectWrongShapes) {
  std::string key;
  uint8_t nonce[kCtrlNonceSize] = {};
  uint8_t flags = 0;
  auto hello = [&](std::vector<uint8_t> b) { return decode_hello(b, key, nonce, &flags); };
  std::vector<uint8_t> good = hello_body("a", nonce, 0);
  EXPECT_TRUE(hello(good));
  EXPECT_FALSE(hello({}));
  EXPECT_FALSE(hello({5, 'a'}));  // length beyond the body
  EXPECT_FALSE(hello({1, 'a'}));  // no nonce: a version-1 HELLO
  std::vector<uint8_t> b = good;
  b[1] = 0;
  b.erase(b.begin() + 1);
  b[0] = 0;
  EXPECT_FALSE(hello(b));  // empty key
  b = good;
  b.push_back(0);
  EXPECT_FALSE(hello(b));  // trailing bytes
  b = good;
  b.back() = 0x80;
  EXPECT_FALSE(hello(b));  // unknown flag
  uint8_t ok_flags = 7;
  EXPECT_TRUE(decode_hello_ok({}, &ok_flags));
  EXPECT_EQ(ok_flags, 0);
  EXPECT_TRUE(decode_hello_ok({kHelloOkSendDesc}, &ok_flags));
  EXPECT_EQ(ok_flags, kHelloOkSendDesc);
  EXPECT_FALSE(decode_hello_ok({2}, &ok_flags));     // unknown flag
  EXPECT_FALSE(decode_hello_ok({0}, &ok_flags));     // no flags is the empty body (fuzz_ctrl_frame)
  EXPECT_FALSE(decode_hello_ok({1, 0}, &ok_flags));  // trailing bytes
  uint64_t uid, instance;
  int32_t st;
  NotifySeq seq;
  EXPECT_FALSE(decode_notify({1, 2, 3}, uid, st, instance, seq));
  // The version-2 body (uid, status): no instance.
  EXPECT_FALSE(decode_notify({1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}, uid, st, instance, seq));
  // The version-3 body (uid, status, instance): no sequence.
  std::vector<uint8_t> v3 = notify_body(1, 0, 2);
  v3.resize(kNotifySeqAt);
  EXPECT_FALSE(decode_notify(v3, uid, st, instance, seq));
  NotifyAck ack;
  EXPECT_TRUE(decode_notify_ack(notify_ack_body(9, NotifyAck::OTHER_LIFE), uid, ack));
  EXPECT_EQ(uid, 9u);
  EXPECT_EQ(ack, NotifyAck::OTHER_LIFE);
  EXPECT_FALSE(decode_notify_ack({9, 0, 0, 0, 0, 0, 0, 0, 2}, uid, ack));  // unknown answer
  EXPECT_FALSE(decode_notify_ack({9, 0, 0, 0, 0, 0, 0, 0}, uid, ack));     // no answer
  std::string plugin;
  size_t off;
  EXPECT_FALSE(decode_plugin({}, plugin, off));
}

TEST(ControlFrame, RandomStreamsNeverCrash) {
  std::mt19937 rng(3);
  for (int i = 0; i < 2000; ++i) {
    std::vector<uint8_t> junk(rng() % 512);
    for (auto& c : junk) c = static_cast<uint8_t>(rng());
    if (i % 2) {  // make some start like a real frame
      auto f = encode_ctrl_frame(CtrlType::PLUGIN, plugin_body("tcp", junk.data(), junk.size()));
      junk.insert(junk.begin(), f.begin(), f.begin() + 12);
    }
    CtrlFrameReader r;
    std::vector<CtrlFrame> out;
    r.feed(junk.data(), junk.size(), out);
    for (auto& fr : out) {
      std::string s;
      size_t off;
      uint64_t u, inst;
      int32_t st;
      NotifyAck ack;
      NotifySeq seq;
      uint8_t nonce[kCtrlNonceSize], flags;
      decode_hello(fr.body, s, nonce, &flags);
      decode_plugin(fr.body, s, off);
      decode_notify(fr.body, u, st, inst, seq);
      decode_notify_ack(fr.body, u, ack);
    }
  }
}
