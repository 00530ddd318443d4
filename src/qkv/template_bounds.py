"""Bounds on what a Jinja template may make while it renders. jinja2's sandbox keeps a template away from Python,
not from making a text of any size: ``'x' * 10**10``, a macro that calls itself or a loop that writes without end
would take the memory or the stack of the process. Here each rendering gets a :class:`Budget`, and every
operation that can make more than it is given (an operator, ``~``, a filter, a method of str, a call, a slice, a
write) is measured against it before it runs. :mod:`qkv.chat` renders chat templates this way.

The bounds live partly inside jinja2's compiler (the buffers, ``~`` and loops it writes), whose classes jinja2 does
not publish: pyproject.toml pins jinja2 3.1.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import re
import string
from collections.abc import Collection, Iterator, Mapping, Sequence, Sized
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

MAX_RENDERED_CHARS = 1 << 20
"""The most a template may write for an empty conversation; each character of the conversation adds 4. Each text
or list a template makes on the way is bounded by the same (an item of a list counts as 8 characters), and all
of them together by ``WORK_FACTOR`` times that."""
WORK_FACTOR = 32
MAX_CALL_DEPTH = 64  # macros, caller() and recursive loops within one another; published templates nest a few
MAX_INT_BITS = 1 << 16  # templates count turns; a number of a billion digits would take minutes to compute
_ITEM = 8  # what an item of a list costs, in characters: a reference
_OTHER = 64  # what a value that is not a text, a number or a container writes, at most (None, a macro, a loop)
_READS_ITERATOR = {"join", "sum"}  # filters and methods whose iterator argument is read into a list to be measured
# Filters that keep their value as it is (items, numbers, lists); every other filter writes it out as text first.
_FILTERS_KEEPING_VALUES = {"abs", "attr", "batch", "count", "d", "default", "dictsort", "first", "float", "groupby",
                           "int", "items", "last", "length", "list", "map", "max", "min", "random", "reject",
                           "rejectattr", "reverse", "round", "select", "selectattr", "slice", "sort", "sum", "unique"}


class _TooLarge(Exception):
    """A rendering stopped at one of its bounds."""


class Budget:
    """What one rendering may do: make ``limit`` characters in any one text or list (the prompt included) and
    ``WORK_FACTOR * limit`` in all, run as many steps of its loops, and nest calls ``MAX_CALL_DEPTH`` deep."""

    def __init__(self, limit: int):
        self.limit, self.left, self.steps, self.depth = limit, WORK_FACTOR * limit, limit, 0

    def charge(self, size: int, what: str) -> None:
        """Count the ``size`` characters that ``what`` is about to make."""
        if size > self.limit:
            raise _TooLarge(f"{what} would make {size:,} characters, more than the {self.limit:,} a template may "
                            "make at once for this conversation")
        self.left -= size
        if self.left < 0:
            raise _TooLarge(f"{what} would take what the template makes past {WORK_FACTOR * self.limit:,} "
                            "characters in all, the bound for this conversation")

    def step(self) -> None:
        """Count a step of a loop."""
        self.steps -= 1
        if self.steps < 0:
            raise _TooLarge(f"its loops run more than {self.limit:,} steps in all, the bound for this conversation")

    def written(self, size: int) -> None:
        """Check the ``size`` characters written so far, by the whole template or by a macro or block."""
        if size > self.limit:
            raise _TooLarge(f"it writes more than {self.limit:,} characters, the most a template may write for "
                            "this conversation")


_BUDGET: ContextVar[Budget | None] = ContextVar("qkv_chat_budget", default=None)


def _budget() -> Budget:
    """The rendering's budget; outside one (jinja2 folding a constant as it compiles), a budget for that alone."""
    return _BUDGET.get() or Budget(MAX_RENDERED_CHARS)


@contextmanager
def _charged_to(budget: Budget):
    token = _BUDGET.set(budget)
    try:
        yield
    finally:
        _BUDGET.reset(token)


def render_within(compiled, budget: Budget, variables: Mapping[str, Any]) -> str:
    """A template compiled in a :func:`bounded_sandbox`, its text written within ``budget``."""
    parts, size = [], 0
    with _charged_to(budget):
        for part in compiled.generate(**variables):
            size += len(part)
            budget.written(size)
            parts.append(part)
    return "".join(parts)


class _Buffer(list):
    """What a macro, a call or filter block or a ``{% set %}`` block writes, counted as it is written."""

    def __init__(self, budget: Budget):
        super().__init__()
        self.budget, self.size = budget, 0

    def append(self, text: str) -> None:
        self._count(len(text))
        super().append(text)

    def extend(self, texts) -> None:
        texts = tuple(texts)
        self._count(sum(map(len, texts)))
        super().extend(texts)

    def _count(self, size: int) -> None:
        self.size += size
        self.budget.written(self.size)
        self.budget.charge(size, "writing")


