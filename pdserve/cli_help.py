"""argparse helpers every `pdserve` subcommand shares: help that shows each option's default, no abbreviated
flags, "did you mean" for a near miss, and old flag spellings that keep working with a deprecation warning."""

from __future__ import annotations

import argparse
import difflib
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


def positive_int(text: str) -> int:
    """argparse type of a size or count that must be at least 1 (blocks, tokens, sequences)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def dtype_arg(text: str) -> str:
    """argparse type of --dtype: vLLM's spellings `half` and `float` mean float16 and float32, as there."""
    return {"half": "float16", "float": "float32"}.get(text.lower(), text.lower())


_SCALE_OUT = ("pdserve runs each engine on one device: scale out with engines (`pdserve up --num-prefill N "
              "--num-decode M`)")
_USE = "pdserve's name for it is "
# Flags of vLLM's and SGLang's servers that pdserve does not take, and what to do instead.
FOREIGN_FLAGS = {
    **dict.fromkeys(["--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--tp-size", "--tp",
                     "--pp-size", "--data-parallel-size", "-dp", "--dp-size", "--dp"], _SCALE_OUT),
    **dict.fromkeys(["--gpu-memory-utilization", "--mem-fraction-static"],
                    "pdserve sizes the KV cache with --num-kv-blocks (default on CUDA: 90% of the GPU memory left "
                    "after the weights)"),
    "--kv-cache-dtype": "the KV cache takes the weights' --dtype (no fp8 KV cache)",
    "--trust-remote-code": "pdserve runs no code from a model repository: it serves transformers' own "
                           "architectures (natively, or with --model-impl transformers)",
    **dict.fromkeys(["--quantization", "-q"], "quantized checkpoints are not supported: serve the model's float16 "
                                              "or bfloat16 weights"),
    "--enable-prefix-caching": "prefix caching is on by default (--no-prefix-caching turns it off): leave it out",
    **dict.fromkeys(["--no-enable-prefix-caching", "--disable-radix-cache"], _USE + "--no-prefix-caching"),
    "--enable-chunked-prefill": "chunked prefill is always on (--max-num-batched-tokens is a step's token budget): "
                                "leave it out",
    "--chunked-prefill-size": _USE + "--max-num-batched-tokens",
    "--max-running-requests": _USE + "--max-num-seqs",
    "--context-length": _USE + "--max-model-len",
    "--page-size": _USE + "--block-size",
    "--model-path": _USE + "--model",
    **dict.fromkeys(["--tokenizer", "--tokenizer-path"], "the tokenizer comes from --model's directory"),
    "--chat-template": "the router renders chats: give --chat-template to `pdserve router` or `pdserve up`",
    "--revision": "download that revision with huggingface_hub and pass its directory as --model",
    "--download-dir": "set HF_HOME (or HF_HUB_CACHE) for where hub models are kept",
    "--swap-space": "preempted requests are recomputed, never swapped to the CPU: leave it out",
    **dict.fromkeys(["--disable-log-requests", "--disable-log-stats", "--uvicorn-log-level"], _USE + "--log-level"),
    "--seed": "send `seed` in a request for reproducible sampling",
    "--disaggregation-mode": "run `pdserve prefill` or `pdserve decode`, or `pdserve up --num-prefill N "
                             "--num-decode M`",
    **dict.fromkeys(["--host", "--port"], "an engine listens on --control-address (a prefill engine's KV on "
                                          "--kv-address); the router and `pdserve up` take --host and --port"),
}


def add_pin_cpus_arg(parser: argparse.ArgumentParser) -> None:
    """`--pin-cpus / --no-pin-cpus`: one flag with one default for `pdserve up` and `pdserve sweep`, so that a
    bench against `up` and a sweep's runs see engines placed alike (docs/serving/deploy.md, "Core pinning")."""
    parser.add_argument("--pin-cpus", action=argparse.BooleanOptionalAction, default=None,
                        help="on CPU: give each engine its own cores (sched_setaffinity) and a thread per core; "
                             "--no-pin-cpus: torch's threads, placed by the OS (default: pinned when every engine "
                             "gets cores of its own, else not)")


def pins_cpus(pin_cpus: bool | None, cores_wanted: int, cores_available: int) -> bool:
    """--pin-cpus resolved: as given, else pinned when the engines' cores (one each, or --cores-per-engine) fit the
    cores this process may use."""
    return pin_cpus if pin_cpus is not None else cores_wanted <= cores_available


def unrecognized_message(unknown: list[str], known_flags: list[str] = ()) -> str:
    """argparse's "unrecognized arguments" plus, for each flag vLLM or SGLang users bring along (or a model given
    as a positional argument, as `vllm serve MODEL` takes it), what pdserve takes instead, and for a near miss
    of one of `known_flags` (a typo, an abbreviation), the flag it was probably meant to be."""
    hints = []
    previous_flag = False
    for token in unknown:
        if token.startswith("-"):
            flag = token.split("=", 1)[0]
            previous_flag = "=" not in token
            if flag in FOREIGN_FLAGS:
                hints.append(f"{flag}: {FOREIGN_FLAGS[flag]}")
            elif close := closest_flag(flag, known_flags):
                hints.append(f"{flag}: did you mean {close}?")
        elif not previous_flag:
            hints.append(f"{token}: give the model as --model {token} (not as a positional argument)")
        else:
            previous_flag = False
    return "; ".join([f"unrecognized arguments: {' '.join(unknown)}", *hints])


def closest_flag(flag: str, known_flags: list[str]) -> str | None:
    """The known flag `flag` is most likely a misspelling or an abbreviation of, if one is close."""
    long_flags = [known for known in known_flags if known.startswith("--")]
    prefixed = [known for known in long_flags if known.startswith(flag)] if flag.startswith("--") else []
    if len(prefixed) == 1:
        return prefixed[0]
    close = difflib.get_close_matches(flag, long_flags, n=1, cutoff=0.75)
    return close[0] if close else None


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag `parser` takes, hidden ones (old spellings, refused foreign flags) included."""
    return [flag for action in parser._actions for flag in action.option_strings]


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already says its default, or there is
    no default worth showing (None, False, an empty list): such an option's help says in words what leaving
    it out does ("default: the server's first"), unless it is an on/off flag or required."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is False or default == [] or default == argparse.SUPPRESS:
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
    """On `parser` and every subcommand parser under it: the defaults-showing formatter, and no abbreviated
    flags (`--num-prefil 2` is refused with "did you mean --num-prefill?", never taken as --num-prefill)."""
    parser.formatter_class = DefaultsHelpFormatter
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                use_defaults_help(subparser)
