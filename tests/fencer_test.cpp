// SPDX-License-Identifier: Apache-2.0
// The initiator's fence gate around a deregistration: a FENCE already out when
// the target is deregistered still reaches it and retires the lanes it finds, so
// transfers to the same life registered again wait until that request is back.
// The control plane is replaced by a stand-in the test answers by hand.
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <thread>

#include "fence.h"
#include "ferry/plugin.h"

using namespace ferry;
using namespace std::chrono_literals;

namespace {

// A FENCE request that blocks until the test answers it (or says it failed).
class HeldRequests {
 public:
  Fencer::Ask ask() {
    return [this](const Fencer::Target&, const std::vector<uint8_t>& body,
                  Fencer::Clock::time_point, CtrlFrame* reply, std::string* err) {
      uint64_t req = 0, inst = 0;
      std::vector<FenceEntry> entries;
      std::unique_lock lk(mu_);
      if (!decode_fence(body, req, inst, entries)) return FERRY_ERR_INVALID_ARGS;
      ++asked_;
      cv_.notify_all();
      cv_.wait(lk, [&] { return answer_.has_value() || released_; });
      const bool ok = released_ || *answer_;
      answer_.reset();
      if (!ok) {
        *err = "no answer (test)";
        return FERRY_ERR_TIMEOUT;
      }
      std::vector<FenceResult> results;
      for (const auto& e : entries) results.push_back({e.attempt, FenceState::NONE, 0});
      reply->type = CtrlType::FENCE_REPLY;
      reply->body = fence_reply_body(req, inst, results);
      return FERRY_OK;
    };
  }
  // Waits until `n` requests have been made in all.
  void wait_asked(int n) {
    std::unique_lock lk(mu_);
    ASSERT_TRUE(cv_.wait_for(lk, 10s, [&] { return asked_ >= n; })) << "no FENCE request went out";
  }
  void answer(bool ok) {
    std::lock_guard lk(mu_);
    answer_ = ok;
    cv_.notify_all();
  }
  // Every request from now on is answered at once (a failed assertion must not
  // leave the Fencer's destructor joining a worker that waits here).
  void release_all() {
    std::lock_guard lk(mu_);
    released_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int asked_ = 0;
  std::optional<bool> answer_;
  bool released_ = false;
};

// Declared after the Fencer: runs before its destructor.
struct ReleaseOnExit {
  HeldRequests& net;
  ~ReleaseOnExit() { net.release_all(); }
};

// What a held transfer was told, once.
struct Outcome {
  std::mutex mu;
  std::condition_variable cv;
  int calls = 0;
  bool go = false;
  std::string why;
  Fencer::Resume resume() {
    return [this](bool g, const std::string& w) {
      std::lock_guard lk(mu);
      ++calls;
      go = g;
      why = w;
      cv.notify_all();
    };
  }
  bool wait(std::chrono::seconds d = 10s) {
    std::unique_lock lk(mu);
    return cv.wait_for(lk, d, [&] { return calls > 0; });
  }
  int count() {
    std::lock_guard lk(mu);
    return calls;
  }
};

const Fencer::Target kTarget{"target", "127.0.0.1", 1, 7};

// An attempt is fenced, and its target deregistered while the request is out;
// `done` hears what the reset told the attempt.
void DeregisterWithAFenceOut(
    Fencer& f, HeldRequests& net,
    Fencer::Done done = [](const FenceResult&, const std::string&) {}) {
  f.fence(kTarget, "tcp", 1, Fencer::Clock::now() + 30s, std::move(done));
  net.wait_asked(1);
  f.reset(kTarget.key);
}

}  // namespace

TEST(Fencer, RegisteredAgainWaitsForTheFenceStillOut) {
  HeldRequests net;
  Fencer f(net.ask());
  ReleaseOnExit release{net};
  Outcome attempt_told;
  DeregisterWithAFenceOut(
      f, net, [&](const FenceResult&, const std::string&) { attempt_told.resume()(false, {}); });
  ASSERT_TRUE(attempt_told.wait()) << "the reset did not answer the pending attempt";

  // The same life registered again: its transfers wait for that request.
  Outcome held;
  std::string why;
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, held.resume(), &why), Fencer::Gate::HELD);
  // Another life of the engine is another process: no lane of it is fenced.
  Outcome other;
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance + 1, other.resume(), &why), Fencer::Gate::OPEN);
  EXPECT_EQ(held.count(), 0);

  net.answer(true);
  ASSERT_TRUE(held.wait()) << "the held transfer never resumed";
  EXPECT_TRUE(held.go) << held.why;
  Outcome later;
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, later.resume(), &why), Fencer::Gate::OPEN);
  EXPECT_EQ(held.count(), 1);
}

