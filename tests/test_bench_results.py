"""The one results writer: command lines without the program's path, machine facts, JSON + markdown;
and `kvcodec bench` when the benchmarks are not installed."""

import json
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from kvbench import results

ARG = st.text(st.characters(codec="ascii", exclude_categories=("Cc",)), min_size=1, max_size=12)


@given(prefix=st.lists(ARG, max_size=3), args=st.lists(ARG, max_size=5))
def test_command_line_drops_everything_before_the_benchmark_name(prefix, args):
    if "ratio" in prefix or "ratio" in args:
        return
    line = results.command_line("ratio", ["/some/where/python", *prefix, "ratio", *args][1:])
    assert line.startswith("kvcodec bench ratio")
    assert "/some/where" not in line
    import shlex

    assert shlex.split(line)[3:] == args


def test_command_line_from_click_options_given_when_argv_does_not_name_it():
    @click.command("demo-bench")
    @click.option("--tokens", default=1)
    @click.option("--fast", is_flag=True)
    @click.option("--name", default="x")
    def cmd(tokens, fast, name):
        click.echo(results.command_line("demo-bench", ["pytest", "-q"]))

    out = CliRunner().invoke(cmd, ["--tokens", "7", "--fast"]).output.strip()
    assert out == "kvcodec bench demo-bench --tokens 7 --fast"


def test_write_result_writes_json_and_markdown_with_machine_and_command(tmp_path):
    doc = {"benchmark": "x", "command": "kvcodec bench x --a 1", "records": [1, 2]}
    path = results.write_result(tmp_path / "sub" / "x-cpu.json", doc, ["# x", "", "`kvcodec bench x --a 1`"])
    got = json.loads(path.read_text())
    assert got["records"] == [1, 2] and got["command"] == doc["command"]
    assert {"platform", "python", "cpu", "cpu_count", "torch"} <= set(got["machine"]) and "time" in got
    assert path.with_suffix(".md").read_text() == "# x\n\n`kvcodec bench x --a 1`\n"


def test_the_machine_record_names_the_kvcodec_switches_and_the_host_pool(monkeypatch):
    monkeypatch.setenv("KVCODEC_HOST_THREADS", "5")
    monkeypatch.setenv("KVCODEC_CACHE_DIR", "/somewhere")
    m = results.machine()
    assert m["host_threads"] == 5 and m["kvcodec_env"]["KVCODEC_HOST_THREADS"] == "5"
    assert "KVCODEC_CACHE_DIR" not in m["kvcodec_env"]
    monkeypatch.setenv("KVCODEC_HOST_THREADS", "none")
    assert "KVCODEC_HOST_THREADS" in results.machine()["host_threads"]  # a bad setting is recorded, not raised


def test_write_result_refuses_a_result_without_its_command(tmp_path):
    with pytest.raises(ValueError):
        results.write_result(tmp_path / "x.json", {"records": []}, "# x")


def test_results_dir_is_the_source_trees_benchmarks_results():
    assert results.RESULTS_DIR.parts[-2:] == ("benchmarks", "results")
    assert results.result_path(None, "ratio-cpu") == results.RESULTS_DIR / "ratio-cpu.json"


def test_kvcodec_bench_without_kvbench_says_how_to_install_it(tmp_path):
    # a fresh interpreter in which `import kvbench` fails
    code = (
        "import sys; sys.modules['kvbench'] = None\n"
        "from click.testing import CliRunner\n"
        "from kvcodec.cli.bench import command\n"
        "r = CliRunner().invoke(command, ['ratio', '--tokens', '8'])\n"
        "print(r.exit_code, r.output)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("1 ") and "pip install -e benchmarks" in out
