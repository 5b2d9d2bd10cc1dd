"""Reference pages generated from the code at build time, so they cannot drift from it.

Registered as an MkDocs hook in ``mkdocs.yml``; at ``on_files`` it adds

- ``reference/configuration.md``: every key of the engine hook's ``--additional-config``
  (:class:`enginehook.config.HookConfig` and
  :class:`enginehook.core.rules.SchedulingRules`), the TTL policies' ``policy_params``
  (:data:`estimator.POLICIES`), every simulator policy's parameters
  (:data:`simulator.policies.POLICIES`) and the flags of ``cachettl serve`` (its argparse
  parser), each with its default and meaning;
- ``reference/grpc.md``: every service, RPC, message, field and enum of
  ``proto/cachettl/v1/*.proto`` with the comments written in the ``.proto`` files, read by
  ``protoc`` (grpcio-tools) with source info;
- every file of ``results/`` under ``results/``, so that pages link the figures and their
  notes where the commands wrote them.

The page builders are plain functions (``configuration_markdown``, ``grpc_markdown``) that
the tests call too. Nothing here is copied by hand into ``docs/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import inspect
import json
import math
import re
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # mkdocs may run from anywhere; the packages live at the root
    sys.path.insert(0, str(ROOT))

CONFIGURATION_PAGE = "reference/configuration.md"
GRPC_PAGE = "reference/grpc.md"
RESULTS = ROOT / "results"

_GENERATED = (
    "<!-- Generated at build time by docs/hooks/reference.py from the code; "
    "do not edit: change the code it reads. -->\n\n"
)


# -- formatting ---------------------------------------------------------------------------
def default_text(value: Any) -> str:
    """A default as a user writes it in JSON or a policy spec: ``true``, ``inf``, ``running``,
    ``unset``.

    >>> default_text(True), default_text(math.inf), default_text(None), default_text(0.25)
    ('true', 'inf', 'unset', '0.25')
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "unset"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return f"{value:g}"
    if isinstance(value, dict | list | tuple):
        return json.dumps(value)
    return str(value)


