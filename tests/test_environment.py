"""The pins in environment.yml (TPU VM, conda) and pyproject.toml (make test) must agree."""
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def pins(requirements):
    """{package: version} from 'name[extra]==version' strings; extras and case ignored."""
    out = {}
    for r in requirements:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]+\])?==(\S+)", r.strip())
        if m:
            out[m.group(1).lower().replace("-", "_")] = m.group(3)
    return out


def test_environment_yml_and_pyproject_pin_the_same_versions():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + [r for extra in project["optional-dependencies"].values() for r in extra]
    conda = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in conda["dependencies"] if isinstance(d, dict))
    assert pins(pip_section) == pins(declared)
    assert pins(declared)["torch"] == pins(declared)["torch_xla"] == "2.9.0"
    assert any(r.startswith("torch_xla[tpu]") for r in pip_section)  # TPU VMs need libtpu


def test_the_tpu_extra_brings_jax_for_the_pallas_kernels():
    """flash attention (the TPU's training default) and the ragged kernel (serving) import JAX: the
    versions of torch_xla 2.9's own 'pallas' extra, the same as the scan extra's."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    tpu, scan = pins(extras["tpu"]), pins(extras["scan"])
    assert tpu["jax"] == tpu["jaxlib"] == scan["jax"] == scan["jaxlib"] == "0.7.1"
