# SPDX-License-Identifier: Apache-2.0
"""mori: MORI-IO's Python package, served by ferry.

A drop-in for the ``mori.io`` / ``mori.cpp`` names that vLLM's MoRIIOConnector and
SGLang's mori backend use (docs/connectors.md): ``import mori.io`` and run. The
transfers are ferry's (its plugins, its policy file, its fencing); only the names,
signatures, defaults and return types are MORI-IO's.
"""

__all__ = ["cpp", "io"]


def __getattr__(name):
    # mori loads its submodules lazily; `import mori; mori.io.IOEngine` works as there.
    if name in __all__:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'mori' has no attribute '{name}'")
