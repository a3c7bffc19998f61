# SPDX-License-Identifier: Apache-2.0
"""nixl: NVIDIA NIXL's Python API, served by ferry.

A drop-in for what vLLM's NixlConnector and SGLang's nixl backend import
(``from nixl._api import nixl_agent, nixl_agent_config``, ``nixl._bindings``):
the transfers are ferry's (its plugins, policy and fencing), the names,
signatures and semantics NIXL's. docs/connectors.md has the table.
"""

from ._api import (  # noqa: F401
    DEFAULT_COMM_PORT,
    nixl_agent,
    nixl_agent_config,
    nixl_backend_handle,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)

__all__ = [
    "DEFAULT_COMM_PORT",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
]
