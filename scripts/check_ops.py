#!/usr/bin/env python3
"""Checks what ships for operators: the alert rules, their tests, the dashboard and the runbook.

    python3 scripts/check_ops.py                              # (a) and (b)
    python3 scripts/check_ops.py --metrics SCRAPE [SCRAPE...]  # (a), (b) and (c)

(a) promtool: `check rules` on deploy/prometheus/alerts.yml, `check config` on the example
    deploy/prometheus/prometheus.yml, `test rules` on deploy/prometheus/alerts_test.yml, and
    `check rules` on the dashboard's queries written as recording rules (Grafana's variables
    replaced), so that each one parses (scripts/install_promtool.sh installs promtool).
(b) structure:
    - every alert has a severity label, summary and description annotations, and a runbook_url
      `docs/operations.md#<anchor>` whose anchor is a heading of docs/operations.md;
    - alerts_test.yml has, for every alert, a firing case (exp_alerts listing it) and a quiet
      case (an empty exp_alerts);
    - the dashboard deploy/grafana/kv-indexer.json has a uid and a `datasource` variable of type
      datasource, and every panel has a description, a unit, and the datasource ${datasource}
      (on the panel and on each target); every range in its queries is $__rate_interval.
(c) with --metrics (files or http(s) URLs of /metrics scrapes of the real binaries):
    `promtool check metrics` must be clean on each scrape, and every metric named in the
    dashboard's queries and the alert rules must be exported by at least one scrape (a
    histogram's _bucket/_sum/_count count as its family's). Label values the queries match on
    that no scrape shows are printed as notes, not failures (a series may appear only after
    its first event).

Exits 1 naming every problem found. Python 3 standard library only: the YAML files are read by a
small reader of the subset they use (block mappings and sequences, plain and quoted scalars,
block scalars, `[]` and `{}`), which stops with the line number at anything else.
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy/prometheus/alerts.yml"
RULE_TESTS = ROOT / "deploy/prometheus/alerts_test.yml"
PROMETHEUS_CONFIG = ROOT / "deploy/prometheus/prometheus.yml"
DASHBOARD = ROOT / "deploy/grafana/kv-indexer.json"
RUNBOOK = ROOT / "docs/operations.md"
RUNBOOK_URL = re.compile(r"^docs/operations\.md#([a-z0-9_-]+)$")
SEVERITIES = {"critical", "warning", "info"}
DATASOURCE_UIDS = {"${datasource}", "$datasource"}

# Names in a query that are not metrics: series Prometheus makes itself, keywords and modifiers.
NOT_METRICS = {"up", "ALERTS", "ALERTS_FOR_STATE"}
KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "offset", "bool", "inf", "nan", "atan2",
}


# --- a reader for the YAML subset of the rule files ------------------------------------------

KEY = re.compile(r"^([A-Za-z_][\w.-]*)\s*:(?:\s+(.*))?$")
BLOCK_STYLES = {"|", "|-", "|+", ">", ">-", ">+"}


class YamlError(Exception):
    pass


class YamlSubset:
    """Reads block-style YAML: mappings with identifier keys, sequences, scalars as strings."""

    def __init__(self, text, name):
        self.lines = text.splitlines()
        self.name = name
        self.pos = 0

    def load(self):
        first = self._peek()
        if first is None:
            return None
        value = self._node(first[0])
        if self._peek() is not None:
            self._fail("unexpected indentation")
        return value

    def _fail(self, what):
        raise YamlError(f"{self.name}:{self.pos + 1}: {what} (check_ops.py reads a YAML subset)")

    def _peek(self):
        """(indent, content) of the next line with content, skipping blanks and comments."""
        while self.pos < len(self.lines):
            line = self.lines[self.pos]
            content = line.strip()
            if content and not content.startswith("#"):
                if "\t" in line[: len(line) - len(line.lstrip())]:
                    self._fail("tab in indentation")
                return len(line) - len(line.lstrip(" ")), content
            self.pos += 1
        return None

    def _node(self, indent):
        _, content = self._peek()
        if content == "-" or content.startswith("- "):
            return self._sequence(indent)
        if KEY.match(content):
            return self._mapping(indent)
        self.pos += 1
        return scalar(content, self)

    def _sequence(self, indent):
        items = []
        while (next_line := self._peek()) and next_line[0] == indent:
            content = next_line[1]
            if not (content == "-" or content.startswith("- ")):
                break
            rest = content[1:].lstrip()
            if not rest:
                self.pos += 1
                child = self._peek()
                items.append(self._node(child[0]) if child and child[0] > indent else None)
                continue
            # Re-read the item's first line as if it started at its own column.
            column = indent + len(content) - len(rest)
            self.lines[self.pos] = " " * column + rest
            items.append(self._node(column))
        return items

    def _mapping(self, indent):
        result = {}
        while (next_line := self._peek()) and next_line[0] == indent:
            match = KEY.match(next_line[1])
            if not match or next_line[1].startswith("- "):
                break
            key, rest = match.group(1), strip_comment(match.group(2) or "")
            if key in result:
                self._fail(f"duplicate key {key!r}")
            self.pos += 1
            if rest in BLOCK_STYLES:
                result[key] = self._block_scalar(indent, rest)
            elif rest:
                result[key] = scalar(rest, self)
            else:
                child = self._peek()
                nested = child and (
                    child[0] > indent or (child[0] == indent and child[1].startswith("- "))
                )
                result[key] = self._node(child[0]) if nested else None
        if (next_line := self._peek()) and next_line[0] > indent:
            self._fail("a line continues a value: use a block scalar (|) instead")
        return result

    def _block_scalar(self, parent_indent, style):
        body = []
        while self.pos < len(self.lines):
            line = self.lines[self.pos]
            if line.strip() and len(line) - len(line.lstrip(" ")) <= parent_indent:
                break
            body.append(line)
            self.pos += 1
        while body and not body[-1].strip():
            body.pop()
        if not body:
            return ""
        margin = min(len(l) - len(l.lstrip(" ")) for l in body if l.strip())
        lines = [l[margin:] for l in body]
        text = "\n".join(lines) if style.startswith("|") else fold(lines)
        return text if style.endswith("-") else text + "\n"


def fold(lines):
    """Folded style: lines joined by spaces, a blank line kept as a newline."""
    out = ""
    for line in lines:
        if not line.strip():
            out += "\n"
        elif out and not out.endswith("\n"):
            out += " " + line
        else:
            out += line
    return out


def strip_comment(text):
    """A plain value without its trailing ` # comment` (a `#` inside quotes is kept)."""
    if text[:1] in "\"'":
        return text
    cut = text.find(" #")
    return (text if cut < 0 else text[:cut]).strip()


def scalar(text, reader):
    """A scalar, as a string; `[]`/`{}` and simple flow sequences as lists and mappings."""
    text = text.strip()
    for quote, pattern in (('"', r'"(?:[^"\\]|\\.)*"'), ("'", r"'(?:[^']|'')*'")):
        if not text.startswith(quote):
            continue
        match = re.match(pattern, text)
        rest = text[match.end():].strip() if match else "?"
        if rest and not rest.startswith("#"):
            reader._fail(f"bad {quote}-quoted scalar")
        quoted = match.group()
        return json.loads(quoted) if quote == '"' else quoted[1:-1].replace("''", "'")
    text = strip_comment(text)
    if text == "{}":
        return {}
    if text.startswith("[") and text.endswith("]"):
        inner = text[1:-1].strip()
        return [scalar(item, reader) for item in inner.split(",")] if inner else []
    if text[:1] in "{[&*!|>%@`":
        reader._fail(f"unsupported YAML: {text[:20]}")
    return text


def load_yaml(path):
    return YamlSubset(path.read_text(), str(path.relative_to(ROOT))).load()


# --- (a) promtool ------------------------------------------------------------------------------

def run_promtool(args, stdin=None):
    """(exit code, combined output) of promtool with `args`."""
    done = subprocess.run(
        ["promtool", *args], input=stdin, capture_output=True, text=True, check=False
    )
    return done.returncode, (done.stdout + done.stderr).strip()


def check_promtool():
    if shutil.which("promtool") is None:
        return ["promtool is not installed: run scripts/install_promtool.sh"]
    problems = []
    for args in (
        ["check", "rules", str(RULES)],
        ["check", "config", str(PROMETHEUS_CONFIG)],
        ["test", "rules", str(RULE_TESTS)],
    ):
        code, output = run_promtool(args)
        shown = " ".join(str(Path(a).relative_to(ROOT)) if "/" in a else a for a in args)
        if code != 0:
            problems.append(f"promtool {shown} failed:\n{indent_text(output)}")
        else:
            print(f"ok: promtool {shown}")
    return problems + check_dashboard_queries_parse()


def check_dashboard_queries_parse():
    """promtool check rules on the dashboard's queries, as one recording rule each."""
    rules, places = [], []
    for panel in dashboard_panels(json.loads(DASHBOARD.read_text())):
        for target in panel.get("targets") or []:
            expr = re.sub(r"\$\{?__(rate_)?interval\}?|\$\{?__range\}?", "1m", target.get("expr", ""))
            rules.append({"record": f"dashboard:query_{len(rules)}", "expr": expr})
            places.append(f"panel {panel.get('title')!r} query {target.get('refId')}")
    # JSON is YAML: promtool reads the rule file as it is.
    with tempfile.NamedTemporaryFile("w", suffix=".yml") as rule_file:
        json.dump({"groups": [{"name": "dashboard", "rules": rules}]}, rule_file)
        rule_file.flush()
        code, output = run_promtool(["check", "rules", rule_file.name])
    if code != 0:
        failed = sorted({int(n) for n in re.findall(r"dashboard:query_(\d+)", output)})
        named = "".join(f"\n    dashboard:query_{n} is {places[n]}" for n in failed)
        return [f"a dashboard query does not parse:\n{indent_text(output)}{named}"]
    print(f"ok: promtool parses the dashboard's {len(rules)} queries")
    return []


