"""The notebooks' layout: the README's table and the package reference list every notebook, in the
order `make tour` runs them, each notebook says at its top what a TPU prints differently (and, if
it opens the device, that a TPU VM runs one kernel at a time), and every figure is committed as an
image."""
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))  # the Makefile's $(sort ...)


def table_of_notebooks(path, heading):
    text = (ROOT / path).read_text()
    table = text[text.index(heading):] + "\n\n"
    table = table[:table.index("\n\n", table.index("|---"))]
    return re.findall(r"^\| `(\S+\.ipynb)` \|", table, re.M)


def test_the_readme_and_the_package_reference_list_every_notebook_in_order():
    assert table_of_notebooks("README.md", "## The notebooks") == NOTEBOOKS
    assert table_of_notebooks("llama_xla_helpers/README.md", "## The notebooks, section by section") == NOTEBOOKS


def test_every_notebook_says_what_a_tpu_prints_differently():
    for name in NOTEBOOKS:
        first = "".join(json.loads((ROOT / "notebooks" / name).read_text())["cells"][0]["source"])
        assert "**What a TPU prints differently:**" in first, name


def test_every_notebook_that_opens_the_device_says_one_kernel_at_a_time():
    """On a TPU VM the kernel that starts the runtime holds the chips: each notebook that calls
    init_runtime says so in a box at its top (05b needs no device)."""
    for name in NOTEBOOKS:
        cells = json.loads((ROOT / "notebooks" / name).read_text())["cells"]
        if any("init_runtime(" in "".join(c["source"]) for c in cells if c["cell_type"] == "code"):
            assert "**On a TPU VM, one kernel at a time:**" in "".join(cells[0]["source"]), name


def test_every_committed_figure_is_an_image():
    """A Figure that IPython cannot draw is committed as the text '<Figure size ...>' alone (issue 62's
    audit found three): every display of one must carry its PNG."""
    for name in NOTEBOOKS:
        for cell in json.loads((ROOT / "notebooks" / name).read_text())["cells"]:
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                if "<Figure size" in "".join(data.get("text/plain", [])):
                    assert "image/png" in data, (name, cell.get("id"))
