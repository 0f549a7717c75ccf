"""Repo-wide pytest hooks (tests/ and nbval over notebooks/)."""


def pytest_collectstart(collector):
    # XLA and Transformers write warnings (with timestamps) to stderr once per process;
    # nbval compares stdout and results, not stderr.
    if collector.fspath and collector.fspath.ext == ".ipynb":
        collector.skip_compare += ("stderr",)