TEST(Fencer, AFenceThatFailsStillReleasesTheTransfersItHeld) {
  HeldRequests net;
  Fencer f(net.ask());
  ReleaseOnExit release{net};
  DeregisterWithAFenceOut(f, net);
  Outcome held;
  std::string why;
  ASSERT_EQ(f.admit(kTarget.key, kTarget.instance, held.resume(), &why), Fencer::Gate::HELD);
  net.answer(false);  // the request is over either way: nothing of it is left to act
  ASSERT_TRUE(held.wait());
  EXPECT_TRUE(held.go);
}

TEST(Fencer, NoFenceOutMeansNothingWaits) {
  HeldRequests net;
  Fencer f(net.ask());
  ReleaseOnExit release{net};
  Outcome first;
  f.fence(kTarget, "tcp", 1, Fencer::Clock::now() + 30s,
          [&](const FenceResult& r, const std::string&) {
            first.resume()(r.state == FenceState::NONE, {});
          });
  net.wait_asked(1);
  net.answer(true);
  ASSERT_TRUE(first.wait());
  EXPECT_TRUE(first.go) << "the target's answer did not reach the attempt";
  f.reset(kTarget.key);  // nothing out any more
  std::string why;
  Outcome later;
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, later.resume(), &why), Fencer::Gate::OPEN);
}

TEST(Fencer, ShuttingDownFailsTransfersHeldBehindAFenceStillOut) {
  HeldRequests net;
  auto f = std::make_unique<Fencer>(net.ask());
  ReleaseOnExit release{net};
  DeregisterWithAFenceOut(*f, net);
  Outcome held;
  std::string why;
  ASSERT_EQ(f->admit(kTarget.key, kTarget.instance, held.resume(), &why), Fencer::Gate::HELD);
  // The destructor fails what is held, then joins the worker, which the request
  // still blocks: answer it once the held transfer has been told.
  std::thread closer([&] { f.reset(); });
  EXPECT_TRUE(held.wait());
  EXPECT_FALSE(held.go);
  EXPECT_NE(held.why.find("shutting down"), std::string::npos) << held.why;
  net.answer(true);
  closer.join();
  EXPECT_EQ(held.count(), 1);
}

// A fence that could not be asked (the peer was deregistered: the control
// plane proves only registered peers) ends its attempt "unknown" at the
// deadline and closes the gate. Registering the same life again asks once
// more at once: transfers wait for that answer instead of failing; if it does
// not come, the gate closes again.
TEST(Fencer, RegisteredAgainAsksAnUnansweredFenceAtOnceAndHoldsTransfersForIt) {
  HeldRequests net;
  Fencer f(net.ask());
  ReleaseOnExit release{net};
  Outcome attempt_told;
  f.fence(kTarget, "tcp", 1, Fencer::Clock::now() - 1ms,
          [&](const FenceResult& r, const std::string&) {
            attempt_told.resume()(r.state == FenceState::UNKNOWN, {});
          });
  net.wait_asked(1);
  net.answer(false);
  ASSERT_TRUE(attempt_told.wait());
  EXPECT_TRUE(attempt_told.go) << "the attempt was not told 'unknown'";
  std::string why;
  Outcome refused;
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, refused.resume(), &why), Fencer::Gate::CLOSED);

  // Registered again; the request it asks goes unanswered too.
  f.retry_now(kTarget.key, kTarget.instance);
  Outcome first;
  ASSERT_EQ(f.admit(kTarget.key, kTarget.instance, first.resume(), &why), Fencer::Gate::HELD);
  net.wait_asked(2);
  net.answer(false);
  ASSERT_TRUE(first.wait());
  EXPECT_FALSE(first.go);
  EXPECT_NE(first.why.find("still unanswered"), std::string::npos) << first.why;
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, refused.resume(), &why), Fencer::Gate::CLOSED);

  // Again, and this time the target answers: the held transfer goes.
  f.retry_now(kTarget.key, kTarget.instance);
  Outcome second;
  ASSERT_EQ(f.admit(kTarget.key, kTarget.instance, second.resume(), &why), Fencer::Gate::HELD);
  net.wait_asked(3);
  net.answer(true);
  ASSERT_TRUE(second.wait());
  EXPECT_TRUE(second.go) << second.why;
  Outcome later;
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, later.resume(), &why), Fencer::Gate::OPEN);
  // Another life: retry_now of it changes nothing here.
  f.retry_now(kTarget.key, kTarget.instance + 1);
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, later.resume(), &why), Fencer::Gate::OPEN);
  EXPECT_EQ(refused.count(), 0);
}

