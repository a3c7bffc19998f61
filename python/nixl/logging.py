# SPDX-License-Identifier: Apache-2.0
"""nixl.logging: NIXL's logger helper (the 'nixl' Python logger; ferry's own log is
set with ferry.set_log_level or FERRY_LOG_LEVEL)."""

import logging as _logging


def get_logger(name="nixl"):
    return _logging.getLogger(name)
