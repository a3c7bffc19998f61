// Logging through the host (plugins/common/host_log.h).
#pragma once

#include "host_log.h"

namespace ferry_tcp {

using ferry_plugin_kit::Log;

}  // namespace ferry_tcp