// A WRITE that failed after its target was deregistered: its transfer ends
// "unknown" at once (fence_later) and the fence is parked - not asked, no
// thread, not counted as a fenced peer - with the gate closed for that life.
// The same life registered again is asked at once: transfers wait for that
// answer, then go.
TEST(Fencer, AFenceLaterIsParkedUntilTheSameLifeIsRegisteredAgain) {
  HeldRequests net;
  Fencer f(net.ask());
  ReleaseOnExit release{net};
  f.fence_later(kTarget, "tcp", 1, "deregistered with a WRITE in flight (test)");
  std::string why;
  Outcome refused;
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, refused.resume(), &why), Fencer::Gate::CLOSED);
  EXPECT_NE(why.find("deregistered with a WRITE in flight"), std::string::npos) << why;
  EXPECT_EQ(f.counts().unknown, 1u);
  EXPECT_EQ(f.counts().gated, 0u);
  EXPECT_EQ(f.counts().fences, 0u) << "a parked fence was asked";

  f.retry_now(kTarget.key, kTarget.instance);
  Outcome held;
  ASSERT_EQ(f.admit(kTarget.key, kTarget.instance, held.resume(), &why), Fencer::Gate::HELD);
  net.wait_asked(1);
  net.answer(true);
  ASSERT_TRUE(held.wait());
  EXPECT_TRUE(held.go) << held.why;
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, held.resume(), &why), Fencer::Gate::OPEN);
  EXPECT_EQ(refused.count(), 0);
}

// Deregistered (reset with park) while an attempt's fence is out: the attempt
// is told "unknown" at once and stays pending; when that request fails the
// state is parked; registered again, it is asked at once and transfers wait.
TEST(Fencer, ADeregistrationParksAttemptsOfUnknownOutcome) {
  HeldRequests net;
  Fencer f(net.ask());
  ReleaseOnExit release{net};
  Outcome attempt_told;
  f.fence(kTarget, "tcp", 1, Fencer::Clock::now() + 30s,
          [&](const FenceResult& r, const std::string& w) {
            attempt_told.resume()(r.state == FenceState::UNKNOWN, w);
          });
  net.wait_asked(1);
  f.reset(kTarget.key, "its lease expired (test)", /*park=*/true);
  ASSERT_TRUE(attempt_told.wait());
  EXPECT_TRUE(attempt_told.go);
  EXPECT_NE(attempt_told.why.find("lease expired"), std::string::npos) << attempt_told.why;
  net.answer(false);  // the request that was out fails (not registered any more)
  std::string why;
  Outcome refused;
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, refused.resume(), &why), Fencer::Gate::CLOSED);
  // Another life is another process: it does not wait.
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance + 1, refused.resume(), &why), Fencer::Gate::OPEN);

  f.retry_now(kTarget.key, kTarget.instance);
  Outcome held;
  ASSERT_EQ(f.admit(kTarget.key, kTarget.instance, held.resume(), &why), Fencer::Gate::HELD);
  net.wait_asked(2);
  net.answer(true);
  ASSERT_TRUE(held.wait());
  EXPECT_TRUE(held.go) << held.why;
  EXPECT_EQ(attempt_told.count(), 1) << "the attempt was told twice";
  EXPECT_EQ(refused.count(), 0);
}

