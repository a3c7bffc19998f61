/* SPDX-License-Identifier: Apache-2.0 */
#pragma once
#include <string>
namespace ferry {
// Same string on the same host: FERRY_NODE_ID, then the kernel boot id, then hostname.
std::string default_node_id();
}  // namespace ferry
