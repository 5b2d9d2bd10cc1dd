"""Argument signatures: what distinguishes one invocation of a tool from another.

``bash`` runs both ``ls`` and ``pytest``; keying durations by a signature of the
arguments separates them. Extractors are pluggable: any callable ``(tool, args) -> str``
registered under a tool name (or as the default) in a :class:`SignatureRegistry`.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from itertools import chain

__all__ = [
    "SignatureExtractor",
    "SignatureRegistry",
    "auto_signature",
    "json_depth",
    "json_signature",
    "shell_signature",
]

SignatureExtractor = Callable[[str, str], str]

#: Longest signature kept; longer ones are cut (they would only fragment statistics).
MAX_SIGNATURE_CHARS = 128

#: Recent (tool, args) → signature results a registry remembers.
CACHE_SIZE = 4096

#: JSON arguments nested deeper than this are not parsed (the signature is the tool name).
MAX_JSON_DEPTH = 64

#: Arguments longer than this are not remembered by a registry's cache.
CACHE_MAX_ARGS_CHARS = 8192

# Sub-command separators, a run of them (with the blanks after each) taken as one.
_SHELL_SPLIT = re.compile(r"(?:&&|\|\||[;|\n])[;|\s]*(?:&&[;|\s]*)*")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# One POSIX shell word: plain characters, backslash escapes, '...' and "..." pieces.
_WORD = re.compile(r"""\s*((?:[^\s'"\\]+|\\.|'[^']*'|"[^"\\]*(?:\\.[^"\\]*)*")+)""", re.DOTALL)
_PIECE = re.compile(r"""'([^']*)'|"([^"\\]*(?:\\.[^"\\]*)*)"|\\(.)|([^'"\\]+)""", re.DOTALL)
_DQ_ESCAPE = re.compile(r"""\\([\\"])""")
_LOOSE_WORD = re.compile(r"\s*(\S+)")
# A sub-command whose quotes all close (possessive: fails in linear time, no backtracking).
_BALANCED = re.compile(r"""(?:[^'"\\]++|\\.|'[^']*+'|"[^"\\]*+(?:\\.[^"\\]*+)*+")*+""", re.DOTALL)
_BLANK = re.compile(r"\s*")
# A JSON string (skipped whole) or one bracket.
_JSON_STRUCTURE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)


def _unquote(word: str) -> str:
    """A shell word without its quotes and escapes (as ``shlex`` in POSIX mode reads it)."""
    out = []
    for m in _PIECE.finditer(word):
        single, double, escaped, plain = m.groups()
        if plain is not None:
            out.append(plain)
        elif single is not None:
            out.append(single)
        elif escaped is not None:
            out.append(escaped)
        else:
            out.append(_DQ_ESCAPE.sub(r"\1", double))
    return "".join(out)


def _loose_first_word(args: str, pos: int, end: int) -> str:
    """First non-assignment word of ``args[pos:end]`` split on blanks only."""
    while m := _LOOSE_WORD.match(args, pos, end):
        if not _ASSIGNMENT.match(m.group(1)):
            return m.group(1)
        pos = m.end()
    return ""


def _first_word(args: str, start: int, end: int) -> str:
    """First word of the sub-command ``args[start:end]`` that is not an assignment.

    A quote left open (or a trailing backslash) anywhere in the sub-command makes it be
    split on blanks instead, as ``shlex`` failing would.
    """
    if _BALANCED.fullmatch(args, start, end) is None:
        return _loose_first_word(args, start, end)
    pos = start
    while True:
        m = _WORD.match(args, pos, end)
        if m is None or (m.end() < end and not args[m.end()].isspace()):
            if _BLANK.match(args, pos, end).end() == end:  # type: ignore[union-attr]
                return ""
            return _loose_first_word(args, start, end)
        word = _unquote(m.group(1))
        if not _ASSIGNMENT.match(word):
            return word
        pos = m.end()


def shell_signature(tool: str, args: str) -> str:
    """First word of each sub-command of a shell command line, joined by ``+``.

    Sub-commands are split on ``&&``, ``||``, ``;``, ``|`` and newlines; leading
    environment assignments (``FOO=1 pytest``) and paths (``/usr/bin/python``) are
    dropped so that equivalent invocations share a key. Words are read with POSIX
    quoting. Linear in the length of ``args`` (one pass, stopping once the signature is
    ``MAX_SIGNATURE_CHARS`` long).

    >>> shell_signature("bash", "cd repo && pytest -x")
    'cd+pytest'
    >>> shell_signature("bash", "FOO=1 /usr/bin/python -m x | grep ok; ls")
    'python+grep+ls'
    >>> shell_signature("bash", "'my tool' --x;;; 'unbalanced quote")
    "my tool+'unbalanced"
    >>> shell_signature("bash", "")
    ''
    """
    words: list[str] = []
    length = 0
    start = 0
    for separator in chain(_SHELL_SPLIT.finditer(args), (None,)):
        end = len(args) if separator is None else separator.start()
        word = _first_word(args, start, end) if end > start else ""
        if word:
            word = word.rsplit("/", 1)[-1][: MAX_SIGNATURE_CHARS + 1]
            words.append(word)
            length += len(word) + 1
            if length > MAX_SIGNATURE_CHARS:
                break
        if separator is not None:
            start = separator.end()
    return "+".join(words)[:MAX_SIGNATURE_CHARS]


