"""Whole-or-nothing file writes (kvcodec.atomic): outputs get a plain open()'s permissions."""

from __future__ import annotations

import os

import pytest
import torch

from kvcodec.atomic import replacing, write_atomic
from kvcodec.kvspec.files import save_kv_file


def _mode(path) -> int:
    return os.stat(path).st_mode & 0o777


def test_written_files_get_the_mode_a_plain_open_gives(tmp_path):
    (tmp_path / "plain").write_bytes(b"x")
    write_atomic(tmp_path / "atomic", b"x")
    save_kv_file(tmp_path / "kv.safetensors", torch.zeros(2, 2, 3, 1, 4, dtype=torch.float16), {})
    expected = _mode(tmp_path / "plain")
    assert _mode(tmp_path / "atomic") == expected and _mode(tmp_path / "kv.safetensors") == expected


def test_a_failed_write_keeps_the_old_file_and_leaves_no_part(tmp_path):
    target = tmp_path / "out.kvt"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk gone"), replacing(target) as tmp:
        with open(tmp, "wb") as f:
            f.write(b"half")
        raise RuntimeError("disk gone")
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["out.kvt"]
    write_atomic(target, b"new")
    assert target.read_bytes() == b"new" and sorted(p.name for p in tmp_path.iterdir()) == ["out.kvt"]


def test_a_kv_file_beyond_the_file_size_limit_is_an_os_error_naming_it_and_leaves_nothing(tmp_path):
    """A real write failure (the process's file size limit, in a child so the limit ends with it):
    safetensors reports it as its own error; save_kv_file makes it the OSError the CLI prints as
    one line, and the old file stays."""
    import subprocess
    import sys

    target = tmp_path / "kv.safetensors"
    target.write_bytes(b"old")
    code = (
        "import resource, sys, torch\n"
        "from kvcodec.kvspec.files import save_kv_file\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "try:\n"
        "    save_kv_file(sys.argv[1], torch.zeros(4, 2, 512, 2, 64, dtype=torch.float16), {})\n"
        "except OSError as e:\n"
        "    print('OSError', e)\n"
    )
    run = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("OSError cannot write") and str(target) in run.stdout
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["kv.safetensors"]
