"""The built-in one-line tasks' templates: what `simulate.tasks.BuiltinTaskSource` fills.

`TEMPLATES` are the task families (each filled with its parameter grid), `SINGLES` one-off
tasks, `LETTER_PRACTICE` and `DIGIT_PRACTICE` templates that exist only as mid-training practice,
and `UNSEEN_TEMPLATES` the families held out whole (`held_out_family`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Template:
    """`name`, `doc` and `body` are format strings over the parameter `p`."""

    name: str
    arg: str  # x: int, s: str, xs: list[int]
    doc: str
    body: str
    params: tuple[Any, ...]


INTS, SMALL = tuple(range(1, 31)), tuple(range(2, 10))
LETTERS = tuple("abcdefghijklmnopqrstuvwxyz")
TEMPLATES = (
    Template("add_{p}", "x", "Return x plus {p}.", "x + {p}", INTS),
    Template("sub_{p}", "x", "Return x minus {p}.", "x - {p}", INTS),
    Template("mul_{p}", "x", "Return x times {p}.", "x * {p}", SMALL),
    Template("mod_{p}", "x", "Return x modulo {p}.", "x % {p}", SMALL),
    Template("is_divisible_by_{p}", "x", "Return True if x is divisible by {p}.",
              "x % {p} == 0", SMALL),
    Template("is_greater_than_{p}", "x", "Return True if x is greater than {p}.", "x > {p}",
              INTS),
    Template("clamp_0_{p}", "x", "Return x limited to the range 0 to {p}.",
              "max(0, min({p}, x))", INTS),
    Template("repeat_str_{p}", "s", "Return s repeated {p} times.", "s * {p}", SMALL),
    Template("first_{p}_chars", "s", "Return the first {p} characters of s.", "s[:{p}]",
              SMALL),
    Template("last_{p}_chars", "s", "Return the last {p} characters of s.", "s[-{p}:]", SMALL),
    Template("count_char_{p}", "s", "Return how many times '{p}' occurs in s.",
              "s.count('{p}')", LETTERS),
    Template("append_char_{p}", "s", "Return s followed by '{p}'.", "s + '{p}'", LETTERS),
    Template("add_{p}_to_each", "xs", "Return a list with {p} added to each item of xs.",
              "[x + {p} for x in xs]", INTS),
    Template("keep_greater_than_{p}", "xs", "Return the items of xs greater than {p}.",
              "[x for x in xs if x > {p}]", INTS),
    Template("item_{p}", "xs", "Return the item at index {p} of xs.", "xs[{p}]", (0, 1, 2)),
)
SINGLES = (  # (name, arg, docstring, body): one task each
    ("max_of_list", "xs", "Return the largest number in xs.", "max(xs)"),
    ("min_of_list", "xs", "Return the smallest number in xs.", "min(xs)"),
    ("sum_of_list", "xs", "Return the sum of the numbers in xs.", "sum(xs)"),
    ("length_of_list", "xs", "Return how many items xs has.", "len(xs)"),
    ("sort_list", "xs", "Return the items of xs in increasing order.", "sorted(xs)"),
    ("reverse_list", "xs", "Return the items of xs in reverse order.", "xs[::-1]"),
    ("reverse_string", "s", "Return s reversed.", "s[::-1]"),
    ("upper_string", "s", "Return s in upper case.", "s.upper()"),
    ("lower_string", "s", "Return s in lower case.", "s.lower()"),
    ("remove_spaces", "s", "Return s without its spaces.", "s.replace(' ', '')"),
    ("double_string", "s", "Return s followed by itself.", "s + s"),
    ("is_even", "x", "Return True if x is even.", "x % 2 == 0"),
    ("is_odd", "x", "Return True if x is odd.", "x % 2 == 1"),
    ("square", "x", "Return x squared.", "x * x"),
    ("negate", "x", "Return minus x.", "-x"),
    ("absolute", "x", "Return the absolute value of x.", "abs(x)"),
)


# Practice-only templates: a lower-case letter copied from the docstring in other contexts than
# the tasks' (`prepend_char_b` is no task; `append_char_b` may be held out, as `add_17` may be
# while `sub_17` is trained)
LETTER_PRACTICE = (
    Template("prepend_char_{p}", "s", "Return '{p}' followed by s.", "'{p}' + s", LETTERS),
    Template("remove_char_{p}", "s", "Return s without the character '{p}'.",
              "s.replace('{p}', '')", LETTERS),
    Template("starts_with_char_{p}", "s", "Return True if s starts with '{p}'.",
              "s.startswith('{p}')", LETTERS),
)


# Practice-only templates: a single digit copied from the docstring. The task templates' practice
# values are the numbers above their ranges (`add_31`, `mul_10`, `add_101`), so every practice
# number has two or three digits, and a model mid-trained on them writes `x + 30` for `add_3` and
# `s * 20` for `repeat_str_2` (docs/bootstrap.md); every single digit is some template's task
# value, so a single digit can be practised only in forms no task has.
DIGITS = tuple(range(1, 10))
DIGIT_PRACTICE = (
    Template("floor_div_{p}", "x", "Return x divided by {p}, rounded down.", "x // {p}", DIGITS),
    Template("power_{p}", "x", "Return x to the power {p}.", "x ** {p}", DIGITS),
    Template("shift_left_{p}", "x", "Return x shifted left by {p} bits.", "x << {p}", DIGITS),
    Template("repeat_list_{p}", "xs", "Return xs repeated {p} times.", "xs * {p}", DIGITS),
    Template("every_{p}_items", "xs", "Return every {p}-th item of xs, from the first.",
             "xs[::{p}]", DIGITS),
)


# the templates whose parameter is a lower-case letter: the last kind of value a tiny model
# learns to copy (mid-training draws their demonstrations more often: BootstrapSettings)
LETTER_FAMILIES = tuple(t.name for t in (*TEMPLATES, *LETTER_PRACTICE) if t.params == LETTERS)
DIGIT_FAMILIES = tuple(t.name for t in DIGIT_PRACTICE)


# Unseen templates: kinds of task in no other split, no demonstration and no practice task,
# every task of them in `held_out_family` (BuiltinTaskSource). Each is a form the seen
# templates come near (an argument on the other side, a slice from the other end, a list
# comprehension that multiplies, a membership test) without writing it.
UNSEEN_TEMPLATES = (
    Template("sub_from_{p}", "x", "Return {p} minus x.", "{p} - x", SMALL),
    Template("max_with_{p}", "x", "Return the larger of x and {p}.", "max(x, {p})", SMALL),
    Template("drop_first_{p}", "s", "Return s without its first {p} characters.", "s[{p}:]",
              SMALL),
    Template("contains_char_{p}", "s", "Return True if '{p}' occurs in s.", "'{p}' in s",
              LETTERS[:8]),
    Template("times_each_{p}", "xs", "Return a list with each item of xs times {p}.",
              "[x * {p} for x in xs]", SMALL),
)
