"""keel run's command line: torchrun's flags and what job they make; and the prefixing
of several ranks' output on one terminal."""

from __future__ import annotations

import io

import pytest
from click.testing import CliRunner

from orchestrator.cli.logs import RankOutput
from orchestrator.cli.run import RunOptions, default_job_name, parse_nnodes, run
from orchestrator.spec.jobspec import InvalidSpec
from protos import keel_pb2


@pytest.mark.parametrize("value, expected", [("1", (1, 1)), ("4", (4, 4)), ("2:4", (2, 4))])
def test_nnodes_is_n_or_min_max(value, expected):
    assert parse_nnodes(value) == expected


@pytest.mark.parametrize("value", ["0", "3:2", "two", "1:x", ""])
def test_a_bad_nnodes_says_what_to_write(value):
    with pytest.raises(ValueError, match="--nnodes"):
        parse_nnodes(value)


def test_the_default_job_name_follows_the_job_name_rule():
    name = default_job_name("/data/My_Train.Script.py")
    assert name.startswith("run-my-train-script-") and len(name) == len("run-my-train-script-") + 6
    assert default_job_name("___.py").startswith("run-job-")


def test_a_script_a_module_and_a_program_each_become_the_ranks_command(tmp_path):
    base = dict(job="j", python="/py", working_dir=str(tmp_path))
    assert list(RunOptions(target="t.py", args=("--x", "1"), **base).spec().command) == [
        "/py",
        "-u",
        "t.py",
        "--x",
        "1",
    ]
    assert list(RunOptions(target="pkg.mod", module=True, **base).spec().command) == [
        "/py",
        "-u",
        "-m",
        "pkg.mod",
    ]
    assert list(RunOptions(target="./bin", args=("a",), no_python=True, **base).spec().command) == [
        "./bin",
        "a",
    ]


def test_nnodes_and_nproc_per_node_make_the_world_size_and_the_ranks_per_node(tmp_path):
    spec = RunOptions(
        target="t.py", job="j", max_nodes=3, nproc_per_node=4, working_dir=str(tmp_path)
    ).spec()
    assert (spec.world_size, spec.ranks_per_node, spec.min_nodes) == (12, 4, 0)
    assert spec.working_dir == str(tmp_path) and spec.mesh == "dp_shard=12"
    # MIN:MAX may shrink down to MIN nodes after losing some; N never does.
    assert RunOptions(target="t.py", job="j", min_nodes=2, max_nodes=4).spec().min_nodes == 2
    assert not spec.cold_start
    assert RunOptions(target="t.py", job="j", cold_start=True).spec().cold_start


def test_run_options_refuse_what_cannot_run():
    with pytest.raises(ValueError, match="exclude each other"):
        RunOptions(target="x", module=True, no_python=True)
    with pytest.raises(ValueError, match="--nproc-per-node"):
        RunOptions(target="x", nproc_per_node=0)
    with pytest.raises(InvalidSpec, match="name 'Bad_Name'"):
        RunOptions(target="x", job="Bad_Name").spec()
    with pytest.raises(InvalidSpec, match="env 'RANK': set by Keel"):
        RunOptions(target="x", job="j", env={"RANK": "3"}).spec()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--node-rank", "1", "t.py"], "run it once, without them"),
        (["--rdzv_endpoint", "h:1", "t.py"], "run it once, without them"),
        (["--standalone", "--etcd-endpoints", "h:1", "t.py"], "--standalone runs a local cluster"),
        (["--detach", "t.py"], "--detach, --token-file and the TLS options are for a cluster"),
        (["-m", "--no-python", "t"], "exclude each other"),
        (["--nnodes", "2:1", "t.py"], "need 1 <= MIN <= MAX"),
        (["--env", "NOVALUE", "-m", "t"], "--env 'NOVALUE': write NAME=VALUE"),
        (["missing-script.py"], "missing-script.py: no such script"),
    ],
)
def test_bad_invocations_are_refused_before_anything_starts(args, message, monkeypatch):
    monkeypatch.delenv("KEEL_ETCD_ENDPOINTS", raising=False)
    monkeypatch.delenv("KEEL_CONTROLLER", raising=False)
    result = CliRunner().invoke(run, args)
    assert result.exit_code == 2, result.output
    assert message in result.output


def test_torchruns_underscored_flags_are_accepted_too(tmp_path, monkeypatch):
    monkeypatch.delenv("KEEL_ETCD_ENDPOINTS", raising=False)
    # Parsing succeeds up to the script check, which names the script.
    result = CliRunner().invoke(
        run,
        ["--nproc_per_node", "2", "--max_restarts", "1", "--no_python", "--rdzv_id", "Bad", "x"],
    )
    assert result.exit_code == 2 and "name 'Bad'" in result.output


class _Reads:
    """ReadLog replies in turn, as the controller would give them."""

    def __init__(self, *chunks):
        self.chunks = list(chunks)

    def __call__(self, method, request):
        out, err = self.chunks.pop(0) if self.chunks else (b"", b"")
        return keel_pb2.ReadLogReply(
            out=out,
            err=err,
            out_offset=request.out_offset + len(out),
            err_offset=request.err_offset + len(err),
            running=True,
        )


def test_several_ranks_output_is_prefixed_per_line_and_held_until_the_line_ends(monkeypatch):
    output = RankOutput(
        _Reads((b"epoch 0\nepo", b""), (b"ch 1\n", b"[rank2]:boom\nlast")), "j", prefix=True
    )
    out, err = io.BytesIO(), io.BytesIO()
    output.sinks = {"out": out, "err": err}
    output.pull(1, 2)
    assert out.getvalue() == b"[rank2]:epoch 0\n[rank2]:epoch 1\n"
    # torch's own "[rank2]:" is not doubled; an unfinished line is written at the end.
    assert err.getvalue() == b"[rank2]:boom\n"
    output.finish(1, 2)
    assert err.getvalue() == b"[rank2]:boom\n[rank2]:last\n"
    assert output.cursors[(1, 2)].out == len(b"epoch 0\nepoch 1\n")


def test_one_ranks_output_is_copied_as_it_is():
    output = RankOutput(_Reads((b"no newline", b"")), "j", prefix=False)
    out = io.BytesIO()
    output.sinks = {"out": out, "err": io.BytesIO()}
    output.pull(1, 0)
    assert out.getvalue() == b"no newline"
