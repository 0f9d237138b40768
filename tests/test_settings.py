"""Every setting declared once: each service's settings class makes its flags, binds its SPECMESH_*
variables, writes the flags tables of docs/operations.md and the command lines `specmesh up` gives it;
the `specmesh` commands take the same declarations for the same concepts; and each service reads every
setting it declares."""

from __future__ import annotations

import argparse
import ast
import inspect
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specmesh.cli import build_parser
from specmesh.cluster.launcher import ClusterSpec, LocalCluster
from specmesh.cluster.service_settings import (
    SERVICES,
    DrafterClientSettings,
    RouterSettings,
    VerifierSettings,
    with_flags_tables,
)
from specmesh.cluster.settings import Settings, env_name, flag_name

ROOT = Path(__file__).resolve().parents[1]

# Flags of `specmesh` commands named like a service setting but meaning something else, each with why.
NOT_THE_SERVICE_SETTING = {
    "--drafter": "the drafters to run (repeatable), where the drafter service serves exactly one",
    "--tls-ca": "a client's: the CA it trusts, where a service's also checks its callers",
    "--tls-cert": "a client's certificate (`specmesh verifier`), where a service's is also served",
    "--tls-key": "the key of that client certificate",
    "--tls-server-name": "the name a client expects, as the router's for the drafters it calls",
    "--queue-key-file": "a client's: the credential of the control API, where a service also tags its queue entries",
}


@pytest.fixture
def no_specmesh_environment(monkeypatch):
    for key in [k for k in __import__("os").environ if k.startswith("SPECMESH_")]:
        monkeypatch.delenv(key)


def test_the_flags_tables_of_the_docs_are_the_settings():
    """docs/operations.md's tables are written by `make docs`; one edited by hand fails here."""
    text = (ROOT / "docs" / "operations.md").read_text()
    assert with_flags_tables(text) == text, "docs/operations.md's flags tables are out of date: run `make docs`"
    for name, settings in SERVICES.items():
        assert f"<!-- flags:{name} -->\n{settings.flags_table()}<!-- /flags:{name} -->" in text


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_a_services_command_line_is_its_settings(service, no_specmesh_environment):
    settings = SERVICES[service]
    parser = settings.parser(f"specmesh-{service}", "")
    flags = {o for action in parser._actions for o in action.option_strings if o not in ("-h", "--help")}
    expected = {flag_name(f) for f in settings.model_fields}
    expected |= {"--no-" + flag_name(f)[2:] for f, i in settings.model_fields.items() if i.annotation in (bool, bool | None)}
    assert flags == expected  # no flag declared by hand beside the settings
    for action in parser._actions:  # each help says its variable and default
        if action.dest in settings.model_fields:
            assert f"[{env_name(action.dest)}]" in action.help and "(default: " in action.help


def test_a_flag_wins_over_its_variable_which_wins_over_the_default(monkeypatch, no_specmesh_environment):
    assert VerifierSettings.parse([], "v", "").max_sessions == 256
    monkeypatch.setenv("SPECMESH_MAX_SESSIONS", "12")
    assert VerifierSettings.parse([], "v", "").max_sessions == 12
    assert VerifierSettings.parse(["--max-sessions", "7"], "v", "").max_sessions == 7


