// SPDX-License-Identifier: Apache-2.0
// Turning a same-host lane's unix socket into a ring lane (channel.h), once its
// HELLO and auth passed on the socket:
//   initiator -> target  "FRRYRING" u32 version u32 options, with six
//                        descriptors (SCM_RIGHTS): the request ring's segment,
//                        data bell and space bell, then the response ring's;
//                        options bit 0: direct copies offered (direct_copy.h),
//                        their probe in the request ring's spare bytes
//   target -> initiator  the same 16 bytes once it attached both, options
//                        bit 0 set when it agreed to direct copies, or an ERROR
//                        frame (req_id 0, wire.h) saying why it refused the lane:
//                        status FERRY_ERR_UNSUPPORTED when it refused the rings
//                        themselves (the lane may use TCP instead), any other
//                        when it refused the initiator
// The initiator creates both rings, so the target maps nothing of its own
// choosing; the target checks what it was handed as it would any peer input
// (shm_ring.h Attach) and bounds the ring size it accepts.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "direct_copy.h"
#include "shm_ring.h"

namespace ferry_tcp {

// Largest ring a target maps for a peer: two per lane, at most
// TargetPeer::kMaxLanesPerPeer lanes per peer.
inline constexpr uint64_t kMaxAcceptedRing = 16ull << 20;

// Initiator side. FERRY_OK with *out (our frames) and *in (the target's), or a
// FERRY_ERR_* code and *err: FERRY_ERR_NO_MEMORY when the rings could not be
// made here, FERRY_ERR_UNSUPPORTED when the target could not take them (in
// both cases the lane may use TCP instead), FERRY_ERR_REMOTE when the target
// refused the initiator, FERRY_ERR_TRANSPORT when the socket failed. With
// offer_direct, *target is the target's process once it agreed to direct
// copies, and *spare the request ring's spare bytes mapped on their own
// (direct::Link); else both are left null.
int OfferRings(int fd, uint64_t capacity, int abort_fd, int timeout_ms, const std::string& label,
               bool offer_direct, shm::Ring* out, shm::Ring* in,
               std::unique_ptr<direct::Process>* target, std::shared_ptr<void>* spare,
               std::string* err);

// Target side: receives and checks the rings and answers. False with *why: the
// lane must be refused (Refuse() sends the ERROR the initiator waits for).
// *initiator: the initiator's process when direct copies were offered,
// allowed and its probe passed; else null and *no_direct says why not.
bool AcceptRings(int fd, std::chrono::steady_clock::time_point deadline, bool allow_direct,
                 shm::Ring* out, shm::Ring* in, std::unique_ptr<direct::Process>* initiator,
                 std::string* why, std::string* no_direct);

}  // namespace ferry_tcp
