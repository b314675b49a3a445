"""%%fsdp / %fsdp as IPython sees them: registration, help, and bad input refused at once."""

from __future__ import annotations

import threading

import pytest
from IPython.core.error import UsageError

import nbfsdp
from tests.conftest import run_failing

pytestmark = pytest.mark.timeout(60)


def test_cell_and_line_magics_are_registered_with_full_help(shell):
    cell_help = shell.find_cell_magic("fsdp").__doc__
    for flag in ("--world-size", "--timeout", "--no-gather"):
        assert flag in cell_help
    assert "rank" in cell_help and "world_size" in cell_help  # what the cell gets
    line_help = shell.find_line_magic("fsdp").__doc__
    assert "status" in line_help and "stop" in line_help


def test_loading_twice_keeps_the_same_session(shell):
    magics = nbfsdp._magics
    shell.run_line_magic("load_ext", "nbfsdp")
    shell.extension_manager.load_extension("nbfsdp")
    assert nbfsdp._magics is magics
    assert shell.find_cell_magic("fsdp").__self__ is magics


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--world-size 0", "--world-size must be between 1 and 64, got 0"),
        ("--world-size -3", "--world-size must be between 1 and 64, got -3"),
        ("--world-size 65", "--world-size must be between 1 and 64, got 65"),
        ("--world-size two", "invalid int value: 'two'"),
        ("--timeout 0", "--timeout must be a positive number of seconds, got 0"),
        ("--timeout soon", "invalid float value: 'soon'"),
        ("--shard-everything", "unrecognized arguments: --shard-everything"),
        (
            "--sharding-strategy ZERO3",
            "invalid choice: 'ZERO3' (choose from 'FULL_SHARD', 'SHARD_GRAD_OP', 'NO_SHARD', 'HYBRID_SHARD')",
        ),
        ("--mixed-precision HALF", "invalid choice: 'HALF' (choose from 'FULL', 'DEFAULT', 'PURE', 'STORED')"),
        ("--backward-prefetch LATE", "invalid choice: 'LATE' (choose from 'BACKWARD_PRE', 'BACKWARD_POST', 'NONE')"),
        ("--precision fp8", "invalid choice: 'fp8' (choose from 'bf16', 'fp16')"),
        ("--min-params lots", "min_params must be a non-negative whole number; got 'lots'"),
        ("--sharding-strategy HYBRID_SHARD", "HYBRID_SHARD needs --replicas R dividing the world size 2; got None"),
        (
            "--sharding-strategy HYBRID_SHARD --replicas 3",
            "HYBRID_SHARD needs --replicas R dividing the world size 2; got 3",
        ),
        ("--config no_such_dict", "--config no_such_dict: no such name in the notebook"),
    ],
)
def test_bad_flags_are_a_usage_error_before_anything_runs(shell, flags, message):
    runs_before = len(nbfsdp.runs())
    error, elapsed = run_failing(shell, f"%%fsdp {flags}\nprint('never runs')\n")
    assert isinstance(error, UsageError)
    assert message in str(error)
    assert elapsed < 1
    assert len(nbfsdp.runs()) == runs_before


def test_bad_line_action_names_the_valid_ones(shell):
    valid = (
        r"\(choose from 'status', 'stop', 'explain', 'compare', 'panel', 'set', 'wait', 'cancel', 'check', "
        r"'where', 'interrupt', 'timeline', 'trace', 'save', 'load', 'checkpoints', 'export', 'export-script', "
        r"'debug', 'attach', 'detach'\)"
    )
    with pytest.raises(UsageError, match=rf"invalid choice: 'restart' {valid}"):
        shell.run_line_magic("fsdp", "restart")


def test_syntax_error_is_reported_before_anything_is_sent(shell):
    runs_before = len(nbfsdp.runs())
    error, elapsed = run_failing(shell, "%%fsdp --world-size 2\nfor x in range(3)\n    pass\n")
    assert isinstance(error, SyntaxError)
    assert elapsed < 1
    assert len(nbfsdp.runs()) == runs_before