@pytest.mark.parametrize("variable,value,reason", [
    ("SPECMESH_MAX_SESSIONS", "-1", "--max-sessions (SPECMESH_MAX_SESSIONS): Input should be greater than 0"),
    ("SPECMESH_PRECISION", "int3", "--precision (SPECMESH_PRECISION): Input should be 'shipped', 'fp32' or 'q8_0'"),
    ("SPECMESH_BATCH_INVARIANT", "maybe", "--batch-invariant (SPECMESH_BATCH_INVARIANT): Input should be a valid "
                                          "boolean"),
])
def test_a_bad_variable_stops_the_service_naming_its_flag_and_variable(variable, value, reason):
    """Before anything loads: exit 2, one line."""
    result = subprocess.run([sys.executable, "-m", "specmesh.services.verifier"], capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin", variable: value}, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert reason in result.stderr.strip().splitlines()[-1]


def test_a_renamed_variable_is_refused_with_its_new_name(monkeypatch, capsys, no_specmesh_environment):
    from specmesh.cluster.service_settings import DrafterSettings

    monkeypatch.setenv("SPECMESH_TARGET", "smollm2-135m-instruct")  # what the chart set before `--model`
    with pytest.raises(SystemExit):
        DrafterSettings.parse([], "specmesh-drafter", "")
    assert "SPECMESH_TARGET is now SPECMESH_MODEL (--model)" in capsys.readouterr().err


@pytest.mark.parametrize("service", [RouterSettings, VerifierSettings])
def test_a_local_drafter_a_service_cannot_run_is_refused(no_specmesh_environment, capsys, service):
    with pytest.raises(SystemExit):
        service.parse(["--local-drafters", "ngram,code"], "specmesh-service", "")
    assert "--local-drafters (SPECMESH_LOCAL_DRAFTERS): Value error, code cannot run inside a service" in \
        capsys.readouterr().err


def test_the_launchers_command_lines_are_read_back_as_the_spec_says(tmp_path, no_specmesh_environment):
    """What `specmesh up` starts is parsed by each service's own settings to the spec's values."""
    spec = ClusterSpec(model="smollm2-135m-instruct", drafters=("ngram", "code"), precision="fp32", kv_cache_gb=1.5,
                       batch_invariant=False, speculation="fixed", speculation_margin=0.25, max_tree_nodes=8,
                       job_timeout_s=12.5, log_dir=tmp_path, cores=4, verifiers=2, tls=True,
                       offload=True)
    cluster = LocalCluster(spec)
    cluster.drafters = [cluster.drafter_process("code")]
    processes = {"verifier": cluster.verifier_process(1), "drafter": cluster.drafters[0],
                 "router": cluster.router_process(0)}
    read = {name: SERVICES[name].parse(p.command[3:], name, "") for name, p in processes.items()}
    assert processes["router"].command[2] == "specmesh.services.router"
    verifier, drafter, router = read["verifier"], read["drafter"], read["router"]
    assert (verifier.model, verifier.precision, verifier.kv_cache_gb, verifier.batch_invariant, verifier.threads,
            verifier.verifier_id, verifier.offload) == (spec.model, "fp32", 1.5, False, 2, "verifier-1", True)
    assert (drafter.model, drafter.drafter, drafter.threads) == (spec.model, "code", 1)
    assert (router.speculation, router.speculation_margin, router.max_tree_nodes, router.job_timeout,
            router.local_drafters) == ("fixed", 0.25, 8, 12.5, "ngram")
    assert router.drafter_addresses == [cluster.drafters[0].address]
    for settings in read.values():  # and the cluster's TLS, to each
        assert settings.tls_ca == str(cluster.tls.ca) and settings.listen.startswith("127.0.0.1:")


def test_the_specmesh_commands_declare_no_service_setting_again():
    """A `specmesh` command's flag named like a service setting is that setting's own declaration (same
    help), unless it means something else (NOT_THE_SERVICE_SETTING, each with why)."""
    declared = {flag_name(f): i.description for s in SERVICES.values() for f, i in s.model_fields.items()}
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    checked = 0
    for command, parser in commands.choices.items():
        for action in parser._actions:
            for flag in action.option_strings:
                if flag not in declared or flag in NOT_THE_SERVICE_SETTING:
                    continue
                owners = {s.model_fields[action.dest].description for s in SERVICES.values()
                          if action.dest in s.model_fields}
                assert any((action.help or "").replace("%%", "%").startswith(d) for d in owners), f"specmesh {command} {flag} is declared by hand"
                checked += 1
    assert checked >= 20


def service_sources(service: str) -> list[Path]:
    """Where a service reads its settings: its own package, the command line every service runs
    (``serving.run_service``: --log-level), and for those that call drafters, how they reach them."""
    shared = [ROOT / "specmesh" / "cluster" / "serving.py"]
    if issubclass(SERVICES[service], DrafterClientSettings):
        shared.append(ROOT / "specmesh" / "cluster" / "discovery.py")
    return [*sorted((ROOT / "services" / service).glob("*.py")), *shared]


def settings_read(settings: type[Settings], sources: list[Path]) -> set[str]:
    """The fields of ``settings`` that ``sources`` read: attributes of a settings object (a parameter
    annotated with its class or a base, or what ``.parse`` returned), and through its properties and
    methods, the fields they read of ``self``."""
    classes = {c.__name__ for c in settings.__mro__}
    read = set()
    for source in sources:
        for function in ast.walk(ast.parse(source.read_text())):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            params = [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]
            names = {a.arg for a in params if a.annotation is not None and _named(a.annotation) in classes}
            names |= {t.id for node in ast.walk(function) if isinstance(node, ast.Assign)
                      and isinstance(node.value, ast.Call) and _named(node.value.func) == "parse"
                      for t in node.targets if isinstance(t, ast.Name)}
            read |= _attributes_of(function, names)
    fields, seen = set(), set()
    while read - seen:  # a property or method read: the fields it reads of self
        name = (read - seen).pop()
        seen.add(name)
        member = inspect.getattr_static(settings, name, None)
        member = member.fget if isinstance(member, property) else member
        if name in settings.model_fields:
            fields.add(name)
        elif inspect.isfunction(member):
            read |= _attributes_of(ast.parse(textwrap.dedent(inspect.getsource(member))), {"self"})
    return fields


def _named(node: ast.AST) -> str | None:
    """The name an annotation or callee spells: ``X``, ``m.X`` or ``"X"``."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _attributes_of(tree: ast.AST, names: set[str]) -> set[str]:
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names}


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_setting_a_service_declares_is_read_by_it(service):
    """A flag parsed and never read changes nothing and says it does (the verifier and drafter declared
    --tls-server-name, which only the router uses): each field must be read by the service's code."""
    settings = SERVICES[service]
    unread = set(settings.model_fields) - settings_read(settings, service_sources(service))
    assert not unread, f"specmesh-{service} declares settings it never reads: {', '.join(sorted(unread))}"
