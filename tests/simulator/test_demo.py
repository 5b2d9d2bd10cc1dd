"""``cachettl demo`` against a real control plane (gRPC on port 0, SQLite in tmp_path)."""

from pathlib import Path

from controlplane.cli import main


def test_demo_learns_through_the_control_plane(tmp_path: Path, capsys):
    db = f"sqlite:///{tmp_path / 'demo.sqlite3'}"
    code = main(
        ["demo", "--programs", "15", "--rate", "0.1", "--db", db, "--baselines", "vllm,continuum"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "gRPC calls to the control plane" in out
    assert "over 15 programs" in out  # every program end reached it (``to_program_end``)
    assert "bash" in out
    for row in ("isolated", "vllm", "continuum", "cachettl (control plane)"):
        assert row in out
    assert (tmp_path / "demo.sqlite3").exists()


def test_demo_rejects_bad_rate(capsys):
    assert main(["demo", "--rate", "0"]) == 2
    assert "--rate must be a positive number" in capsys.readouterr().err
