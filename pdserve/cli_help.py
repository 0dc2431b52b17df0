"""argparse helpers every `pdserve` subcommand shares: help that shows each option's default, and old
flag spellings that keep working with a deprecation warning."""

from __future__ import annotations

import argparse
import sys


MAX_SEED = 2**63 - 1  # what torch's and numpy's generators both take


def seed_arg(text: str) -> int:
    """argparse type of every --seed: an integer from 0 to MAX_SEED."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer: give a seed from 0 to {MAX_SEED}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"{text} is out of range: give a seed from 0 to {MAX_SEED}")
    return value


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already says its default, or there is
    no default worth showing (None, False, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


class DeprecatedFlag(argparse.Action):
    """An old spelling of a flag, hidden from --help: warns, then stores (or appends) into the new flag's
    destination. Give dest=the new flag's dest and replacement=the new flag."""

    def __init__(self, option_strings: list[str], dest: str, replacement: str, append: bool = False,
                 **kwargs) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        self.replacement = replacement
        self.append = append

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values,
                 option_string: str | None = None) -> None:
        print(f"warning: {option_string} is deprecated and will be removed: use {self.replacement}",
              file=sys.stderr)
        if self.append:
            values = [*(getattr(namespace, self.dest, None) or []), values]
        setattr(namespace, self.dest, values)


def use_defaults_help(parser: argparse.ArgumentParser) -> None:
    """The defaults-showing formatter on `parser` and on every subcommand parser under it."""
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                use_defaults_help(subparser)