def indent_text(text):
    return "\n".join("    " + line for line in text.splitlines())


# --- (b) structure -----------------------------------------------------------------------------

def alert_rules(rules_file):
    """The alerting rules (dicts) of a rules file, in order."""
    return [
        rule
        for group in (rules_file or {}).get("groups") or []
        for rule in group.get("rules") or []
        if "alert" in rule
    ]


def markdown_anchors(text):
    """The anchors GitHub gives the headings of a markdown text."""
    anchors, seen = set(), {}
    in_fence = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_fence = not in_fence
        if in_fence or not re.match(r"^#{1,6} ", line):
            continue
        title = line.lstrip("#").strip().lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def check_rules(rules, anchors):
    problems, names = [], set()
    for rule in rules:
        name = rule["alert"]
        if name in names:
            problems.append(f"alert {name}: defined twice")
        names.add(name)
        labels = rule.get("labels") or {}
        annotations = rule.get("annotations") or {}
        if labels.get("severity") not in SEVERITIES:
            problems.append(f"alert {name}: severity label not one of {sorted(SEVERITIES)}")
        for key in ("summary", "description", "runbook_url"):
            if not annotations.get(key):
                problems.append(f"alert {name}: no {key} annotation")
        url = annotations.get("runbook_url") or ""
        match = RUNBOOK_URL.match(url)
        if url and not match:
            problems.append(f"alert {name}: runbook_url {url!r} is not docs/operations.md#<anchor>")
        elif match and match.group(1) not in anchors:
            problems.append(f"alert {name}: runbook_url anchor #{match.group(1)} is no heading of docs/operations.md")
    return problems


