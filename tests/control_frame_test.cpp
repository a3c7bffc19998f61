// The control plane's frame reader under hostile input.
#include <gtest/gtest.h>

#include <random>

#include "control_frame.h"

using namespace ferry;

TEST(ControlFrame, RoundTripAcrossArbitrarySplits) {
  auto a = encode_ctrl_frame(CtrlType::HELLO, hello_body("engine-a"));
  auto b = encode_ctrl_frame(CtrlType::NOTIFY, notify_body(77, 0));
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
    EXPECT_TRUE(decode_hello(out[0].body, key));
    EXPECT_EQ(key, "engine-a");
    uint64_t uid;
    int32_t st;
    EXPECT_TRUE(decode_notify(out[1].body, uid, st));
    EXPECT_EQ(uid, 77u);
    std::string plugin;
    size_t off;
    EXPECT_TRUE(decode_plugin(out[2].body, plugin, off));
    EXPECT_EQ(plugin, "tcp");
    EXPECT_EQ(out[2].body.size() - off, 3u);
  }
}

TEST(ControlFrame, MalformedHeadersAreErrors) {
  auto good = encode_ctrl_frame(CtrlType::NOTIFY, notify_body(1, 0));
  struct Mut {
    size_t at;
    uint8_t val;
    const char* expect;
  } muts[] = {{0, 0x00, "magic"}, {4, 9, "version"}, {5, 0, "type"}, {5, 200, "type"},
              {6, 1, "reserved"}, {11, 0xff, "exceeds"}};
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
  EXPECT_FALSE(decode_hello({}, key));
  EXPECT_FALSE(decode_hello({5, 'a'}, key));      // length beyond the body
  EXPECT_FALSE(decode_hello({0}, key));           // empty key
  EXPECT_FALSE(decode_hello({1, 'a', 'b'}, key));  // trailing bytes
  uint64_t uid;
  int32_t st;
  EXPECT_FALSE(decode_notify({1, 2, 3}, uid, st));
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
      uint64_t u;
      int32_t st;
      decode_hello(fr.body, s);
      decode_plugin(fr.body, s, off);
      decode_notify(fr.body, u, st);
    }
  }
}