// Parked states are bounded: past kMaxParked the oldest is forgotten (a
// registration of that life then starts at once).
TEST(Fencer, ParkedStatesAreBounded) {
  HeldRequests net;
  Fencer f(net.ask());
  ReleaseOnExit release{net};
  for (size_t i = 0; i <= Fencer::kMaxParked; ++i)
    f.fence_later({"peer-" + std::to_string(i), "127.0.0.1", 1, 7}, "tcp", i + 1, "gone (test)");
  std::string why;
  Outcome o;
  EXPECT_EQ(f.admit("peer-0", 7, o.resume(), &why), Fencer::Gate::OPEN);
  EXPECT_EQ(f.admit("peer-1", 7, o.resume(), &why), Fencer::Gate::CLOSED);
  EXPECT_EQ(f.admit("peer-" + std::to_string(Fencer::kMaxParked), 7, o.resume(), &why),
            Fencer::Gate::CLOSED);
}

// A repeated registration of a live peer (only_parked, as for repeated
// handshakes) does not reopen a gate its unanswered fence closed.
TEST(Fencer, ARepeatedRegistrationDoesNotReopenAnUnansweredFence) {
  HeldRequests net;
  Fencer f(net.ask());
  ReleaseOnExit release{net};
  std::string why;
  Outcome o;
  const Fencer::Target other{"other", "127.0.0.1", 2, 9};
  Outcome told;
  f.fence(other, "tcp", 5, Fencer::Clock::now() - 1ms,
          [&](const FenceResult&, const std::string& w) { told.resume()(false, w); });
  net.wait_asked(1);
  net.answer(false);
  ASSERT_TRUE(told.wait());
  EXPECT_EQ(f.admit(other.key, other.instance, o.resume(), &why), Fencer::Gate::CLOSED);
  f.retry_now(other.key, other.instance, /*only_parked=*/true);
  EXPECT_EQ(f.admit(other.key, other.instance, o.resume(), &why), Fencer::Gate::CLOSED);
  EXPECT_EQ(o.count(), 0);
}

// A WRITE to an older life of the peer fails after a newer life was
// registered (it replaced the old one): that attempt is fenced too (the new
// life answers for the old one's port). It must leave the registered life's
// own fence alone: that life's attempt is still answered, and the transfers
// held for it go once it is - nothing the two lives wait for is dropped.
TEST(Fencer, AFenceForAnOlderLifeLeavesTheRegisteredLifesFenceAlone) {
  HeldRequests net;
  Fencer f(net.ask());
  ReleaseOnExit release{net};
  const Fencer::Target old_life{kTarget.key, kTarget.host, kTarget.port, kTarget.instance};
  const Fencer::Target new_life{kTarget.key, kTarget.host, kTarget.port, kTarget.instance + 1};
  Outcome new_attempt;
  f.fence(new_life, "tcp", 1, Fencer::Clock::now() + 30s,
          [&](const FenceResult& r, const std::string& w) {
            new_attempt.resume()(r.state == FenceState::NONE, w);
          });
  net.wait_asked(1);
  std::string why;
  Outcome held;
  ASSERT_EQ(f.admit(new_life.key, new_life.instance, held.resume(), &why), Fencer::Gate::HELD);

  Outcome old_attempt;
  f.fence(old_life, "tcp", 2, Fencer::Clock::now() + 30s,
          [&](const FenceResult& r, const std::string& w) {
            old_attempt.resume()(r.state == FenceState::NONE, w);
          });
  net.wait_asked(2);  // each life's fence is asked on its own
  // The old life's fence holds nothing of the new life's, and the reverse.
  Outcome other;
  EXPECT_EQ(f.admit(new_life.key, new_life.instance, other.resume(), &why), Fencer::Gate::HELD);
  EXPECT_EQ(held.count(), 0) << "a transfer went before its own life's fence was answered";
  EXPECT_EQ(f.counts().gated, 1u) << "two lives of one peer count as one fenced peer";

  net.release_all();
  ASSERT_TRUE(new_attempt.wait()) << "the registered life's attempt was never told its outcome";
  EXPECT_TRUE(new_attempt.go) << new_attempt.why;
  ASSERT_TRUE(old_attempt.wait()) << "the older life's attempt was never told its outcome";
  EXPECT_TRUE(old_attempt.go) << old_attempt.why;
  ASSERT_TRUE(held.wait()) << "a transfer held for the registered life's fence never resumed";
  EXPECT_TRUE(held.go) << held.why;
  ASSERT_TRUE(other.wait());
  EXPECT_TRUE(other.go) << other.why;
  EXPECT_EQ(f.counts().answered, 2u);
  EXPECT_EQ(f.admit(new_life.key, new_life.instance, other.resume(), &why), Fencer::Gate::OPEN);
}

