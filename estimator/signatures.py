"""Argument signatures: what distinguishes one invocation of a tool from another.

``bash`` runs both ``ls`` and ``pytest``; keying durations by a signature of the
arguments separates them. Extractors are pluggable: any callable ``(tool, args) -> str``
registered under a tool name (or as the default) in a :class:`SignatureRegistry`.
"""

from __future__ import annotations

import json
import re
import shlex
from collections import OrderedDict
from collections.abc import Callable, Mapping

__all__ = [
    "SignatureExtractor",
    "SignatureRegistry",
    "auto_signature",
    "json_signature",
    "shell_signature",
]

SignatureExtractor = Callable[[str, str], str]

#: Longest signature kept; longer ones are cut (they would only fragment statistics).
MAX_SIGNATURE_CHARS = 128

#: Recent (tool, args) → signature results a registry remembers.
CACHE_SIZE = 4096

_SHELL_SPLIT = re.compile(r"&&|\|\||;|\||\n")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def shell_signature(tool: str, args: str) -> str:
    """First word of each sub-command of a shell command line, joined by ``+``.

    Sub-commands are split on ``&&``, ``||``, ``;``, ``|`` and newlines; leading
    environment assignments (``FOO=1 pytest``) and paths (``/usr/bin/python``) are
    dropped so that equivalent invocations share a key.

    >>> shell_signature("bash", "cd repo && pytest -x")
    'cd+pytest'
    >>> shell_signature("bash", "FOO=1 /usr/bin/python -m x | grep ok; ls")
    'python+grep+ls'
    >>> shell_signature("bash", "")
    ''
    """
    words: list[str] = []
    for part in _SHELL_SPLIT.split(args):
        try:
            tokens = shlex.split(part, posix=True)
        except ValueError:  # unbalanced quotes: fall back to whitespace
            tokens = part.split()
        tokens = [t for t in tokens if not _ASSIGNMENT.match(t)]
        if tokens:
            words.append(tokens[0].rsplit("/", 1)[-1])
    return "+".join(words)[:MAX_SIGNATURE_CHARS]


def json_signature(tool: str, args: str) -> str:
    """Tool name plus the sorted keys of a JSON-object argument string.

    >>> json_signature("web_search", '{"query": "vllm", "max_results": 5}')
    'web_search(max_results,query)'
    >>> json_signature("web_search", "not json")
    'web_search'
    """
    try:
        parsed = json.loads(args)
    except (json.JSONDecodeError, TypeError):
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
        self._cache[key] = signature
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return signature

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_cache": OrderedDict()}  # a cache, not state
