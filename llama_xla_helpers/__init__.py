"""llama_xla_helpers: the code behind the llama-xla notebooks.

Import `llama_xla_helpers.runtime` and call `init_runtime()` before anything touches an
XLA device: the runtime reads its device settings once, when it starts.
"""
import os

from .runtime import default_pjrt_device

# Choose the device before torch_xla is imported (it would guess, and warn, on import).
os.environ.setdefault("PJRT_DEVICE", default_pjrt_device())
# XLA's C++ logging (e.g. the GSPMD deprecation line) goes to stderr with a timestamp;
# quiet it before torch_xla is loaded. An explicit setting from the user wins.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