// close() for an older life (a watchdog-ended attempt to it) does not close the
// registered life's gate, and a reset of the key drops every life's state.
TEST(Fencer, ClosingAnOlderLifeDoesNotCloseTheRegisteredOne) {
  HeldRequests net;
  Fencer f(net.ask());
  ReleaseOnExit release{net};
  const Fencer::Target old_life{kTarget.key, kTarget.host, kTarget.port, kTarget.instance};
  const Fencer::Target new_life{kTarget.key, kTarget.host, kTarget.port, kTarget.instance + 1};
  const uint64_t new_close = f.close(new_life, "new life closed (test)");
  f.close(old_life, "old life closed (test)");
  std::string why;
  Outcome o;
  ASSERT_EQ(f.admit(new_life.key, new_life.instance, o.resume(), &why), Fencer::Gate::CLOSED);
  EXPECT_EQ(why, "new life closed (test)");
  f.reopen(new_life.key, new_life.instance, new_close);
  EXPECT_EQ(f.admit(new_life.key, new_life.instance, o.resume(), &why), Fencer::Gate::OPEN);
  ASSERT_EQ(f.admit(old_life.key, old_life.instance, o.resume(), &why), Fencer::Gate::CLOSED);
  EXPECT_EQ(why, "old life closed (test)");
  f.reset(kTarget.key);
  EXPECT_EQ(f.admit(old_life.key, old_life.instance, o.resume(), &why), Fencer::Gate::OPEN);
  EXPECT_EQ(o.count(), 0);
}

// Two attempts the watchdog ended close one gate: the first one's late report
// does not open it while the second may still move bytes.
TEST(Fencer, EveryWatchdogCloseNeedsItsOwnReopen) {
  HeldRequests net;
  Fencer f(net.ask());
  ReleaseOnExit release{net};
  const uint64_t first = f.close(kTarget, "first attempt has not ended (test)");
  const uint64_t second = f.close(kTarget, "second attempt has not ended (test)");
  std::string why;
  Outcome o;
  f.reopen(kTarget.key, kTarget.instance, first);
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, o.resume(), &why), Fencer::Gate::CLOSED)
      << "opened while the second attempt may still move bytes";
  f.reopen(kTarget.key, kTarget.instance, first);  // the same report twice changes nothing
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, o.resume(), &why), Fencer::Gate::CLOSED);
  f.reopen(kTarget.key, kTarget.instance, second);
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, o.resume(), &why), Fencer::Gate::OPEN) << why;
  EXPECT_EQ(o.count(), 0);
}