def test_an_unpicklable_input_names_the_variable_and_why(shell):
    shell.user_ns["guard"] = threading.Lock()
    runs_before = len(nbfsdp.runs())
    error, elapsed = run_failing(shell, "%%fsdp --world-size 2\nwith guard:\n    pass\n")
    assert isinstance(error, UsageError)
    assert "cannot send 'guard' to the engines" in str(error) and "lock" in str(error)
    assert elapsed < 1
    assert len(nbfsdp.runs()) == runs_before
    assert isinstance(shell.user_ns["guard"], type(threading.Lock()))  # nothing lost in the notebook


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("panel model other", "%fsdp panel takes at most one model name"),
        ("panel no_such_model", "%fsdp panel no_such_model: not an nn.Module in the notebook"),
    ],
)
def test_bad_panel_arguments_are_usage_errors(shell, line, message):
    with pytest.raises(UsageError, match=message):
        shell.run_line_magic("fsdp", line)


def test_wait_and_cancel_with_nothing_running_say_so(shell, capsys):
    shell.run_line_magic("fsdp", "wait")
    shell.run_line_magic("fsdp", "cancel")
    assert capsys.readouterr().out.splitlines() == [
        "nbfsdp: nothing to wait for: no background run or save",
        "nbfsdp: nothing is running",
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("set", "%fsdp set takes KEY=VALUE pairs"),
        ("set activation_checkpointing", "takes KEY=VALUE pairs"),
        ("set shard_everything=true", "shard_everything: not a setting; valid: sharding_strategy, mixed_precision"),
        ("set mixed_precision=HALF", "mixed_precision must be one of FULL, DEFAULT, PURE, STORED; got 'HALF'"),
        ("set world_size=0", "--world-size must be between 1 and 64, got 0"),
    ],
)
def test_bad_set_arguments_are_usage_errors(shell, line, message):
    panel_before = dict(nbfsdp._magics.session.panel)
    with pytest.raises(UsageError, match=message):
        shell.run_line_magic("fsdp", line)
    assert nbfsdp._magics.session.panel == panel_before  # nothing half-set


def test_set_between_cells_sets_the_next_cells_defaults(shell, capsys):
    session = nbfsdp._magics.session
    try:
        shell.run_line_magic("fsdp", "set mixed_precision=full activation_checkpointing=true world_size=1")
        assert capsys.readouterr().out == "nbfsdp: defaults of the next cells set\n"
        assert session.panel == {"mixed_precision": "FULL", "activation_checkpointing": True}
        assert session.panel_world_size == 1
    finally:
        session.panel.clear()
        session.panel_world_size = None


def test_config_flags_and_the_controls_take_their_lists_from_one_place(shell):
    """Every fsdp_config flag of %%fsdp is a config field, and the world-size control stops where the flag does."""
    import dataclasses

    from nbfsdp.kernel import flags
    from nbfsdp.shared import config
    from nbfsdp.shared.limits import MAX_WORLD_SIZE
    from nbfsdp.ui.controls import SettingsControls

    fields = {f.name for f in dataclasses.fields(config.FSDPConfig)}
    assert flags.CONFIG_FLAGS and set(flags.CONFIG_FLAGS) <= fields
    cell_help = shell.find_cell_magic("fsdp").__doc__
    assert all(f"--{flag.replace('_', '-')}" in cell_help for flag in flags.CONFIG_FLAGS)
    values = {**dataclasses.asdict(config.FSDPConfig()), "world_size": 2}
    controls = SettingsControls(values, lambda change: None)
    assert controls.widgets["world_size"].max == MAX_WORLD_SIZE