def bounded_sandbox() -> type:
    """jinja2's immutable sandbox with its operators, calls, slices, buffers and ``~`` bounded (a class made on
    first use, when jinja2 is imported)."""
    from jinja2.runtime import markup_join, str_join
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "**", "%"})
        code_generator_class = _bounded_code_generator()

        def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
            budget = _budget()
            if operator == "+" and isinstance(left, str) and isinstance(right, str):  # the common case, first
                budget.charge(len(left) + len(right), "'+'")
            else:
                budget.charge(_binop_size(operator, left, right, budget.limit), repr(operator))
            return self.binop_table[operator](left, right)

        def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # jinja2's names: no keyword clashes
            budget = _budget()
            name = _charge_call(budget, __obj, args, kwargs)
            budget.depth += 1
            try:
                result = super().call(__context, __obj, *args, **kwargs)
            finally:
                budget.depth -= 1
            budget.charge(_size(result), f"calling {name}")
            return result

        def getitem(self, obj: Any, argument: Any) -> Any:
            value = super().getitem(obj, argument)
            if isinstance(argument, slice):
                _budget().charge(_size(value), "a slice")
            return value

        def bounded_loop(self, iterable: Any) -> Iterator:
            budget = _budget()
            for item in iterable:
                budget.step()
                yield item

        def bounded_buffer(self) -> _Buffer:
            return _Buffer(_budget())

        def bounded_concat(self, eval_ctx, values: tuple) -> str:
            budget = _budget()
            budget.charge(_text_size(values, budget.limit), "'~'")
            return (markup_join if eval_ctx.autoescape else str_join)(values)

    return BoundedSandbox


def _bounded_code_generator() -> type:
    """jinja2's compiler, writing each buffer as a :class:`_Buffer`, each ``~`` as a bounded join, and each loop
    over what counts its steps. It overrides methods of jinja2's ``CodeGenerator``, which jinja2 does not publish:
    pyproject.toml pins jinja2 to the minor version these were written for, and
    ``tests/test_chat_bounds.py::test_the_compiled_template_calls_each_bound`` fails if a new one stops
    calling them."""
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator

    class BoundedCodeGenerator(CodeGenerator):
        def buffer(self, frame) -> None:
            frame.buffer = self.temporary_identifier()
            self.writeline(f"{frame.buffer} = environment.bounded_buffer()")

        def visit_For(self, node, frame) -> None:
            counted = nodes.Call(nodes.EnvironmentAttribute("bounded_loop"), [node.iter], [], None, None,
                                 lineno=node.lineno)
            super().visit_For(nodes.For(node.target, counted, node.body, node.else_, node.test, node.recursive,
                                        lineno=node.lineno), frame)

        def visit_Concat(self, node, frame) -> None:
            self.write("environment.bounded_concat(context.eval_ctx, (")
            for value in node.nodes:
                self.visit(value, frame)
                self.write(", ")
            self.write("))")

    return BoundedCodeGenerator


def _charge_call(budget: Budget, obj: Any, args: tuple, kwargs: Mapping) -> str:
    """Count a call of ``obj`` a template is about to make (its depth; what a method of str would make); the
    name of what is called."""
    if budget.depth >= MAX_CALL_DEPTH:
        raise _TooLarge(f"its calls nest more than {MAX_CALL_DEPTH} deep (a macro that calls itself without end?)")
    method = getattr(obj, "__wrapped__", obj)  # str.format comes wrapped by the sandbox
    name = getattr(method, "__name__", "a function")
    if isinstance(getattr(method, "__self__", None), str):
        args = _listed(args) if name in _READS_ITERATOR else args
        budget.charge(_str_method_size(method.__self__, name, args, kwargs, budget.limit), f"str.{name}")
    return name


def written_value(value: Any) -> Any:
    """``{{ value }}``'s value, measured before it is written out as text (jinja2's ``finalize``); a text is
    counted where it is written."""
    if isinstance(value, str):
        return value
    budget = _budget()
    budget.charge(_text_size(value, budget.limit), "writing a value")
    return value


