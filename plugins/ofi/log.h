// SPDX-License-Identifier: Apache-2.0
// Logging through the host (ferry/plugin_kit.hpp: plugin_kit::Log).
#pragma once

#include "ferry/plugin_kit.hpp"

namespace ferry_ofi {

using ferry::plugin_kit::Log;

}  // namespace ferry_ofi