def json_depth(text: str, limit: int) -> int:
    """Deepest nesting of JSON arrays and objects in ``text``, counted up to ``limit + 1``
    (one linear pass; strings are skipped whole; no recursion).

    >>> json_depth('{"a": [1, {"b": "]]]"}]}', 10), json_depth("[" * 1000, 5)
    (3, 6)
    """
    depth = deepest = 0
    for m in _JSON_STRUCTURE.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > limit:
                    break
        elif c in "]}":
            depth -= 1
    return deepest


def json_signature(tool: str, args: str) -> str:
    """Tool name plus the sorted keys of a JSON-object argument string.

    Anything that is not a JSON object, or is nested deeper than ``MAX_JSON_DEPTH``,
    gives the tool name alone.

    >>> json_signature("web_search", '{"query": "vllm", "max_results": 5}')
    'web_search(max_results,query)'
    >>> json_signature("web_search", "not json")
    'web_search'
    >>> json_signature("search", '{"a":' + '[' * 4000)
    'search'
    """
    if json_depth(args, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        return tool[:MAX_SIGNATURE_CHARS]
    try:
        parsed = json.loads(args)
    except (ValueError, TypeError):  # JSONDecodeError, or an integer too long to convert
        return tool[:MAX_SIGNATURE_CHARS]
    if not isinstance(parsed, Mapping):
        return tool[:MAX_SIGNATURE_CHARS]
    return f"{tool}({','.join(sorted(str(k) for k in parsed))})"[:MAX_SIGNATURE_CHARS]


def auto_signature(tool: str, args: str) -> str:
    """JSON-object arguments give :func:`json_signature`; anything else is read as a shell
    command line (:func:`shell_signature`). The default for tools not registered.

    >>> auto_signature("search", '{"q": "x"}')
    'search(q)'
    >>> auto_signature("run", "cd src && make test")
    'cd+make'
    """
    if args.lstrip().startswith("{"):
        return json_signature(tool, args)
    return shell_signature(tool, args)


#: Tools whose argument string is a shell command line.
SHELL_TOOLS = ("bash", "sh", "shell", "terminal", "run_command", "execute_bash")


class SignatureRegistry:
    """Maps tool names to signature extractors, with a default for the rest.

    >>> registry = SignatureRegistry()
    >>> registry.signature("bash", "git diff | head")
    'git+head'
    >>> registry.signature("search", '{"q": 1}')
    'search(q)'
    >>> registry.register("search", lambda tool, args: "fixed")
    >>> registry.signature("search", '{"q": 1}')
    'fixed'
    """

    def __init__(
        self,
        extractors: Mapping[str, SignatureExtractor] | None = None,
        default: SignatureExtractor = auto_signature,
    ) -> None:
        self._extractors: dict[str, SignatureExtractor] = dict.fromkeys(
            SHELL_TOOLS, shell_signature
        )
        self._extractors.update(extractors or {})
        self._default = default
        # Agents repeat the same calls: remember recent signatures (parsing costs ~10 µs).
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()

    def register(self, tool: str, extractor: SignatureExtractor) -> None:
        """Use ``extractor`` for ``tool`` from now on."""
        self._extractors[tool] = extractor
        self._cache.clear()

    def compute(self, tool: str, args: str | None) -> str:
        """:meth:`signature` that only reads the cache, never changes it (so safe from any
        thread, at any time, while another thread uses :meth:`signature`)."""
        if not args:
            return ""
        cached = self._cache.get((tool, args))  # one atomic dict lookup
        if cached is not None:
            return cached
        return self._extractors.get(tool, self._default)(tool, args)

    def signature(self, tool: str, args: str | None) -> str:
        """The signature of one call; ``""`` when there are no arguments."""
        if not args:
            return ""
        key = (tool, args)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        signature = self._extractors.get(tool, self._default)(tool, args)
        if len(args) > CACHE_MAX_ARGS_CHARS:
            return signature
        self._cache[key] = signature
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return signature

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_cache": OrderedDict()}  # a cache, not state
