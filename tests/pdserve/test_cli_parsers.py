"""Every `pdserve` parser and subparser: an abbreviated flag is refused (never taken as the flag it starts),
a near miss gets "did you mean", every option's --help says its default, and required options show as required.

The rule for defaults: an option that takes a value shows "default" in its help, either argparse's
"(default: X)" or, where it has no value by default, words saying what leaving it out does. On/off flags
(no value) and required options have no default to show."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cli import build_parser, main


def subparsers() -> dict[str, argparse.ArgumentParser]:
    top = build_parser()
    commands = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return {"": top, **commands.choices}


PARSERS = subparsers()


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.help != argparse.SUPPRESS]


def is_required(parser: argparse.ArgumentParser, action: argparse.Action) -> bool:
    """Required alone, or one of a group of which one is required (plan's --engines or --validate)."""
    in_group = any(g.required and action in g._group_actions for g in parser._mutually_exclusive_groups)
    return action.required or in_group


def required_argv(parser: argparse.ArgumentParser) -> list[str]:
    """The least argv the parser takes without an error: a value for each required option and positional."""
    argv = []
    for action in parser._actions:
        if action.required and action.option_strings:
            argv += [action.option_strings[0], "1"]
        elif action.required:
            argv.append("x")
    for group in parser._mutually_exclusive_groups:
        if group.required:
            argv += [group._group_actions[0].option_strings[0], "1"]
    return argv


def unique_abbreviation(parser: argparse.ArgumentParser, flag: str) -> str | None:
    """The shortest prefix of `flag` (3 characters past the dashes at least) that no other flag starts with:
    what argparse with allow_abbrev would silently take as `flag`."""
    others = [f for a in parser._actions for f in a.option_strings if f != flag]
    for end in range(5, len(flag)):
        prefix = flag[:end]
        if not any(other.startswith(prefix) for other in others):
            return prefix
    return None


@pytest.mark.parametrize("name", list(PARSERS))
def test_every_parser_refuses_abbreviated_flags(name):
    parser = PARSERS[name]
    argv = required_argv(parser)
    checked = 0
    for action in options(parser):
        for flag in action.option_strings:
            abbreviation = unique_abbreviation(parser, flag) if flag.startswith("--") else None
            if abbreviation is None or name == "":
                continue
            _, unknown = parser.parse_known_args([*argv, abbreviation])
            assert abbreviation in unknown, f"pdserve {name} took {abbreviation} as {flag}"
            checked += 1
    assert checked or name in ("",), f"pdserve {name}: no flag to abbreviate?"


def test_top_parser_refuses_an_abbreviated_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--vers"])
    assert exit_info.value.code == 2


def test_a_typo_is_refused_with_did_you_mean(capsys):
    """`--num-prefil 2` used to start 2P1D: argparse took it as --num-prefill."""
    with pytest.raises(SystemExit) as exit_info:
        main(["up", "--num-prefil", "2"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --num-prefil 2" in err and "--num-prefil: did you mean --num-prefill?" in err


def test_a_misspelled_flag_gets_did_you_mean(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--num-promtps", "3"])
    assert "did you mean --num-prompts?" in capsys.readouterr().err


def help_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    formatter = parser._get_formatter()
    return formatter._expand_help(action) if action.help else ""


@pytest.mark.parametrize("name", list(PARSERS))
def test_every_option_help_says_its_default(name):
    parser = PARSERS[name]
    missing = []
    for action in options(parser):
        if action.nargs == 0 or is_required(parser, action):  # on/off flags, --help, --version; required options
            continue
        if "default" not in help_of(parser, action).lower():
            missing.append(action.option_strings[0])
    assert not missing, f"pdserve {name}: --help gives no default for {', '.join(missing)}"


@pytest.mark.parametrize("name", list(PARSERS))
def test_required_options_show_as_required(name):
    parser = PARSERS[name]
    usage = " ".join(parser.format_usage().split())
    for action in options(parser):
        if action.required:
            assert action.option_strings[0] in usage and f"[{action.option_strings[0]}" not in usage, usage


def test_plan_usage_shows_engines_or_validate_required():
    """`plan` needs --engines N, or --validate SWEEP_DIR (which takes the layouts from the sweep)."""
    usage = " ".join(PARSERS["plan"].format_usage().split())
    assert "(--engines N | --validate SWEEP_DIR)" in usage, usage


def test_plan_refuses_engines_with_validate(capsys):
    """--validate replays the sweep's own layouts: an --engines beside it would be ignored."""
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--profile", "p.json", "--validate", "sweep", "--engines", "4"])
    assert exit_info.value.code == 2
    assert "--engines" in capsys.readouterr().err