def _cell(text: str) -> str:
    """Table-cell text: one line, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def _table(rows: Iterable[tuple[str, str, str]]) -> str:
    lines = ["| key | default | meaning |", "|---|---|---|"]
    lines += [f"| `{k}` | `{_cell(d)}` | {_cell(m)} |" for k, d, m in rows]
    return "\n".join(lines) + "\n"


# -- the engine hook's settings -------------------------------------------------------------
_SEGMENT = re.compile(r"((?:``\w+``(?:\s*/\s*|,\s*|\s+and\s+|\s*\(\w[^)]*\)\s*)?)+):")


def docstring_meanings(doc: str, keys: Iterable[str]) -> dict[str, str]:
    """Each key's meaning in a docstring written as ````key````: text (or
    ````a```` / ````b````: text for keys explained together): the text of the segment that
    names the key first, up to the next such segment.

    >>> docstring_meanings("Intro.\\n\\n``a``: first. ``b`` / ``c``: second.", "abc")
    {'a': 'first.', 'b': 'second.', 'c': 'second.'}
    """
    body = " ".join(doc.split())
    starts = [m for m in _SEGMENT.finditer(body) if m.start() == 0 or body[m.start() - 2] in ".:"]
    meanings: dict[str, str] = {}
    for i, match in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(body)
        text = body[match.end() : end].strip()
        for key in re.findall(r"``(\w+)``", match.group(1)):
            meanings.setdefault(key, text)
    for key in keys:  # a key mentioned only inside another's text: that text
        if key not in meanings:
            for i, match in enumerate(starts):
                end = starts[i + 1].start() if i + 1 < len(starts) else len(body)
                if f"``{key}``" in body[match.start() : end]:
                    meanings[key] = body[match.start() : end].strip()
                    break
    return {k: meanings[k] for k in keys if k in meanings}


def _rst_to_md(text: str, constants: dict[str, Any] | None = None) -> str:
    """Docstring markup as Markdown: ``x`` → `x`, :class:`~a.b.C` → `C`, and
    :data:`NAME` of an environment-variable constant → `$VALUE`.

    >>> _rst_to_md(":data:`TOKEN_ENV` or ``token``", {"TOKEN_ENV": "CACHETTL_TOKEN"})
    '`$CACHETTL_TOKEN` or `token`'
    """
    constants = constants or {}

    def name(match: re.Match[str]) -> str:
        short = match.group(1).rsplit(".", 1)[-1]
        value = constants.get(short)
        return f"`${value}`" if isinstance(value, str) and short.endswith("_ENV") else f"`{short}`"

    text = re.sub(r":\w+:`~?([^`]+)`", name, text)
    return text.replace("``", "`")


def hook_rows() -> list[tuple[str, str, str]]:
    """``(key, default, meaning)`` of every key ``additional_config.cachettl`` accepts."""
    from enginehook import config as config_module
    from enginehook.config import HookConfig
    from enginehook.core.rules import SchedulingRules

    own = [f for f in dataclasses.fields(HookConfig) if f.name != "rules"]
    meanings = docstring_meanings(HookConfig.__doc__ or "", [f.name for f in own])
    defaults = HookConfig()
    rows = []
    for f in own:
        value = getattr(defaults, f.name)
        if f.name == "token":
            value = "" if value == "" else "(from token_file or $CACHETTL_TOKEN)"
        meaning = _rst_to_md(meanings.get(f.name, ""), vars(config_module))
        if not meaning:
            raise ValueError(f"HookConfig.{f.name} has no meaning in HookConfig's docstring")
        rows.append((f.name, _empty(default_text(value)), meaning))
    rules = SchedulingRules()
    helps = SchedulingRules.help()
    rows += [(n, default_text(getattr(rules, n)), helps[n]) for n in SchedulingRules.names()]
    if [r[0] for r in rows] != HookConfig.keys():
        raise ValueError("the reference does not list HookConfig.keys() in order")
    return rows


def _empty(text: str) -> str:
    return text if text != "" else "(empty)"


def estimator_policy_rows() -> list[tuple[str, list[tuple[str, str]], str]]:
    """``(policy, [(param, default)], description)`` of every TTL policy of the estimator."""
    from estimator import POLICIES

    out = []
    for name in sorted(POLICIES):
        cls = POLICIES[name]
        params = [
            (p.name, default_text(p.default))
            for p in inspect.signature(cls.__init__).parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]
        doc = (cls.__doc__ or "").split("\n\n")[0]
        out.append((name, params, _rst_to_md(" ".join(doc.split()))))
    return out


def simulator_policy_rows() -> list[tuple[str, str, list[tuple[str, str, str]]]]:
    """``(policy, help, [(param, default, help)])`` of every simulator policy."""
    from simulator.policies import POLICIES

    return [
        (
            name,
            cls.help,
            [(k, default_text(p.default), p.help) for k, p in cls.PARAMS.items()],
        )
        for name, cls in POLICIES.items()
    ]


def serve_rows() -> list[tuple[str, str, str]]:
    """``(flag, default, help)`` of ``cachettl serve``."""
    from controlplane.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    serve = sub.choices["serve"]
    rows = []
    for action in serve._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = max(action.option_strings, key=len)
        default = "unset" if action.default in (None, argparse.SUPPRESS) else action.default
        rows.append((flag, default_text(default), action.help or ""))
    return rows


def config_file_rows() -> list[tuple[str, str, str]]:
    """``(key, TOML type, flag)`` of every key of ``cachettl serve --config FILE``."""
    from controlplane.cli import build_parser
    from controlplane.cli.configfile import config_keys, key_kind

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    keys = config_keys(sub.choices["serve"])
    return [(key, key_kind(action), f"--{key}") for key, action in keys.items()]


def configuration_markdown() -> str:
    """The configuration reference page."""
    parts = [
        "# Configuration reference\n\n",
        _GENERATED,
        "Every setting, its default and its meaning, read from the registries that define "
        "them: the engine hook's `HookConfig` and `SchedulingRules` "
        "(`enginehook/config.py`, `enginehook/core/rules.py`), the estimator's TTL "
        "policies, the simulator's policies and the `cachettl serve` command line. "
        "[Concepts](../concepts.md) explains the terms.\n\n",
        "## Engine hook\n\n",
        "All keys go under `cachettl` in vLLM's `--additional-config` and are optional; an "
        "unknown key stops the engine with an error that lists the valid ones. The scheduling "
        "rules (from `pressure` on) are the same names the simulator's policies take.\n\n",
        _table(hook_rows()),
        "\n## TTL policies (`policy`, `policy_params`)\n\n",
        "`policy` names one of these; `policy_params` passes its parameters as a JSON object "
        '(`"policy_params": {"ttl_s": 30}`).\n\n',
    ]
    for name, params, doc in estimator_policy_rows():
        parts.append(f"### `{name}`\n\n{doc}\n\n")
        if params:
            parts.append("| parameter | default |\n|---|---|\n")
            parts += [f"| `{p}` | `{d}` |\n" for p, d in params]
            parts.append("\n")
        else:
            parts.append("No parameters.\n\n")
    parts += [
        "## Simulator policies\n\n",
        "`cachettl simulate --policy NAME` and every `cachettl bench` take these names; "
        "parameters are given as `NAME(key=value,...)`, for example "
        "`cachettl(first_turn_over_pins=0,ttl_cap_s=60)`. Defaults differ between policies "
        "(each starts from its own rules).\n\n",
    ]
    for name, help_, params in simulator_policy_rows():
        parts.append(f"### `{name}`\n\n{help_}\n\n")
        parts.append(_table(params) if params else "No parameters.\n")
        parts.append("\n")
    parts += [
        "## Control plane: `cachettl serve`\n\n",
        "The server's flags (`cachettl serve --help`).\n\n",
        _table(serve_rows()),
        "\n### Configuration file (`cachettl serve --config FILE`)\n\n",
        "A TOML file whose keys are the flags above without their dashes, one key per flag "
        "(`max-concurrent-rpcs = 512`; no tables). A flag on the command line overrides the "
        "file, and so do `$CACHETTL_DB` (for `db`) and `$CACHETTL_CONSOLE_ADMIN_TOKEN` (for "
        "`console-admin-token-file`); a key the file leaves out keeps the flag's default. An "
        "unknown key, a value of the wrong type or a file that is not TOML stops the server "
        "with one line naming the file and the key. A key of type *string or number* is read "
        'by the flag\'s own parser (an age: `"7d"`, `"12h"` or seconds).\n\n',
        "| key | type | flag |\n|---|---|---|\n",
        *(f"| `{k}` | {_cell(t)} | `{f}` |\n" for k, t, f in config_file_rows()),
    ]
    return "".join(parts)


# -- the gRPC reference ----------------------------------------------------------------------
_FIELD_TYPES = {
    1: "double",
    2: "float",
    3: "int64",
    4: "uint64",
    5: "int32",
    8: "bool",
    9: "string",
    12: "bytes",
    13: "uint32",
    17: "sint32",
    18: "sint64",
}


def proto_descriptors(proto_dir: Path = ROOT / "proto") -> Any:
    """The ``FileDescriptorSet`` of ``proto/cachettl/v1/*.proto`` with source info (comments),
    compiled by grpcio-tools' protoc."""
    import grpc_tools
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    files = sorted(str(p.relative_to(proto_dir)) for p in proto_dir.glob("cachettl/v1/*.proto"))
    include = str(Path(grpc_tools.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "set.pb"
        code = protoc.main(
            [
                "protoc",
                f"-I{proto_dir}",
                f"-I{include}",
                "--include_source_info",
                f"--descriptor_set_out={out}",
                *files,
            ]
        )
        if code != 0:
            raise RuntimeError(f"protoc failed ({code}) on {files}")
        descriptors = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return descriptors


def _comments(file: Any) -> dict[tuple[int, ...], str]:
    found = {}
    for location in file.source_code_info.location:
        text = (location.leading_comments or location.trailing_comments).strip()
        if text:
            found[tuple(location.path)] = " ".join(line.strip() for line in text.splitlines())
    return found


def _anchor(name: str) -> str:
    return name.lower()


def _type_name(field: Any) -> str:
    if field.type_name:
        name = field.type_name.lstrip(".")
        if name.startswith("cachettl.v1."):
            short = name.removeprefix("cachettl.v1.")
            return f"[`{short}`](#{_anchor(short.replace('.', ''))})"
        return f"`{name}`"
    return f"`{_FIELD_TYPES.get(field.type, str(field.type))}`"


def _message(
    lines: list[str], message: Any, path: tuple[int, ...], notes: dict[Any, str], prefix: str
) -> None:
    name = prefix + message.name
    lines.append(f"### {name} {{#{_anchor(name.replace('.', ''))}}}\n\n")
    if notes.get(path):
        lines.append(f"{notes[path]}\n\n")
    if message.field:
        lines.append("| field | number | type | meaning |\n|---|---|---|---|\n")
        for i, field in enumerate(message.field):
            kind = _type_name(field)
            if field.label == 3:
                kind = f"repeated {kind}"
            elif field.proto3_optional:
                kind = f"optional {kind}"
            note = _cell(notes.get((*path, 2, i), ""))
            lines.append(f"| `{field.name}` | {field.number} | {kind} | {note} |\n")
        lines.append("\n")
    else:
        lines.append("No fields.\n\n")
    for i, nested in enumerate(message.nested_type):
        if not nested.options.map_entry:
            _message(lines, nested, (*path, 3, i), notes, f"{name}.")
    for i, enum_ in enumerate(message.enum_type):
        _enum(lines, enum_, (*path, 4, i), notes, f"{name}.")


def _enum(
    lines: list[str], enum_: Any, path: tuple[int, ...], notes: dict[Any, str], prefix: str
) -> None:
    name = prefix + enum_.name
    lines.append(f"### {name} {{#{_anchor(name.replace('.', ''))}}}\n\n")
    if notes.get(path):
        lines.append(f"{notes[path]}\n\n")
    lines.append("| value | number | meaning |\n|---|---|---|\n")
    for i, value in enumerate(enum_.value):
        note = _cell(notes.get((*path, 2, i), ""))
        lines.append(f"| `{value.name}` | {value.number} | {note} |\n")
    lines.append("\n")


def grpc_markdown() -> str:
    """The gRPC reference page."""
    lines = [
        "# gRPC reference\n\n",
        _GENERATED,
        "Package `cachettl.v1`, from the comments of `proto/cachettl/v1/*.proto` (the wire "
        "contract). Durations are `google.protobuf.Duration`, times "
        "`google.protobuf.Timestamp`. The tenant comes from the bearer token "
        "(`authorization: Bearer TOKEN` metadata), never from a request field. Standard gRPC "
        "health checking and server reflection are on.\n\n",
    ]
    for file in proto_descriptors().file:
        if not file.name.startswith("cachettl/"):
            continue
        notes = _comments(file)
        header = ""
        for location in file.source_code_info.location:
            if tuple(location.path) == (12,):  # the syntax statement: the file's header above it
                detached = [c.strip() for c in location.leading_detached_comments]
                header = " ".join(" ".join(c.split()) for c in detached if c)
        lines.append(f"## `{file.name}`\n\n")
        if header:
            lines.append(f"{header}\n\n")
        for s, service in enumerate(file.service):
            lines.append(f"### {service.name} {{#{_anchor(service.name)}}}\n\n")
            if notes.get((6, s)):
                lines.append(f"{notes[(6, s)]}\n\n")
            lines.append("| RPC | request | response | meaning |\n|---|---|---|---|\n")
            for m, method in enumerate(service.method):
                request = method.input_type.removeprefix(".cachettl.v1.")
                response = method.output_type.removeprefix(".cachettl.v1.")
                if method.server_streaming:
                    response = f"stream {response}"
                request_link = f"[`{request}`](#{_anchor(request)})"
                response_link = f"[`{response}`](#{_anchor(response.removeprefix('stream '))})"
                note = _cell(notes.get((6, s, 2, m), ""))
                lines.append(f"| `{method.name}` | {request_link} | {response_link} | {note} |\n")
            lines.append("\n")
        for i, message in enumerate(file.message_type):
            _message(lines, message, (4, i), notes, "")
        for i, enum_ in enumerate(file.enum_type):
            _enum(lines, enum_, (5, i), notes, "")
    return "".join(lines)


# -- MkDocs ---------------------------------------------------------------------------------
def on_files(files: Any, config: Any) -> Any:
    """Add the generated reference pages and the results folder to the site."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, CONFIGURATION_PAGE, content=configuration_markdown()))
    files.append(File.generated(config, GRPC_PAGE, content=grpc_markdown()))
    for path in sorted(RESULTS.iterdir()):
        if path.is_file() and not path.name.startswith("."):
            files.append(File.generated(config, f"results/{path.name}", abs_src_path=str(path)))
    return files
