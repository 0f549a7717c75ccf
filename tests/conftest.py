import tempfile

import pytest
from llama_xla_helpers.runtime import init_runtime

# One runtime per test process: 8 virtual CPU devices (or the TPU), compiled HLO dumped
# to a temporary folder so tests can read the collectives.
RUNTIME = init_runtime(8, hlo_dump_dir=tempfile.mkdtemp(prefix="llama-xla-hlo-"))


@pytest.fixture(scope="session")
def runtime():
    return RUNTIME

