"""Test ordering for `make test`'s pytest-xdist workers, and benchmark artefacts kept out of the tree."""

from __future__ import annotations

import pytest

#: seconds of the heaviest tests on one worker (measured 2026-12-02 in the evening, make test's 2 workers with the
#: machine shared, load average 1-2.4; the subprocess fits forked from tests/preloaded.py's preloader, whose start,
#: ~6 s once a worker, the first of them pays); any other slow test counts DEFAULT_SLOW, a fast one 0
WEIGHTS = {
    "tests/test_sharded.py::test_fsdp2_update_rollouts_fit_resume_export_and_validate": 90,
    "tests/test_sharded.py::test_validate_launched_as_users_do": 22,
    "tests/test_faults_processes.py::test_an_error_on_one_of_3_processes": 17,
    "tests/test_faults_input.py::test_a_step_that_does_not_split_over_the_processes": 17,
    "tests/test_async.py::test_staleness_0_through_the_producer_is_the_synchronous_run_for_each_estimator": 16,
    "tests/test_faults_processes.py::test_sigterm_to_the_first_of_2_sharded_processes": 16,
    "tests/test_faults.py::test_kill_9_then_ctrl_c_at_random_instants": 12,
    "tests/test_faults_processes.py::test_an_error_on_one_process_ends_every_process": 11,
    "tests/test_tasks_adversarial.py::test_a_thousand_adversarial_completions": 11,
    "tests/test_tasks_lazy.py::test_loading_openthoughts_holds_positions_not_rows": 11,
    "tests/test_faults_processes.py::test_a_refused_folder_ends_every_process": 10,
    "tests/test_async.py::test_behaviour_logprobs_of_a_stale_group_are_its_versions_float64_logprobs[float64": 8,
    # not marked slow, but as long as a slow test: counted so that it starts early too
    "tests/test_metrics_file.py::test_the_report_draws_its_curves_whatever_the_logger[WandbLogger]": 5,
}
DEFAULT_SLOW = 6


def weight(item) -> float:
    """How long ``item`` is expected to run: WEIGHTS by node id prefix (the first that matches), else DEFAULT_SLOW if
    marked slow, else 0."""
    for prefix, seconds in WEIGHTS.items():
        if item.nodeid.startswith(prefix):
            return seconds
    return DEFAULT_SLOW if item.get_closest_marker("slow") is not None else 0


@pytest.hookimpl(trylast=True)  # after -m and -k deselect: the parts are counted on what runs
def pytest_collection_modifyitems(config, items) -> None:
    """Slow tests (2-process runs, subprocess fits: 10-60 s each) start first, longest first, shared out over the
    pytest-xdist workers so that each starts on its own share at once.

    ``--dist worksteal`` hands each of the n workers one contiguous part of the list (n parts as even in count as
    can be) and then lets an idle worker take the tail of another's queue. Before, every slow test led the first
    part: one worker ran them all, in collection order (the longest, test_sharded's and test_vllm_rollout's, came
    last), while the other ran fast tests and then took slow ones one by one off the far end: the suite ended on one
    long test with the other worker idle. Now the slow tests are split over the parts by weight (the longest to the
    lightest part, in turn), each part leads with its share, longest first, and fast tests fill each part up to its
    count, in collection order."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)  # on a pytest-xdist worker: how many there are
    weights = {id(item): weight(item) for item in items}
    slow = sorted((item for item in items if weights[id(item)] > 0), key=lambda i: -weights[id(i)])  # stable
    fast = [item for item in items if weights[id(item)] == 0]
    parts: list[list] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for item in slow:
        lightest = loads.index(min(loads))
        parts[lightest].append(item)
        loads[lightest] += weights[id(item)]
    ordered, left = [], len(items)
    for i, part in enumerate(parts):
        size = left // (workers - i)  # what worksteal's first hand-out gives worker i
        fill = max(0, size - len(part))
        ordered += part + fast[:fill]
        fast = fast[fill:]
        left -= len(part) + fill
    items[:] = ordered + fast


def pytest_sessionfinish(session) -> None:
    """The worker's preloader (tests/preloaded.py) ends with the session."""
    import sys

    if "tests.preloaded" in sys.modules:
        sys.modules["tests.preloaded"].shutdown()


@pytest.fixture(autouse=True)
def _torch_threads_kept():
    """A test that sets torch's intra-op threads (``sgrpo.warmstart.warm_start`` sets 2) leaves them as they were:
    else every later test of that pytest-xdist worker ran on 2 threads beside the other worker, 4 threads on the
    2 cores of ``make test`` (``OMP_NUM_THREADS=1``)."""
    import torch

    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _benchmark_artefacts_to_tmp(tmp_path_factory, monkeypatch):
    """A test that runs a benchmark publishes into a temporary folder, never over the committed
    ``benchmarks/reports/`` (``benchmarks/artefact.py``)."""
    from benchmarks import artefact

    monkeypatch.setattr(artefact, "REPORTS", tmp_path_factory.mktemp("reports"))
