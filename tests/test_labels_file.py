"""What stands at the label file's path never takes the agent down (issue 20, defect 1).

A real ``python -m agent run`` process on a simulated machine writes its labels where a file
of another encoding, a named pipe, a symbolic link or a directory already stands, at start
and mid-run (re-asserted every 0.2 s). It keeps running, keeps answering signals (SIGHUP is
handled, SIGTERM exits 0) and its labels come back; only a directory is left in place,
named in the log. Each process test failed before the fix: a traceback and exit 1 for the
undecodable file, a main loop blocked for good (SIGTERM ignored) for the pipe.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import stat
import tempfile

import pytest
from agent_run import AgentRun
from killed_write import killed_write
from waiting import eventually

from agent.config import Config
from agent.labels.publishing import LabelPublisher
from agent.labels.sinks import FeatureFileSink
from tests.testbed.kubelet_stub import KubeletStub, pcie4_topology

FILENAME = "gpu-topology-agent"
NOT_UTF8 = b"\xff\xfe\x00garbage \xc3\x28 not utf-8\n" * 64


class Agent(AgentRun):
    """A real agent process (dgx-h100 simulated) against a stand-in kubelet."""

    def __init__(self, base: str, *extra: str) -> None:
        self.kubelet_dir = os.path.join(base, "k")
        self.features = os.path.join(base, "features")
        os.makedirs(self.kubelet_dir, exist_ok=True)
        os.makedirs(self.features, exist_ok=True)
        self.path = os.path.join(self.features, FILENAME)
        self.kubelet = KubeletStub(self.kubelet_dir).start()
        super().__init__(
            ["--simulate", "dgx-h100", "--kubelet-dir", self.kubelet_dir, "--features-dir", self.features,
             "--metrics-address", "127.0.0.1:0", "--pod-resources-socket", os.path.join(self.kubelet_dir, "podres.sock"),
             *extra],
            os.path.join(base, "agent.log"),
        )

    def labelled(self) -> bool:
        """The path holds a regular file of labels (``key=value`` lines)."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(st.st_mode):
            return False
        with open(self.path, "rb") as fh:
            data = fh.read()
        return b"nvidia.com/gpu.count=8\n" in data and NOT_UTF8[:8] not in data

    def close(self) -> None:
        self.kill()
        self.kubelet.stop()


@pytest.fixture
def base():
    path = tempfile.mkdtemp(prefix="lf", dir="/tmp")  # unix socket paths: keep it short
    made: list[Agent] = []

    def start(*extra: str) -> Agent:
        agent = Agent(path, *extra)
        made.append(agent)
        return agent

    yield path, start
    for agent in made:
        agent.close()
    shutil.rmtree(path, ignore_errors=True)


def _put(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(data)


# ---------------------------------------------------------------------- a real process
def test_a_label_file_that_is_not_utf8_at_start_is_written_over_and_removed_on_a_clean_stop(base):
    path, start = base
    _put(os.path.join(path, "features", FILENAME), NOT_UTF8)
    agent = start()
    assert eventually(agent.labelled, 20.0), agent.log()[-2000:]
    assert agent.stop() == 0, agent.log()[-2000:]
    assert "Traceback" not in agent.log()
    assert os.listdir(agent.features) == [], "the file is the agent's now: a clean stop removes it"


def test_at_start_the_temp_files_of_killed_label_writes_are_removed_and_other_files_kept(base):
    path, start = base
    features = os.path.join(path, "features")
    ours = killed_write(f"from agent.labels.sinks import FeatureFileSink; FeatureFileSink({features!r}).write({{'a': 'b'}})",
                        features)  # an agent killed while writing the labels
    theirs = {"gfd", ".gfd.k3j4h5g6.tmp", ".k3j4h5g6.tmp", ".gpu-topology-agent-old.k3j4h5g6.tmp"}
    for name in theirs:
        _put(os.path.join(features, name), b"x=y\n")
    agent = start()
    assert eventually(agent.labelled, 20.0), agent.log()[-2000:]
    assert set(os.listdir(features)) == theirs | {FILENAME}, ours
    assert len(agent.lines(f"{features}: removed 1 temp file(s) of interrupted writes")) == 1, agent.log()[-2000:]


def test_a_label_file_made_not_utf8_mid_run_is_written_over_and_the_agent_keeps_running(base):
    _, start = base
    agent = start("--label-interval-s", "0.2")
    assert eventually(agent.labelled, 20.0), agent.log()[-2000:]
    _put(agent.path, NOT_UTF8)  # in place: the same inode, other bytes
    assert not agent.labelled()
    assert eventually(agent.labelled, 10.0), agent.log()[-2000:]
    assert agent.proc.poll() is None, agent.log()[-2000:]
    assert agent.stop() == 0, agent.log()[-2000:]
    assert "Traceback" not in agent.log()


def test_a_named_pipe_at_the_label_path_at_start_is_replaced_and_sigterm_still_stops_the_agent(base):
    path, start = base
    fifo = os.path.join(path, "features", FILENAME)
    os.makedirs(os.path.dirname(fifo))
    os.mkfifo(fifo)
    agent = start()
    assert eventually(agent.labelled, 20.0), agent.log()[-2000:]
    assert agent.stop() == 0, "SIGTERM ends the agent: " + agent.log()[-2000:]
    said = agent.lines("named pipe")
    assert len(said) == 1 and fifo in said[0], said


def test_a_named_pipe_put_at_the_label_path_mid_run_blocks_nothing(base):
    _, start = base
    agent = start("--label-interval-s", "0.2")
    assert eventually(agent.labelled, 20.0), agent.log()[-2000:]
    os.unlink(agent.path)
    os.mkfifo(agent.path)
    assert eventually(agent.labelled, 10.0), "the re-assertion replaced the pipe: " + agent.log()[-2000:]
    agent.signal(signal.SIGHUP)  # the main loop still takes signals
    assert eventually(lambda: "reloaded; effective configuration" in agent.log(), 10.0), agent.log()[-2000:]
    assert agent.stop() == 0, agent.log()[-2000:]


# ---------------------------------------------------------------------- the sink, in process
def test_a_symbolic_link_at_the_label_path_is_replaced_and_its_target_left_alone(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"someone's file\n")
    features = tmp_path / "features.d"
    features.mkdir()
    (features / FILENAME).symlink_to(target)
    sink = FeatureFileSink(str(features))
    assert sink.write({"a": "1"}) is True
    assert not os.path.islink(features / FILENAME)
    assert (features / FILENAME).read_text() == "a=1\n"
    assert target.read_bytes() == b"someone's file\n", "never written through the link"


def test_a_directory_at_the_label_path_is_left_in_place_named_and_not_ready_until_it_goes(tmp_path, caplog):
    features = tmp_path / "features.d"
    (features / FILENAME / "inside").mkdir(parents=True)
    errors: list[int] = []
    publisher = LabelPublisher(FeatureFileSink(str(features)), count_error=lambda: errors.append(1))
    with caplog.at_level(logging.ERROR, logger="agent.labels"):
        publisher.publish(pcie4_topology(), Config(features_dir=str(features)))
    assert not publisher.ready() and errors == [1]
    (said,) = [r.getMessage() for r in caplog.records]
    assert f"{features / FILENAME} is a directory" in said and "remove it" in said
    assert (features / FILENAME / "inside").is_dir(), "nothing of it removed"
    shutil.rmtree(features / FILENAME)
    publisher.publish(pcie4_topology(), Config(features_dir=str(features)))
    assert publisher.ready() and (features / FILENAME).is_file()
