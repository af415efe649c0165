"""The committed generated code is exactly what keel.proto generates."""

from protos.generate import ROOT, generate


def test_generated_code_matches_the_proto(tmp_path):
    generate(tmp_path)
    for name in ("keel_pb2.py", "keel_pb2.pyi", "keel_pb2_grpc.py"):
        fresh = (tmp_path / "protos" / name).read_text()
        committed = (ROOT / "protos" / name).read_text()
        assert fresh == committed, (
            f"protos/{name} is stale: run `python -m protos.generate` and commit the result"
        )