def bounded_filter(name: str, func):
    """The filter ``func``, measured before it runs (the size of what it makes, where it can make more than it
    is given; the text of its value, where it writes that out) or after (where it keeps its value's items)."""
    signature = inspect.signature(func)
    value_at = 1 if getattr(func, "jinja_pass_arg", None) else 0  # after the context jinja2 passes first
    # jinja2's async-ready filters (list, slice) are passed a context that the function they wrap does not take
    unnamed = value_at if getattr(inspect.unwrap(func), "jinja_pass_arg", None) is None else 0
    what = f"the {name!r} filter"

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _budget()
        args = _listed(args) if name in _READS_ITERATOR else args
        if name not in _FILTERS_KEEPING_VALUES and len(args) > value_at:
            budget.charge(_text_size(args[value_at], budget.limit), what)
        if name in _FILTER_SIZES:
            bound = signature.bind(*args[unnamed:], **kwargs)
            bound.apply_defaults()
            budget.charge(_FILTER_SIZES[name](bound.arguments, budget.limit), what)
        result = func(*args, **kwargs)
        if name in _FILTERS_KEEPING_VALUES:
            budget.charge(_size(result), what)
        return result

    return bounded


def _listed(args: tuple) -> tuple:
    """``args`` with each iterator (a filter's generator) read into a list, so that it can be measured."""
    return tuple(list(a) if isinstance(a, Iterator) else a for a in args)


def _size(value: Any) -> int:
    """What ``value``, just made, holds: its characters, or per item a reference and the characters of a text
    (new, as ``str.split``'s are)."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(_ITEM + len(v) if isinstance(v, str) else _ITEM for v in value)
    return _ITEM * len(value) if isinstance(value, (dict, set, frozenset)) else 0


def _sequence_size(value: Any) -> int | None:
    """A text's characters, a list's references; None for other values."""
    if isinstance(value, str):
        return len(value)
    return _ITEM * len(value) if isinstance(value, (list, tuple)) else None


def _text_size(value: Any, limit: int, indent: int = 0) -> int:
    """About the length of ``str(value)``, or of its JSON indented by ``indent``, counted only to just past
    ``limit``: a list of a million references to one long text is found too long without being written."""
    if isinstance(value, str):  # the common case, first
        return len(value)
    size = 0
    for item, depth in _nested(value):
        size += 4 + indent * depth if depth else 0  # quotes, separator, indentation
        if isinstance(item, (str, bytes)):
            size += len(item)
        elif isinstance(item, int):
            size += item.bit_length() // 3 + 5
        elif _children(item) is None:
            size += _OTHER
        if size > limit:
            break
    return size


def _largest_number(value: Any, limit: int) -> int:
    """The largest number (in size) within ``value``, looking at no more than ``limit`` of what it holds."""
    numbers = (abs(item) for item, _ in itertools.islice(_nested(value), limit) if isinstance(item, int))
    return max(numbers, default=0)


def _nested(value: Any) -> Iterator[tuple[Any, int]]:
    """``value`` and all it holds (a mapping's keys and values, a namespace's), depth first, each with its
    depth."""
    stack = [iter((value,))]
    while stack:
        item = next(stack[-1], stack)  # the stack itself marks the end of a container
        if item is stack:
            stack.pop()
            continue
        yield item, len(stack) - 1
        children = _children(item)
        if children is not None:
            stack.append(children)


def _children(value: Any) -> Iterator | None:
    """What a container holds; None for a text, a number or another single value."""
    from jinja2.utils import Namespace

    if isinstance(value, Namespace):
        value = object.__getattribute__(value, "_Namespace__attrs")
    if isinstance(value, Mapping):
        return itertools.chain.from_iterable(value.items())
    return iter(value) if isinstance(value, Collection) and not isinstance(value, (str, bytes)) else None


def _binop_size(operator: str, left: Any, right: Any, limit: int) -> int:
    """What ``left <operator> right`` would make, in characters; for two numbers, their result's bits are
    checked instead."""
    if isinstance(left, int) and isinstance(right, int):
        _check_bits(operator, left, right)
        return 0
    if operator == "%":
        return _percent_size(left, right, limit) if isinstance(left, str) else 0
    if operator == "+":
        sizes = _sequence_size(left), _sequence_size(right)
        return 0 if None in sizes else sum(sizes)
    if operator == "*":
        sequence, times = (left, right) if isinstance(right, int) else (right, left)
        size = _sequence_size(sequence)
        return size * max(times, 0) if size is not None and isinstance(times, int) else 0
    return 0


def _check_bits(operator: str, left: int, right: int) -> None:
    a, b = left.bit_length(), right.bit_length()
    bits = {"+": max(a, b) + 1, "*": a + b}.get(operator, 0)
    if operator == "**" and right > 0 and abs(left) > 1:
        bits = a * right
    if bits > MAX_INT_BITS:
        raise _TooLarge(f"{operator!r} would make a number of {bits:,} bits, more than the {MAX_INT_BITS:,} a "
                        "template may make")


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0-9 +*.]*")


def _percent_size(fmt: str, args: Any, limit: int) -> int:
    """At most the length of ``fmt % args``."""
    values = tuple(args.values()) if isinstance(args, Mapping) else args if isinstance(args, tuple) else (args,)
    return len(fmt) + _fields_size(_PERCENT_SPEC.findall(fmt), values, limit)


def _format_size(fmt: str, args: Sequence, kwargs: Mapping, limit: int) -> int:
    """At most the length of ``fmt.format(*args, **kwargs)``."""
    parsed = list(string.Formatter().parse(fmt))
    specs = [spec or "" for _, field, spec, _ in parsed if field is not None]
    return sum(len(literal) for literal, *_ in parsed) + _fields_size(specs, (*args, *kwargs.values()), limit)


def _fields_size(specs: Sequence[str], values: Sequence, limit: int) -> int:
    """At most what formatting fields with these ``specs`` writes: for each, all the ``values`` and the numbers its
    spec names (widths, precisions), and the largest number within them where it takes one from them (``*``, a
    nested field such as ``{0[1]}``)."""
    text = _text_size(values, limit)
    largest = _largest_number(values, limit) if any("*" in spec or "{" in spec for spec in specs) else 0
    return sum(text + sum(map(int, re.findall(r"\d+", spec))) + (largest if "*" in spec or "{" in spec else 0)
               for spec in specs)


def _str_method_size(s: str, name: str, args: tuple, kwargs: Mapping, limit: int) -> int:
    """What ``s.name(*args, **kwargs)`` would make, for the methods of str that can make more than they are given
    (0 for the others, which are measured after)."""
    kwargs = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}  # jinja2's, not the call's
    first, second, third = (*args, None, None, None)[:3]
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(len(s), _int(first))
    if name == "expandtabs":
        return len(s) + s.count("\t") * _int(kwargs.get("tabsize", 8) if first is None else first)
    if name == "replace":
        return _replaced_size(s, first, second, kwargs.get("count", third), limit)
    if name == "join":
        return _text_size(first, limit) + len(s) * _count(first)
    if name == "translate":
        values = first.values() if isinstance(first, Mapping) else ()
        return len(s) * max([1, *(len(v) for v in values if isinstance(v, str))])
    if name == "format":
        return _format_size(s, args, kwargs, limit)
    if name == "format_map":
        return _format_size(s, (), _mapping(first), limit)
    return 0


def _replaced_size(s: str, old: Any, new: Any, count: Any, limit: int) -> int:
    times = s.count(old) if isinstance(old, str) and old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        times = min(times, count)
    return len(s) + times * _text_size(new, limit)


def _indented_size(s: str, width: Any) -> int:
    return len(s) + (s.count("\n") + 1) * _width(width)


def _summed_size(a: Mapping[str, Any], limit: int) -> int:
    """What the sum filter makes adding lists: a copy of the sum so far at each step."""
    from jinja2.filters import make_attrgetter

    items = a["iterable"]
    if a["attribute"] is not None:
        items = map(make_attrgetter(a["environment"], a["attribute"]), items)
    made = running = _sequence_size(a["start"]) or 0
    for item in items:
        running += _sequence_size(item) or 0
        made += running
    return made


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _width(value: Any) -> int:
    """An indentation's width, given as a number of spaces or as the text itself."""
    return len(value) if isinstance(value, str) else _int(value)


