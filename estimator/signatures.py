"""Argument signatures: what distinguishes one invocation of a tool from another.

``bash`` runs both ``ls`` and ``pytest``; keying durations by a signature of the
arguments separates them. A signature is derived only where the arguments name a
command, since only a program's name says how long a call will take:

* a tool of :data:`COMMAND_TOOLS` (``bash``, ``execute_bash``, ``run_shell_command`` ...)
  gives the first word of each sub-command of its command line, or of the command its
  JSON arguments name under ``command`` / ``cmd`` (:func:`command_signature`);
* any other tool gives a signature only when its JSON arguments name a command that way
  (:func:`default_signature`): a search query, a grep pattern or a code fragment is free
  text, and would split the tool's samples into groups that mean nothing;
* an operator's rule (``--signature-rule TOOL=command|none|keys|regex:PATTERN``,
  :class:`SignatureRule`) overrides both for its tool.

A :class:`SignatureRegistry` holds the rules; the control plane and the engine hook both
ask one, built from the same rules, so their signatures agree.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from itertools import chain

__all__ = [
    "COMMAND_TOOLS",
    "RegexSignature",
    "SignatureExtractor",
    "SignatureRegistry",
    "SignatureRule",
    "argv_signature",
    "command_signature",
    "default_signature",
    "is_command_tool",
    "json_depth",
    "json_object",
    "json_signature",
    "parse_rules",
    "readable_rules",
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
# The opening of a JSON object: a brace, then a key's quote or the closing brace.
_JSON_OPENING = re.compile(r'\s*\{\s*["}]')
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


def json_object(args: str) -> dict[str, object] | None:
    """``args`` parsed as a JSON object, or None: not an object, not JSON, or nested deeper
    than ``MAX_JSON_DEPTH`` (checked first, in one linear pass).

    >>> json_object('{"command": "ls"}'), json_object("ls -la"), json_object("[1]")
    ({'command': 'ls'}, None, None)
    """
    if not args.lstrip().startswith("{") or json_depth(args, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        return None
    try:
        parsed = json.loads(args)
    except (ValueError, TypeError):  # JSONDecodeError, or an integer too long to convert
        return None
    return parsed if isinstance(parsed, dict) else None


def argv_signature(argv: list[str]) -> str:
    """The program of an argument vector; a shell's ``-c`` script is read as a command line
    (OpenAI Codex's ``shell`` tool sends ``["bash", "-lc", "pytest -x"]``).

    >>> argv_signature(["bash", "-lc", "cd src && pytest -x"]), argv_signature(["/bin/ls", "-l"])
    ('cd+pytest', 'ls')
    """
    program = argv[0].rsplit("/", 1)[-1] if argv else ""
    if program in SHELLS:
        for i, word in enumerate(argv[1:-1], 1):
            if word.startswith("-") and not word.startswith("--") and "c" in word:
                return shell_signature(program, argv[i + 1])
    return program[:MAX_SIGNATURE_CHARS]


def _named_command(arguments: Mapping[str, object]) -> str:
    """The signature of the command an object of arguments names under one of
    ``COMMAND_KEYS`` (a command line, or an argument vector); ``""`` if it names none."""
    for key in COMMAND_KEYS:
        value = arguments.get(key)
        if isinstance(value, str):
            return shell_signature("", value)
        if isinstance(value, list) and value and all(isinstance(w, str) for w in value):
            return argv_signature(value)
    return ""


def command_signature(tool: str, args: str) -> str:
    """The signature of a call whose arguments are a command: JSON arguments give the
    command named under ``command`` or ``cmd`` (nothing if neither is there); anything
    else is the command line itself (:func:`shell_signature`).

    >>> command_signature("bash", "cd repo && pytest -x")
    'cd+pytest'
    >>> command_signature("execute_bash", '{"command": "git status", "timeout": 30}')
    'git'
    >>> command_signature("bash", '{"restart": true}'), command_signature("bash", "ls -la")
    ('', 'ls')
    """
    if _JSON_OPENING.match(args) is None:  # a command line (a brace group is one too)
        return shell_signature(tool, args)
    arguments = json_object(args)
    return "" if arguments is None else _named_command(arguments)


def default_signature(tool: str, args: str) -> str:
    """The signature of a call of a tool that is not a command tool and has no rule: the
    command its JSON arguments name under ``command`` or ``cmd``, else none. Free text
    (a search query, a grep pattern, a code fragment) never becomes a signature.

    >>> default_signature("web_search", "python decimal rounding")
    ''
    >>> default_signature("grep", '{"pattern": "def count_stock", "path": "src"}')
    ''
    >>> default_signature("str_replace_editor", '{"command": "view", "path": "/x"}')
    'view'
    """
    arguments = json_object(args)
    return "" if arguments is None else _named_command(arguments)


def auto_signature(tool: str, args: str) -> str:
    """The rule of earlier releases, kept so that their stored model snapshots still load
    (their models are then learned again, ``SignatureRegistry.key``): JSON objects gave
    their sorted keys, anything else was read as a command line.

    >>> auto_signature("web_search", "python decimal rounding")
    'python'
    """
    if args.lstrip().startswith("{"):
        return json_signature(tool, args)
    return shell_signature(tool, args)


def no_signature(tool: str, args: str) -> str:
    """No signature: every call of the tool shares the tool's model."""
    return ""


class RegexSignature:
    """The text a regular expression finds in the arguments (its first group if it has
    one, else the whole match); no match, no signature. A rule's operator writes the
    pattern: it runs on every call of the tool, so it should not backtrack badly.

    >>> RegexSignature("--suite[= ]([a-z]+)")("runner", "runner --suite unit -v")
    'unit'
    >>> RegexSignature("^[a-z]+")("sql", "  SELECT 1")
    ''
    """

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self._regex = re.compile(pattern)

    def __call__(self, tool: str, args: str) -> str:
        found = self._regex.search(args)
        if found is None:
            return ""
        value = found.group(1) if self._regex.groups else found.group(0)
        return (value or "")[:MAX_SIGNATURE_CHARS]

    def __repr__(self) -> str:
        return f"RegexSignature({self.pattern!r})"


#: A rule's kinds and the extractor each gives (``regex`` takes its pattern).
RULE_KINDS: dict[str, SignatureExtractor] = {
    "command": command_signature,
    "keys": json_signature,
    "none": no_signature,
}


@dataclass(frozen=True, slots=True)
class SignatureRule:
    """How one tool's calls get their signature, written ``TOOL=KIND`` (the
    ``--signature-rule`` flag of ``cachettl serve``):

    * ``command``: the arguments are a command (:func:`command_signature`);
    * ``none``: no signature;
    * ``keys``: the sorted keys of JSON arguments (:func:`json_signature`);
    * ``regex:PATTERN``: what ``PATTERN`` finds in the arguments (:class:`RegexSignature`).

    >>> rule = SignatureRule.parse("run_tests=regex:--suite ([a-z]+)")
    >>> rule.tool, rule.kind, rule.pattern, str(rule)
    ('run_tests', 'regex', '--suite ([a-z]+)', 'run_tests=regex:--suite ([a-z]+)')
    >>> SignatureRule.parse("python=shell")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: signature rule 'python=shell': the kind must be command, ... got 'shell'
    """

    tool: str
    kind: str
    pattern: str = ""

    @classmethod
    def parse(cls, text: str) -> SignatureRule:
        """The rule ``TOOL=KIND`` (``KIND``: ``command``, ``none``, ``keys`` or
        ``regex:PATTERN``); ValueError naming the rule and what is wrong with it."""
        tool, sep, kind = text.partition("=")
        where = f"signature rule {text!r}"
        if not sep or not tool.strip():
            raise ValueError(f"{where}: must be TOOL=KIND, e.g. run_tests=command")
        if tool != tool.strip() or not tool.isprintable():
            raise ValueError(f"{where}: the tool name has blanks around it or unprintable text")
        if kind.startswith("regex:"):
            pattern = kind.removeprefix("regex:")
            if not pattern:
                raise ValueError(f"{where}: regex: needs a pattern")
            try:
                re.compile(pattern)
            except re.error as error:
                raise ValueError(f"{where}: the pattern does not compile: {error}") from None
            return cls(tool, "regex", pattern)
        if kind not in RULE_KINDS:
            raise ValueError(
                f"{where}: the kind must be command, keys, none or regex:PATTERN, got {kind!r}"
            )
        return cls(tool, kind)

    def extractor(self) -> SignatureExtractor:
        return RegexSignature(self.pattern) if self.kind == "regex" else RULE_KINDS[self.kind]

    def __str__(self) -> str:
        return f"{self.tool}={self.kind}" + (f":{self.pattern}" if self.kind == "regex" else "")


def parse_rules(texts: Iterable[str]) -> tuple[SignatureRule, ...]:
    """Rules from their texts; ValueError naming the first bad one, or a tool given two.

    >>> [str(r) for r in parse_rules(["a=none", "b=command"])]
    ['a=none', 'b=command']
    """
    rules: dict[str, SignatureRule] = {}
    for text in texts:
        rule = SignatureRule.parse(text)
        if rule.tool in rules:
            raise ValueError(
                f"signature rule {text!r}: tool {rule.tool!r} already has rule "
                f"{str(rules[rule.tool])!r}"
            )
        rules[rule.tool] = rule
    return tuple(rules.values())


def readable_rules(texts: Iterable[str]) -> tuple[SignatureRule, ...]:
    """The rules of ``texts`` this release can read, the first of each tool: what an
    engine applies of the rules its control plane sends (a newer server's kind of rule
    is skipped, and the tool keeps the built-in rule).

    >>> [str(r) for r in readable_rules(["a=none", "b=future", "a=command"])]
    ['a=none']
    """
    rules: dict[str, SignatureRule] = {}
    for text in texts:
        try:
            rule = SignatureRule.parse(text)
        except ValueError:
            continue
        rules.setdefault(rule.tool, rule)
    return tuple(rules.values())


#: Tools whose arguments are a command line (or JSON naming one under ``command``), as the
#: agents of the field name them: mini-swe-agent and SWE-agent ``bash``, OpenHands
#: ``execute_bash``, Claude Code ``Bash``, Gemini CLI ``run_shell_command``, Cursor
#: ``run_terminal_cmd``, OpenAI Codex ``shell`` / ``local_shell``. Matched ignoring case,
#: with ``-`` read as ``_``.
COMMAND_TOOLS = frozenset(
    {
        "bash",
        "sh",
        "zsh",
        "shell",
        "terminal",
        "powershell",
        "cmd",
        "exec",
        "execute",
        "run",
        "run_bash",
        "run_command",
        "run_shell",
        "run_shell_command",
        "run_terminal_cmd",
        "execute_bash",
        "execute_command",
        "execute_shell",
        "shell_command",
        "bash_command",
        "local_shell",
        "container_exec",
    }
)
#: The former name of :data:`COMMAND_TOOLS`.
SHELL_TOOLS = COMMAND_TOOLS
#: Keys under which JSON arguments name a command.
COMMAND_KEYS = ("command", "cmd")
#: Programs whose ``-c`` argument is a script (:func:`argv_signature`).
SHELLS = frozenset({"bash", "sh", "zsh", "dash", "ksh", "fish"})

#: The version of the built-in rules above; models learned under other rules (version 1:
#: every argument read as a command line) are not reused, the log is learned again.
RULES_VERSION = 2


def is_command_tool(tool: str) -> bool:
    """Whether ``tool`` is one of :data:`COMMAND_TOOLS` (any case, ``-`` as ``_``).

    >>> is_command_tool("Bash"), is_command_tool("run-terminal-cmd"), is_command_tool("grep")
    (True, True, False)
    """
    return tool.casefold().replace("-", "_") in COMMAND_TOOLS


class SignatureRegistry:
    """Which extractor gives each tool's signatures: the tool's own, if it has one (an
    extractor given in code, which an operator's rule for the tool replaces, and which
    :meth:`register` replaces in turn), else :func:`command_signature` for
    :data:`COMMAND_TOOLS`, else ``default`` (:func:`default_signature`).

    >>> registry = SignatureRegistry(rules=parse_rules(["web_search=keys"]))
    >>> registry.signature("bash", "git diff | head"), registry.signature("grep", "def x")
    ('git+head', '')
    >>> registry.signature("web_search", '{"q": 1}')
    'web_search(q)'
    >>> registry.register("grep", lambda tool, args: "fixed")
    >>> registry.signature("grep", "def x")
    'fixed'
    """

    def __init__(
        self,
        extractors: Mapping[str, SignatureExtractor] | None = None,
        default: SignatureExtractor = default_signature,
        rules: Iterable[SignatureRule] = (),
    ) -> None:
        #: The operator's rules (``--signature-rule``), part of :attr:`key`.
        self.rules = tuple(rules)
        self.version = RULES_VERSION
        self._extractors: dict[str, SignatureExtractor] = dict(extractors or {})
        self._extractors.update((rule.tool, rule.extractor()) for rule in self.rules)
        self._default = default
        # Agents repeat the same calls: remember recent signatures (parsing costs ~10 µs).
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()

    @property
    def key(self) -> tuple[int, tuple[str, ...]]:
        """What the signatures depend on, beyond extractors registered in code: the
        built-in rules' version and the operator's rules. Models are reusable only by a
        registry of the same key."""
        return (self.version, tuple(str(rule) for rule in self.rules))

    def register(self, tool: str, extractor: SignatureExtractor) -> None:
        """Use ``extractor`` for ``tool`` from now on."""
        self._extractors[tool] = extractor
        self._cache.clear()

    def _extractor(self, tool: str) -> SignatureExtractor:
        found = self._extractors.get(tool)
        if found is not None:
            return found
        return command_signature if is_command_tool(tool) else self._default

    def compute(self, tool: str, args: str | None) -> str:
        """:meth:`signature` that only reads the cache, never changes it (so safe from any
        thread, at any time, while another thread uses :meth:`signature`)."""
        if not args:
            return ""
        cached = self._cache.get((tool, args))  # one atomic dict lookup
        if cached is not None:
            return cached
        return self._extractor(tool)(tool, args)

    def signature(self, tool: str, args: str | None) -> str:
        """The signature of one call; ``""`` when there is none (no arguments, or none
        that name a command)."""
        if not args:
            return ""
        key = (tool, args)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return cached
        signature = self._extractor(tool)(tool, args)
        if len(args) > CACHE_MAX_ARGS_CHARS:
            return signature
        self._cache[key] = signature
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return signature

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_cache": OrderedDict()}  # a cache, not state

    def __setstate__(self, state: dict[str, object]) -> None:
        # A registry pickled before rules existed read every argument as a command line.
        state.setdefault("rules", ())
        state.setdefault("version", 1)
        self.__dict__.update(state)
