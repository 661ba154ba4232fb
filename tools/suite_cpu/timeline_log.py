"""A pytest plugin that logs when each test ran, on which xdist worker, and its process CPU seconds, plus the
session's milestones (configure, collection finished, session finish), one JSON line each to $TIMELINE_LOG:
where the wall of a two-worker run goes (start-up, each worker's busy time, idle gaps, the tail).

    TIMELINE_LOG=/tmp/timeline.jsonl PYTHONPATH=$PWD/tools/suite_cpu .venv/bin/python -m pytest -q -n 2 -p timeline_log
"""

import json
import os
import time

import pytest

PATH = os.environ.get("TIMELINE_LOG")


def _write(line: dict) -> None:
    if PATH:
        with open(PATH, "a") as f:
            f.write(json.dumps({"w": os.environ.get("PYTEST_XDIST_WORKER", "main"), **line}) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start, cpu = time.time(), time.process_time()
    yield
    _write({"id": item.nodeid, "start": start, "end": time.time(), "cpu": time.process_time() - cpu})


def pytest_configure(config):
    _write({"mark": "configure", "t": time.time()})


def pytest_collection_finish(session):
    _write({"mark": "collected", "t": time.time()})


def pytest_sessionfinish(session, exitstatus):
    _write({"mark": "sessionfinish", "t": time.time()})