def _count(value: Any) -> int:
    return len(value) if isinstance(value, Sized) else 0


def _mapping(value: Any) -> Mapping:
    return value if isinstance(value, Mapping) else {}


# The filters that can make more than they are given: what each would make, from its arguments by name (after
# the text of its value is measured, so that str() of the value is safe).
_FILTER_SIZES = {
    "center": lambda a, limit: max(_text_size(a["value"], limit), _int(a["width"])),
    "indent": lambda a, limit: _indented_size(str(a["s"]), a["width"]),
    "wordwrap": lambda a, limit: (len(str(a["s"])) + 1) * (1 + _text_size(a["wrapstring"] or "\n", limit)),
    "replace": lambda a, limit: _replaced_size(str(a["s"]), a["old"], a["new"], a["count"], limit),
    "join": lambda a, limit: _text_size(a["value"], limit) + _count(a["value"]) * _text_size(a["d"], limit),
    "format": lambda a, limit: _percent_size(str(a["value"]), a["kwargs"] or a["args"], limit),
    "tojson": lambda a, limit: _text_size(a["value"], limit, _width(a["indent"])),
    "batch": lambda a, limit: _ITEM * _int(a["linecount"]) if a["fill_with"] is not None else 0,
    "slice": lambda a, limit: _ITEM * _int(a["slices"]),
    "sum": _summed_size,
}


__all__ = ["MAX_CALL_DEPTH", "MAX_RENDERED_CHARS", "WORK_FACTOR", "Budget", "bounded_filter", "bounded_sandbox",
           "render_within", "written_value"]
