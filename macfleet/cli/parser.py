"""The argument parser every `macfleet` command is built with: help that shows each option's
default, and an unknown option answered with the closest ones this command has ("did you mean
--temp?") instead of argparse's bare "unrecognized arguments"."""

from __future__ import annotations

import argparse
import difflib
import textwrap
from collections.abc import Sequence

HINTS_ATTR = "_unknown_option_hints"  # namespace attribute: {typed flag: (prog, suggestions)}
MAX_SUGGESTIONS = 3
SUGGEST_CUTOFF = 0.75
NEAR_BEST = 0.05  # suggest only the spellings about as close as the closest one


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option that takes a value and has a default, unless its help
    already speaks of its default (written by hand where the value alone says little: a path
    looked up at run time, "the host name", "random"). In descriptions and epilogs a paragraph
    whose lines are indented (examples, option lists) is printed as written; the others are
    wrapped."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out = []
        for para in text.split("\n\n"):
            lines = para.splitlines()
            if any(ln.startswith(" ") for ln in lines[1:] or lines):
                out.append("\n".join(indent + ln for ln in lines))
            else:
                out.append(textwrap.fill(" ".join(para.split()), width, initial_indent=indent,
                                         subsequent_indent=indent))
        return "\n\n".join(out)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("default" in text or not action.option_strings or action.nargs == 0
                or action.default in (None, "", [], (), argparse.SUPPRESS)):
            return text
        return text + " (default: %(default)s)"


def suggestions(flag: str, options: Sequence[str]) -> list[str]:
    """Pure: the options closest to a mistyped one (`--temperature` -> `--temp`): close spellings
    first, then options the typed word starts with or that start with it."""
    word = flag.split("=", 1)[0]
    longs = [o for o in options if o.startswith("--")]
    ratios = {o: difflib.SequenceMatcher(None, word, o).ratio() for o in longs}
    best = max(ratios.values(), default=0.0)
    close = sorted((o for o, r in ratios.items() if r >= SUGGEST_CUTOFF and r >= best - NEAR_BEST),
                   key=lambda o: -ratios[o])
    stem = [o for o in longs if len(o) > 3 and (word.startswith(o) or o.startswith(word))]
    out = []
    for o in stem + close:
        if o not in out:
            out.append(o)
    return out[:MAX_SUGGESTIONS]


def unknown_option_message(flag: str, prog: str, near: Sequence[str]) -> str:
    """Pure: the one line for an option the command does not take."""
    word = flag.split("=", 1)[0]
    hint = f"did you mean {' or '.join(near)}? " if near else ""
    return f"{prog}: error: {word} is not an option of `{prog}`; {hint}see `{prog} --help`"


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser with the help formatter above; its subparsers are Parsers too
    (add_subparsers makes them of the parser's own class). An option it does not know is kept
    with its suggestions in the namespace (HINTS_ATTR) for the caller's error line."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        ns, extra = super().parse_known_args(args, namespace)
        hints = dict(getattr(ns, HINTS_ATTR, {}))
        for word in extra:
            if word.startswith("-") and len(word) > 1 and not _is_number(word):
                hints.setdefault(word, (self.prog, suggestions(word,
                                                              list(self._option_string_actions))))
        setattr(ns, HINTS_ATTR, hints)
        return ns, extra


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def unknown_arguments_message(ns: argparse.Namespace, extra: Sequence[str],
                              prog: str = "macfleet") -> str:
    """The one line for arguments no parser took: the first unknown option with its nearest
    spellings (its value, taken for a positional argument or left over, is not the problem),
    else the stray words."""
    hints = getattr(ns, HINTS_ATTR, {})
    for word in extra:
        if word in hints:
            sub_prog, near = hints[word]
            return unknown_option_message(word, sub_prog, near)
    return f"{prog}: error: unrecognized arguments: {' '.join(extra)}"
