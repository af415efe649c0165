import pytest

from orchestrator.spec.specfile import SpecFileError, load, parse
from protos import keel_pb2

GOOD_TOML = """\
name = "llama-7b"
world_size = 4
command = ["python", "-m", "trainer.train"]
max_restarts = 3
steps = 1000
checkpoint_dir = "/ck/llama"
mesh = "dp_shard=2,tp=2"

[env]
NCCL_DEBUG = "WARN"

[health]
straggler_policy = "alert"
hang_floor_s = 45

[training]
seq_len = 2048
"""

GOOD_YAML = """\
name: llama-7b
world_size: 4
command: [python, -m, trainer.train]
max_restarts: 3
steps: 1000
checkpoint_dir: /ck/llama
mesh: dp_shard=2,tp=2
env:
  NCCL_DEBUG: WARN
health:
  straggler_policy: alert
  hang_floor_s: 45
training:
  seq_len: 2048
"""

GOOD = {
    "name": "llama-7b",
    "world_size": 4,
    "command": ["python", "-m", "trainer.train"],
    "checkpoint_dir": "/ck/llama",
    "mesh": "dp_shard=2,tp=2",
}


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def error(data, source="job.toml"):
    with pytest.raises(SpecFileError) as exc:
        parse(data, source)
    return str(exc.value)


@pytest.mark.parametrize(
    "name,text", [("job.toml", GOOD_TOML), ("job.yaml", GOOD_YAML), ("job.yml", GOOD_YAML)]
)
def test_a_good_spec_loads_the_same_from_toml_and_yaml(tmp_path, name, text):
    spec = load(write(tmp_path, name, text))
    assert spec.name == "llama-7b"
    assert spec.world_size == 4
    assert list(spec.command) == ["python", "-m", "trainer.train"]
    assert spec.max_restarts == 3
    assert spec.steps == 1000
    assert spec.checkpoint_dir == "/ck/llama"
    assert spec.mesh == "dp_shard=2,tp=2"
    assert dict(spec.env) == {"NCCL_DEBUG": "WARN"}
    assert spec.health.straggler_policy == keel_pb2.STRAGGLER_POLICY_ALERT
    assert spec.health.hang_floor_s == 45.0
    assert spec.training.seq_len == 2048


def test_enum_fields_are_written_as_operators_spell_them():
    spec = parse({**GOOD, "training": {"precision": "fp32"}}, "job.toml")
    assert spec.training.precision == keel_pb2.PRECISION_FP32
    assert not spec.HasField("health")  # unset: the default policy, replace


def test_a_spec_resumes_from_another_lineage_and_says_what_no_checkpoint_means():
    spec = parse({**GOOD, "resume_from": "/ck/old", "on_no_checkpoint": "fresh_start"}, "job.toml")
    assert spec.resume_from == "/ck/old"
    assert spec.on_no_checkpoint == keel_pb2.ON_NO_CHECKPOINT_FRESH_START
    assert parse(GOOD, "job.toml").on_no_checkpoint == keel_pb2.ON_NO_CHECKPOINT_UNSPECIFIED
    assert "resume_from 'old': must be an absolute path" in error({**GOOD, "resume_from": "old"})
    inside = error({**GOOD, "resume_from": "/ck/llama/step_00000010"})
    assert "lies in the job's own checkpoint_dir" in inside
    assert "on_no_checkpoint" in error({**GOOD, "on_no_checkpoint": "restart"})


def test_toml_and_yaml_give_equal_specs(tmp_path):
    assert load(write(tmp_path, "a.toml", GOOD_TOML)) == load(write(tmp_path, "a.yaml", GOOD_YAML))


@pytest.mark.parametrize(
    "extra,expected",
    [
        (
            {"trainng": {"seq_len": 1}},
            "job.toml: trainng: unknown field 'trainng'; did you mean 'training'?",
        ),
        (
            {"health": {"hang_flor_s": 60}},
            "job.toml: health.hang_flor_s: "
            "unknown field 'hang_flor_s'; did you mean 'hang_floor_s'?",
        ),
        ({"zzz": 1}, "job.toml: zzz: unknown field 'zzz'; valid fields: name, world_size, command"),
        ({"max_restarts": "3"}, 'job.toml: max_restarts: expected an integer, got a string "3"'),
        ({"world_size": 2.5}, "job.toml: world_size: expected an integer, got a number 2.5"),
        ({"steps": 4.0}, "job.toml: steps: expected an integer, got a number 4.0"),
        (
            {"max_restarts": -1},
            "job.toml: max_restarts: must be at least 0 (the field is unsigned), got -1",
        ),
        ({"world_size": 2**32}, "job.toml: world_size: must be at most 4294967295"),
        ({"max_restarts": True}, "job.toml: max_restarts: expected an integer, got a boolean true"),
        (
            {"health": {"hang_floor_s": True}},
            "job.toml: health.hang_floor_s: expected a number, got a boolean true",
        ),
        (
            {"health": {"hang_floor_s": "30"}},
            'job.toml: health.hang_floor_s: expected a number, got a string "30"',
        ),
        (
            {"health": {"preflight_off": 1}},
            "job.toml: health.preflight_off: expected true or false, got an integer 1",
        ),
        ({"name": 7}, 'job.toml: name: expected a string, got an integer 7; quote it: "7"'),
        (
            {"command": "python -m trainer.train"},
            'job.toml: command: expected a list, got a string "python -m trainer.train"; '
            'write it as a list, e.g. ["python", "-m", "trainer.train"]',
        ),
        (
            {"command": ["python", "-m", 3]},
            "job.toml: command[2]: expected a string, got an integer 3; quote it",
        ),
        (
            {"env": {"FOO": 1}},
            'job.toml: env.FOO: expected a string, got an integer 1; quote it: "1"',
        ),
        ({"env": ["FOO=1"]}, "job.toml: env: expected a mapping, got a list"),
        (
            {"health": "alert"},
            "job.toml: health: expected a mapping of its fields (straggler_policy, hang_floor_s",
        ),
        ({"training": None}, "job.toml: training: expected a mapping of its fields"),
        (
            {"health": {"hang_k": float("nan")}},
            "job.toml: health.hang_k: expected a finite number, got a number NaN",
        ),
        (
            {"model": {"params": float("inf")}},
            "job.toml: model.params: expected a finite number, got a number Infinity",
        ),
        ({"model": {"params": 10**400}}, "job.toml: model.params: expected a finite number"),
        (
            {"health": {"straggler_policy": "panic"}},
            "job.toml: health.straggler_policy: expected one of replace, exclude, alert, "
            'got a string "panic"',
        ),
        (
            {"health": {"straggler_policy": "STRAGGLER_POLICY_ALERT"}},
            "job.toml: health.straggler_policy: expected one of replace, exclude, alert",
        ),
        (
            {"training": {"precision": "fp16"}},
            'job.toml: training.precision: expected one of bf16, fp32, got a string "fp16"',
        ),
        (
            {"training": {"precision": 2}},
            "job.toml: training.precision: expected one of bf16, fp32, got an integer 2",
        ),
    ],
)
def test_structural_problems_name_file_field_and_fix(extra, expected):
    assert expected in error({**GOOD, **extra})


