"""llama_xla_helpers: the code behind the llama-xla notebooks.

Import `llama_xla_helpers.runtime` and call `init_runtime()` before anything touches an
XLA device: the runtime reads its device settings once, when it starts.
"""
import os

from .runtime import select_device

# On a machine without TPU chips, choose the CPU before torch_xla is imported (it would
# guess, and warn, on import). On a TPU VM torch_xla's own detection picks the TPU.
select_device()
# XLA's C++ logging (e.g. the GSPMD deprecation line) goes to stderr with a timestamp;
# quiet it before torch_xla is loaded. An explicit setting from the user wins.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