def check_runbook_links(text, anchors):
    """The runbook's own links to its sections (`](#anchor)`) lead somewhere."""
    return [
        f"docs/operations.md: link to #{anchor}, which is no heading"
        for anchor in sorted(set(re.findall(r"\]\(#([^)]+)\)", text)) - anchors)
    ]


def check_rule_tests(rules, tests_file):
    """Every alert needs a firing case and a quiet (empty exp_alerts) case."""
    firing, quiet, problems = set(), set(), []
    names = {rule["alert"] for rule in rules}
    for group in (tests_file or {}).get("tests") or []:
        for case in group.get("alert_rule_test") or []:
            name = case.get("alertname")
            if name not in names:
                problems.append(f"alerts_test.yml: test {group.get('name')!r} names unknown alert {name!r}")
            (firing if case.get("exp_alerts") else quiet).add(name)
    for name in sorted(names):
        for kind, cases in (("firing", firing), ("quiet", quiet)):
            if name not in cases:
                problems.append(f"alert {name}: no {kind} case in alerts_test.yml")
    return problems


def dashboard_panels(dashboard):
    """Every panel, rows' nested panels included, rows excluded."""
    for panel in dashboard.get("panels") or []:
        if panel.get("type") == "row":
            yield from panel.get("panels") or []
        else:
            yield panel