def test_every_problem_is_reported_at_once_one_per_line():
    message = error(
        {**GOOD, "trainng": {}, "world_size": -4, "env": {"A": 1}, "health": {"hang_floor_s": "x"}}
    )
    lines = message.splitlines()
    assert len(lines) == 4
    assert all(line.startswith("job.toml: ") for line in lines)
    assert {line.split(": ")[1] for line in lines} == {
        "trainng",
        "world_size",
        "env.A",
        "health.hang_floor_s",
    }


def test_semantic_problems_from_validate_are_each_a_line():
    message = error({**GOOD, "world_size": 3, "env": {"RANK": "0"}, "name": "Bad_Name"})
    lines = message.splitlines()
    assert len(lines) == 3
    assert all(line.startswith("job.toml: ") for line in lines)
    assert any(line.startswith("job.toml: name 'Bad_Name': use 1-63 lowercase") for line in lines)
    # "; remove it" stays on its problem's line.
    assert "job.toml: env 'RANK': set by Keel for every rank; remove it" in lines
    assert any(
        "mesh: layout dp_shard=2,tp=2 spans 4 ranks but world_size is 3; "
        "make the axes multiply" in line
        for line in lines
    )


def test_health_problems_from_validate_carry_the_file(tmp_path):
    path = write(tmp_path, "job.yaml", GOOD_YAML.replace("hang_floor_s: 45", "hang_floor_s: 0.5"))
    with pytest.raises(
        SpecFileError,
        match=r"job\.yaml: health: hang_floor_s=0\.5: must be "
        r"at least 1 s",
    ):
        load(path)


def test_toml_syntax_error_gives_file_and_line(tmp_path):
    path = write(
        tmp_path, "job.toml", 'name = "a"\nworld_size = 4\ncommand = ["python",\nmesh = \n'
    )
    with pytest.raises(SpecFileError) as exc:
        load(path)
    message = str(exc.value)
    assert message.startswith(f"{path}: TOML syntax error: ")
    assert "line 4" in message


def test_yaml_syntax_error_gives_file_line_and_column(tmp_path):
    path = write(tmp_path, "job.yaml", "name: a\nworld_size: 4\ncommand: [python\nmesh: x\n")
    with pytest.raises(SpecFileError) as exc:
        load(path)
    message = str(exc.value)
    assert message.startswith(f"{path}: YAML syntax error at line 4, column 5: ")
    assert "expected ',' or ']'" in message


def test_top_level_must_be_a_mapping(tmp_path):
    path = write(tmp_path, "job.yaml", "- name: a\n- world_size: 4\n")
    with pytest.raises(
        SpecFileError,
        match=r"job\.yaml: the top level must be a mapping of "
        r"JobSpec fields .*, got a list",
    ):
        load(path)


def test_an_empty_yaml_file_is_not_a_spec(tmp_path):
    with pytest.raises(SpecFileError, match="top level must be a mapping.*got null"):
        load(write(tmp_path, "job.yml", ""))


def test_unsupported_suffix_lists_the_accepted_ones(tmp_path):
    path = write(tmp_path, "job.json", "{}")
    with pytest.raises(SpecFileError) as exc:
        load(path)
    assert str(exc.value) == (
        f"{path}: unsupported file type '.json'; write the spec as .toml, .yaml, .yml"
    )


def test_missing_file(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(SpecFileError) as exc:
        load(str(path))
    assert str(exc.value) == f"{path}: no such file"


def test_a_file_that_is_not_utf8_text_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "job.toml"
    path.write_bytes(b'name = "\xff"\n')
    with pytest.raises(SpecFileError, match=r"job\.toml: not UTF-8 text; save the spec as UTF-8"):
        load(path)