// A watchdog close dropped by a reset (deregistered, nothing pending: the
// same life registered again starts afresh) is not matched by a later close's
// reopen: the late report of the first attempt does not open the gate the
// second one closed.
TEST(Fencer, ALateReportOfAnAttemptBeforeAResetDoesNotReopenALaterClose) {
  HeldRequests net;
  Fencer f(net.ask());
  ReleaseOnExit release{net};
  const uint64_t before = f.close(kTarget, "an attempt has not ended (test)");
  f.reset(kTarget.key, "deregistered (test)", /*park=*/true);
  const uint64_t after = f.close(kTarget, "another attempt has not ended (test)");
  std::string why;
  Outcome o;
  f.reopen(kTarget.key, kTarget.instance, before);
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, o.resume(), &why), Fencer::Gate::CLOSED)
      << "the first attempt's report opened the gate the second one closed";
  f.reopen(kTarget.key, kTarget.instance, after);
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, o.resume(), &why), Fencer::Gate::OPEN) << why;
  EXPECT_EQ(o.count(), 0);
}

// A fence the target answered "cannot tell" closes the gate until a new
// instance; the late report of an unrelated watchdog-ended attempt must not
// open it.
TEST(Fencer, AWatchdogReopenDoesNotUndoAnUnknownAnswer) {
  Fencer f([](const Fencer::Target&, const std::vector<uint8_t>& body, Fencer::Clock::time_point,
              CtrlFrame* reply, std::string*) {
    uint64_t req = 0, inst = 0;
    std::vector<FenceEntry> entries;
    if (!decode_fence(body, req, inst, entries)) return FERRY_ERR_INVALID_ARGS;
    std::vector<FenceResult> results;
    for (const auto& e : entries) results.push_back({e.attempt, FenceState::UNKNOWN, 0});
    reply->type = CtrlType::FENCE_REPLY;
    reply->body = fence_reply_body(req, inst, results);
    return FERRY_OK;
  });
  const uint64_t token = f.close(kTarget, "an attempt has not ended (test)");
  Outcome told;
  f.fence(kTarget, "tcp", 1, Fencer::Clock::now() + 30s,
          [&](const FenceResult& r, const std::string& w) {
            told.resume()(r.state == FenceState::UNKNOWN, w);
          });
  ASSERT_TRUE(told.wait());
  EXPECT_TRUE(told.go) << told.why;
  f.reopen(kTarget.key, kTarget.instance, token);
  std::string why;
  Outcome o;
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, o.resume(), &why), Fencer::Gate::CLOSED)
      << "a late report reopened a gate whose fence the target could not answer";
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance + 1, o.resume(), &why), Fencer::Gate::OPEN);
  EXPECT_EQ(o.count(), 0);
}

// A parked fence (deregistered with a WRITE of unknown outcome) and a
// watchdog-ended attempt on the same life: registered again, the fence waits
// for the late report (the gate stays closed), and is asked as soon as it
// comes - not left closed with nobody asking.
TEST(Fencer, AParkedFenceBehindAWatchdogCloseIsAskedOnTheLateReport) {
  HeldRequests net;
  Fencer f(net.ask());
  ReleaseOnExit release{net};
  f.fence_later(kTarget, "tcp", 1, "deregistered with a WRITE in flight (test)");
  const uint64_t token = f.close(kTarget, "an attempt has not ended (test)");
  f.retry_now(kTarget.key, kTarget.instance);  // registered again
  std::string why;
  Outcome o;
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, o.resume(), &why), Fencer::Gate::CLOSED);
  EXPECT_EQ(f.counts().fences, 0u) << "asked before the watchdog's attempt ended";
  f.reopen(kTarget.key, kTarget.instance, token);  // the late report
  Outcome held;
  ASSERT_EQ(f.admit(kTarget.key, kTarget.instance, held.resume(), &why), Fencer::Gate::HELD) << why;
  net.wait_asked(1);
  net.answer(true);
  ASSERT_TRUE(held.wait()) << "the fence was never asked after the late report";
  EXPECT_TRUE(held.go) << held.why;
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, o.resume(), &why), Fencer::Gate::OPEN) << why;
  EXPECT_EQ(o.count(), 0);
}