def test_attach_without_a_running_cluster_says_where_it_looked_and_detach_without_one_says_so(
    shell, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path))
    with pytest.raises(UsageError, match="no ipyparallel profile 'gpus'"):
        shell.run_line_magic("fsdp", "attach --profile gpus")
    (tmp_path / "profile_gpus" / "security").mkdir(parents=True)
    with pytest.raises(UsageError, match="no running ipyparallel cluster in profile gpus: start one"):
        shell.run_line_magic("fsdp", "attach --profile gpus")
    for cluster_id in ("a", "b"):
        (tmp_path / "profile_gpus" / "security" / f"cluster-{cluster_id}.json").write_text("{}")
    with pytest.raises(UsageError, match=r"several clusters running \(a, b\): pass --cluster-id"):
        shell.run_line_magic("fsdp", "attach --profile gpus")
    shell.run_line_magic("fsdp", "detach")
    assert capsys.readouterr().out == "nbfsdp: no cluster attached\n"
    assert not nbfsdp._magics.session.attached


def test_each_action_is_one_entry_whose_usage_makes_the_help(shell):
    from nbfsdp.kernel.magics import ACTIONS, FSDPMagics

    parser_help = FSDPMagics.fsdp_line.parser.format_help()
    letters = "".join(parser_help.split())  # argparse wraps the help, at spaces and after hyphens: no whitespace
    for name, action in ACTIONS.items():
        shown = "".join(action.usage.replace("%%", "%").split())  # argparse prints its help through %-formatting
        assert action.usage.startswith(name) and shown in letters, name
        assert callable(action.handler), name
    with pytest.raises(UsageError, match="%fsdp status takes no arguments; got 'now'"):
        shell.run_line_magic("fsdp", "status now")


def test_an_action_that_parses_flags_names_each_of_them_in_its_usage():
    """The usage is made from the parser: every flag argparse's own usage line lists is in the action's (the
    settings flags as [settings]), where explain's lacked --batch, --gpu, --suggest and --device-memory."""
    import re

    from nbfsdp.kernel import flags
    from nbfsdp.kernel.magics import ACTIONS

    settings = {"--config", *("--" + name.replace("_", "-") for name in flags.CONFIG_FLAGS)}
    parsed = 0
    for name, action in ACTIONS.items():
        parser_function = getattr(flags, f"{name.replace('-', '_')}_arguments", None)
        if parser_function is None:
            continue
        parsed += 1
        listed = set(re.findall(r"\[(--[a-z-]+)", parser_function.parser.format_usage())) - {"--help"}
        takes_settings = bool(listed & settings)
        for flag in listed - settings:
            assert re.search(rf"\[{flag}[\] ]", action.usage), (name, flag, action.usage)
        assert ("[settings]" in action.usage) == takes_settings, name
        depth, positional = 0, []
        for word in parser_function.parser.format_usage().split()[2:]:  # past "::" and the parser's name
            if depth == 0 and not word.startswith("["):
                positional.append(word)
            depth += word.count("[") - word.count("]")
        assert all(w.upper() in action.usage or w in action.usage for w in positional), (name, positional)
    assert parsed == 9  # explain, timeline, trace, save, load, checkpoints, export, debug, attach


def test_each_settings_flag_is_made_from_its_field_its_choices_the_literal_its_help_the_docstring():
    """One source of truth: a setting's type and docstring in FSDPConfig are its flag's choices and help."""
    import typing

    from nbfsdp.kernel import flags
    from nbfsdp.kernel.magics import FSDPMagics
    from nbfsdp.shared import config

    actions = {a.dest: a for a in FSDPMagics.fsdp.parser._actions}
    hints = typing.get_type_hints(config.FSDPConfig)
    for name in flags.CONFIG_FLAGS:
        action = actions[name]
        assert action.help.replace("%%", "%") == flags.FIELD_DOCS[name] != ""
        members = [hints[name], *typing.get_args(hints[name])]  # the Literal itself, or one in a union
        literals = [a for a in members if typing.get_origin(a) is typing.Literal]
        assert tuple(action.choices or ()) == tuple(v for literal in literals for v in typing.get_args(literal))
    assert actions["sharding_strategy"].choices == config.SHARDING_STRATEGIES
    assert "ZeRO-3" in actions["sharding_strategy"].help and "--config" not in flags.FIELD_DOCS["sharding_strategy"]
    for name in config.CHECKPOINT_KEYS:
        assert actions[name].help.replace("%%", "%") == flags.CHECKPOINT_DOCS[name] != ""