def uses_variable(datasource):
    return isinstance(datasource, dict) and datasource.get("uid") in DATASOURCE_UIDS


def check_dashboard(dashboard):
    problems = []
    if not dashboard.get("uid"):
        problems.append("dashboard: no uid")
    variables = (dashboard.get("templating") or {}).get("list") or []
    if not any(v.get("name") == "datasource" and v.get("type") == "datasource" for v in variables):
        problems.append("dashboard: no template variable `datasource` of type datasource")
    ids = set()
    for panel in dashboard_panels(dashboard):
        where = f"dashboard panel {panel.get('title')!r}"
        if panel.get("id") in ids:
            problems.append(f"{where}: id {panel.get('id')} used twice")
        ids.add(panel.get("id"))
        if not panel.get("description"):
            problems.append(f"{where}: no description")
        if not ((panel.get("fieldConfig") or {}).get("defaults") or {}).get("unit"):
            problems.append(f"{where}: no unit (fieldConfig.defaults.unit)")
        if not uses_variable(panel.get("datasource")):
            problems.append(f"{where}: datasource is not ${{datasource}}")
        if not panel.get("targets"):
            problems.append(f"{where}: no query")
        for target in panel.get("targets") or []:
            if not uses_variable(target.get("datasource")):
                problems.append(f"{where}: query {target.get('refId')} datasource is not ${{datasource}}")
            for window in re.findall(r"\[([^\]]*)\]", target.get("expr", "")):
                if window != "$__rate_interval":
                    problems.append(f"{where}: range [{window}] instead of [$__rate_interval]")
    return problems


# --- (c) scrapes -------------------------------------------------------------------------------

SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{(.*)\})?\s+\S+")
LABEL = re.compile(r'([a-zA-Z_]\w*)\s*=\s*"((?:[^"\\]|\\.)*)"')
FAMILY_SUFFIXES = {
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
}


def read_scrape(source):
    if re.match(r"^https?://", source):
        with urllib.request.urlopen(source, timeout=10) as answer:
            return answer.read().decode()
    return Path(source).read_text()


def parse_exposition(text):
    """{series name: [label dicts]} of a scrape, with the names its # TYPE lines imply."""
    series = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            for suffix in FAMILY_SUFFIXES.get(parts[3] if len(parts) > 3 else "", ("",)):
                series.setdefault(parts[2] + suffix, [])
        elif line and not line.startswith("#"):
            match = SAMPLE.match(line)
            if match:
                labels = dict(LABEL.findall(match.group(3) or ""))
                series.setdefault(match.group(1), []).append(labels)
    return series