// A fence of a life that is not registered any more (a new instance replaced
// it while its WRITE was out), unanswered past its deadline: parked, not asked
// on forever (the control plane proves only the registered life, so a live
// old process elsewhere could never answer) and not counted as a fenced peer;
// registered again, that life is asked at once.
TEST(Fencer, AnUnansweredFenceOfALifeNoLongerRegisteredIsParked) {
  HeldRequests net;
  Fencer f(net.ask());
  ReleaseOnExit release{net};
  std::atomic<bool> registered{false};
  f.set_registered([&](const std::string&, uint64_t) { return registered.load(); });
  Outcome told;
  f.fence(kTarget, "tcp", 1, Fencer::Clock::now() - 1ms,
          [&](const FenceResult& r, const std::string& w) {
            told.resume()(r.state == FenceState::UNKNOWN, w);
          });
  net.wait_asked(1);
  net.answer(false);
  ASSERT_TRUE(told.wait());
  EXPECT_TRUE(told.go) << told.why;
  EXPECT_EQ(f.counts().gated, 0u) << "a life no longer registered still counts as fenced";
  std::string why;
  Outcome o;
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, o.resume(), &why), Fencer::Gate::CLOSED);

  registered = true;
  f.retry_now(kTarget.key, kTarget.instance);
  Outcome held;
  ASSERT_EQ(f.admit(kTarget.key, kTarget.instance, held.resume(), &why), Fencer::Gate::HELD) << why;
  net.wait_asked(2);
  net.answer(true);
  ASSERT_TRUE(held.wait());
  EXPECT_TRUE(held.go) << held.why;
  EXPECT_EQ(o.count(), 0);
}

// An attempt fenced while a request for another, due later, is out (the target
// is stopped and lets that request run to its deadline) is told "unknown" by
// its own deadline, and closes the gate then - not when that request comes back.
TEST(Fencer, AnAttemptFencedBehindALaterOnesRequestIsToldByItsOwnDeadline) {
  HeldRequests net;
  Fencer f(net.ask());
  ReleaseOnExit release{net};
  Outcome late, early;
  struct Told {
    FenceState state = FenceState::NONE;
    Fencer::Clock::time_point at;
  } early_told;
  f.fence(kTarget, "tcp", 1, Fencer::Clock::now() + 60s,
          [&](const FenceResult& r, const std::string&) {
            late.resume()(r.state == FenceState::NONE, {});
          });
  net.wait_asked(1);  // out, by attempt 1's deadline a minute away
  // A transfer that starts now waits for that request.
  Outcome held;
  std::string why;
  ASSERT_EQ(f.admit(kTarget.key, kTarget.instance, held.resume(), &why), Fencer::Gate::HELD);
  const auto due = Fencer::Clock::now() + 300ms;
  f.fence(kTarget, "tcp", 2, due, [&](const FenceResult& r, const std::string& w) {
    early_told.state = r.state;
    early_told.at = Fencer::Clock::now();
    early.resume()(false, w);
  });
  ASSERT_TRUE(early.wait(20s)) << "attempt 2 waited for attempt 1's request";
  EXPECT_EQ(early_told.state, FenceState::UNKNOWN) << early.why;
  EXPECT_GE(early_told.at, due);
  EXPECT_EQ(late.count(), 0) << "attempt 1's request is still out";
  // The gate closed with it: the held transfer fails, a new one fails at once.
  ASSERT_TRUE(held.wait());
  EXPECT_FALSE(held.go);
  EXPECT_NE(held.why.find("fenced"), std::string::npos) << held.why;
  Outcome next;
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, next.resume(), &why), Fencer::Gate::CLOSED);
  EXPECT_EQ(f.counts().unknown, 1u);
  // The request comes back answered: attempt 1 hears it; attempt 2, told
  // already, is asked next and not told twice.
  net.answer(true);
  ASSERT_TRUE(late.wait());
  EXPECT_TRUE(late.go);
  net.wait_asked(2);
  net.answer(true);
  Outcome after;
  for (int i = 0; i < 1000; ++i) {  // bounded: until the second answer is in
    if (f.admit(kTarget.key, kTarget.instance, after.resume(), &why) == Fencer::Gate::OPEN) break;
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_EQ(f.admit(kTarget.key, kTarget.instance, after.resume(), &why), Fencer::Gate::OPEN)
      << why;
  EXPECT_EQ(early.count(), 1);
}
