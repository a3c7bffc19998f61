// SPDX-License-Identifier: Apache-2.0
// AttemptTable (backend_set.h), the attempts a plugin holds by id: random puts
// and takes against a std::map, through growth, deletion chains that wrap
// around the array, and the shrink after a burst; ids the table never held
// (0, garbage, taken already) find nothing.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "backend_set.h"

namespace ferry {
namespace {

// A stand-in attempt: the table only moves the pointer, never reads it (an
// attempt's destructor needs a live engine; this deleter does nothing).
std::shared_ptr<Attempt> fake(uint64_t tag) {
  return std::shared_ptr<Attempt>(reinterpret_cast<Attempt*>(tag << 4), [](Attempt*) {});
}

TEST(AttemptTable, AgreesWithAMapThroughGrowthDeletionAndShrink) {
  AttemptTable t;
  std::map<uint64_t, uint64_t> model;  // id -> tag
  std::mt19937_64 rng(3);
  uint64_t next = 1'700'000'000'000'000'000ULL;  // like first_attempt_id(): ns since the epoch
  std::vector<uint64_t> live;
  for (int step = 0; step < 400000; ++step) {
    // Phases: mostly puts (a burst in flight), then mostly takes (it drains).
    const bool burst = (step / 50000) % 2 == 0;
    const unsigned r = rng() % 100;
    if (r < (burst ? 70u : 30u)) {
      const uint64_t id = next++;
      t.put(id, fake(id));
      model[id] = id;
      live.push_back(id);
    } else if (r < 95 && !live.empty()) {
      const size_t k = rng() % live.size();
      const uint64_t id = live[k];
      live[k] = live.back();
      live.pop_back();
      auto a = t.take(id);
      ASSERT_EQ(a.get(), reinterpret_cast<Attempt*>(model[id] << 4)) << "step " << step;
      model.erase(id);
      ASSERT_EQ(t.take(id), nullptr) << "taken twice, step " << step;
    } else {
      // Never held: zero, an id not issued yet, one far off.
      for (uint64_t id : {uint64_t{0}, next + 1 + rng() % 1000, rng()}) {
        if (!model.count(id)) {
          ASSERT_EQ(t.take(id), nullptr) << id;
        }
      }
    }
    if (step % 10007 == 0) {
      ASSERT_EQ(t.size(), model.size());
    }
  }
  ASSERT_EQ(t.size(), model.size());
  auto all = t.take_all();
  EXPECT_EQ(all.size(), model.size());
  EXPECT_EQ(t.size(), 0u);
  for (const auto& [id, tag] : model) EXPECT_EQ(t.take(id), nullptr);
}

// Ids that share a home slot: the take of the first must leave the others
// findable (the deletion shifts them back over the hole).
TEST(AttemptTable, CollidingIdsStayFindableAfterATake) {
  AttemptTable t;
  // Ids 16 apart land in one shard (shard by id ^ id >> 17, mod 16); with 50
  // of them in a 128-slot array some share homes and runs wrap around.
  std::vector<uint64_t> ids;
  for (uint64_t i = 1; i <= 50; ++i) ids.push_back(i * 16);
  for (uint64_t id : ids) t.put(id, fake(id));
  for (size_t k = 0; k < ids.size(); k += 2) ASSERT_NE(t.take(ids[k]), nullptr);
  for (size_t k = 1; k < ids.size(); k += 2) {
    auto a = t.take(ids[k]);
    ASSERT_EQ(a.get(), reinterpret_cast<Attempt*>(ids[k] << 4)) << ids[k];
  }
  EXPECT_EQ(t.size(), 0u);
}

}  // namespace
}  // namespace ferry
