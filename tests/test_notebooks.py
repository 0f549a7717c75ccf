"""The notebooks' layout: the README's table and the package reference list every notebook, in the
order `make tour` runs them, each notebook says at its top what a TPU prints differently, and
every figure is committed as an image."""
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


def test_every_committed_figure_is_an_image():
    """A Figure that IPython cannot draw is committed as the text '<Figure size ...>' alone (issue 62's
    audit found three): every display of one must carry its PNG."""
    for name in NOTEBOOKS:
        for cell in json.loads((ROOT / "notebooks" / name).read_text())["cells"]:
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                if "<Figure size" in "".join(data.get("text/plain", [])):
                    assert "image/png" in data, (name, cell.get("id"))