def strip_non_metrics(expr):
    """The query without strings, label matchers, ranges, grouping clauses and variables."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    expr = re.sub(r"\{[^}]*\}", " ", expr)
    expr = re.sub(r"\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    return re.sub(r"\$\{?\w+\}?", " ", expr)


def metric_names(expr):
    """Metric names a PromQL query selects (functions, keywords and numbers left out)."""
    text = strip_non_metrics(expr)
    names = set()
    for token in re.finditer(r"\d+(?:\.\d+)?(?:[eE][+-]?\d+)?[a-zA-Z]*|[a-zA-Z_:][\w:]*", text):
        word = token.group()
        is_call = re.match(r"\s*\(", text[token.end():])
        if word[0].isdigit() or is_call or word.lower() in KEYWORDS or word in NOT_METRICS:
            continue
        names.add(word)
    return names


def matchers(expr):
    """(metric, label, operator, value) of each label matcher on a named selector."""
    found = []
    for selector in re.finditer(r"([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}", expr):
        for label, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', selector.group(2)):
            found.append((selector.group(1), label, op, value))
    return found


def queries():
    """(where, expr) of every alert rule and dashboard query."""
    for rule in alert_rules(load_yaml(RULES)):
        yield f"alert {rule['alert']}", rule["expr"]
    for panel in dashboard_panels(json.loads(DASHBOARD.read_text())):
        for target in panel.get("targets") or []:
            yield f"panel {panel.get('title')!r}", target.get("expr", "")


def check_scrapes(sources):
    problems, exported = [], {}
    for source in sources:
        try:
            text = read_scrape(source)
        except OSError as error:
            problems.append(f"scrape {source}: cannot read it: {error}")
            continue
        code, output = run_promtool(["check", "metrics"], stdin=text)
        if code != 0 or output:
            problems.append(f"promtool check metrics {source} is not clean:\n{indent_text(output)}")
        else:
            print(f"ok: promtool check metrics {source}")
        for name, labels in parse_exposition(text).items():
            exported.setdefault(name, []).extend(labels)
    used, notes = {}, {}
    for where, expr in queries():
        for name in metric_names(expr):
            used.setdefault(name, []).append(where)
        notes.update(dict.fromkeys(unseen_values(where, expr, exported)))
    for note in notes:
        print(f"note: {note}")
    for name in sorted(set(used) - set(exported)):
        places = ", ".join(sorted(set(used[name])))
        problems.append(f"metric {name} is exported by no scrape; used by {places}")
    print(f"{len(used)} metric names used, {len(set(used) & set(exported))} of them exported")
    return problems


def unseen_values(where, expr, exported):
    """Notes on matchers that no value a scrape shows on their label satisfies (`!~` skipped).

    A value may appear only after its first event, so these are notes; but a `code="OK"` where
    the binary says `Ok` is the drift they point at."""
    for metric, label, op, value in matchers(expr):
        seen = {labels[label] for labels in exported.get(metric, []) if label in labels}
        if not seen or op == "!~":
            continue
        if op == "=~":
            hit = any(re.fullmatch(value, s) for s in seen)
        elif op == "!=":
            hit = any(s != value for s in seen)
        else:
            hit = value in seen
        if not hit:
            yield (f"{where}: {metric}{{{label}{op}\"{value}\"}}: no scrape shows such a value "
                   f"(seen: {', '.join(sorted(seen))})")


# --- main --------------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--metrics", nargs="+", metavar="FILE_OR_URL", default=[],
                        help="/metrics scrapes of the real binaries (files or http(s) URLs)")
    args = parser.parse_args()

    problems = check_promtool()
    try:
        rules = alert_rules(load_yaml(RULES))
        runbook = RUNBOOK.read_text()
        problems += check_rules(rules, markdown_anchors(runbook))
        problems += check_runbook_links(runbook, markdown_anchors(runbook))
        problems += check_rule_tests(rules, load_yaml(RULE_TESTS))
        problems += check_dashboard(json.loads(DASHBOARD.read_text()))
        print(f"checked: {len(rules)} alerts, their tests and runbook sections; the dashboard")
        if args.metrics:
            problems += check_scrapes(args.metrics)
    except (YamlError, json.JSONDecodeError) as error:
        problems.append(str(error))

    print("".join(f"FAIL: {problem}\n" for problem in problems), end="")
    verdict = f"{len(problems)} problem(s)" if problems else "all checks passed"
    print(f"check_ops: {verdict}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
