"""fuseopt's benchmark workloads and runner (used by ``fuseopt bench``,
``bench/`` pytest-benchmark suites and ``bench/gpu_suite.py``)."""
