"""The loopback Ray cluster these tests share (one per session: starting one takes half a minute)."""

from __future__ import annotations

import os
import tempfile

import pytest
from skyrl_sdk_ray.local_cluster import LoopbackCluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """The cluster, its processes and ours writing temporary files under one watched folder."""
    watched = tmp_path_factory.mktemp("tmp-watched")
    old = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(watched)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    c = LoopbackCluster(nodes=2, cpus_per_node=3)
    c.watched = watched
    try:
        yield c
    finally:
        import ray

        ray.shutdown()
        c.stop()
        if old is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = old
        tempfile.tempdir = None
    assert c.pids() == [], "the test cluster's processes outlived it"


