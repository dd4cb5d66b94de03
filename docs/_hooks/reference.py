"""MkDocs hook: fills the reference pages from the project itself, so that they cannot drift.

`<!-- reference: openapi -->` becomes the routes and schemas of openapi/openapi.json (the document a
test keeps equal to the app's), and `<!-- reference: cli -->` the `--help` of every `dpledger`
command, printed by the installed CLI. Written here rather than with a plugin: the OpenAPI plugins
either load Swagger UI from a CDN or need stylesheets fetched apart, and the site builds offline.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
OPENAPI_MARK, CLI_MARK = "<!-- reference: openapi -->", "<!-- reference: cli -->"
METHODS = ("get", "post", "put", "patch", "delete")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if OPENAPI_MARK in markdown:
        document = json.loads((ROOT / "openapi" / "openapi.json").read_text())
        markdown = markdown.replace(OPENAPI_MARK, openapi_markdown(document))
    if CLI_MARK in markdown:
        markdown = markdown.replace(CLI_MARK, cli_markdown())
    return markdown


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def _type(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[1]
        return f"[{name}](#{name.lower()})"
    if "anyOf" in schema or "oneOf" in schema:
        return " or ".join(_type(s) for s in schema.get("anyOf", schema.get("oneOf", [])))
    if schema.get("type") == "array":
        return f"array of {_type(schema.get('items', {}))}"
    if "enum" in schema:
        return " \\| ".join(f"`{value}`" for value in schema["enum"])
    if "const" in schema:
        return f"`{schema['const']}`"
    return str(schema.get("type", "any"))


def openapi_markdown(document: dict[str, Any]) -> str:
    out = [f"Generated from `openapi/openapi.json` ({document['info']['title']} {document['info']['version']}, "
           f"OpenAPI {document['openapi']}).", "", "## Routes", ""]
    for path, item in document["paths"].items():
        for method in METHODS:
            if method not in item:
                continue
            operation = item[method]
            out += [f"### `{method.upper()} {path}`", "", f"**{operation.get('summary', '')}**", ""]
            if operation.get("description"):
                out += [operation["description"].strip(), ""]
            if not operation.get("security"):
                out += ["No key needed.", ""]
            parameters = operation.get("parameters", [])
            if parameters:
                out += ["| parameter | in | required | type | description |", "| --- | --- | --- | --- | --- |"]
                out += [f"| `{p['name']}` | {p['in']} | {'yes' if p.get('required') else 'no'} | "
                        f"{_type(p.get('schema', {}))} | {_cell(p.get('description', ''))} |" for p in parameters]
                out.append("")
            body = operation.get("requestBody", {}).get("content", {}).get("application/json")
            if body:
                out += [f"Body: {_type(body['schema'])}", ""]
            out += ["| status | answer |", "| --- | --- |"]
            for status, response in operation.get("responses", {}).items():
                schema = response.get("content", {}).get("application/json", {}).get("schema")
                answer = _cell(response.get("description", "")) + (f": {_type(schema)}" if schema else "")
                out.append(f"| {status} | {answer} |")
            out.append("")
    out += ["## Schemas", ""]
    for name, schema in document.get("components", {}).get("schemas", {}).items():
        out += [f"### {name}", ""]
        if schema.get("description"):
            out += [schema["description"].strip(), ""]
        properties = schema.get("properties", {})
        if properties:
            required = set(schema.get("required", []))
            out += ["| field | type | required | description |", "| --- | --- | --- | --- |"]
            out += [f"| `{field}` | {_type(spec)} | {'yes' if field in required else 'no'} | "
                    f"{_cell(spec.get('description', ''))} |" for field, spec in properties.items()]
            out.append("")
        elif "oneOf" in schema or "anyOf" in schema:
            out += [f"One of: {_type(schema)}", ""]
    return "\n".join(out)


def _help(argv: list[str]) -> str:
    """What `dpledger ARGV --help` prints, from the installed CLI in this process (argparse exits 0)."""
    from dpledger import cli

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.suppress(SystemExit):
        cli.main([*argv, "--help"])
    return printed.getvalue()


def _commands(parser: argparse.ArgumentParser, prefix: list[str]) -> list[list[str]]:
    """Every command path under PARSER, read off its subparsers (argparse has no public walk)."""
    found = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found += _commands(child, [*prefix, name])
    return found


def cli_markdown() -> str:
    from dpledger import cli

    out: list[str] = []
    for argv in _commands(cli._parser(), []):
        out += [f"## `{' '.join(['dpledger', *argv])}`", "", "```text", _help(argv).rstrip(), "```", ""]
    return "\n".join(out)
