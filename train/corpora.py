"""Offline source text of Locret's training samples: paragraphs of prose sentences, in a fixed order.

Two corpora (:data:`CORPORA`), both disjoint from RULER's sources (Paul Graham essays, SQuAD and HotpotQA:
the test suite checks every sentence against the installed RULER data) and from kvjax's own evaluation
haystack (``pydoc_data.topics``):

* ``"stdlib-docstrings"``: the docstrings of the public functions and classes (and their public methods) of
  the standard-library modules in :data:`CORPUS_MODULES` (PSF licence), about 2,900 sentences: enough for
  prompts of a few thousand tokens, and every 4K prompt then covers a good part of it.
* ``"django-docs"``: the reStructuredText documentation in the source distribution of Django
  :data:`DJANGO_VERSION` (BSD-3-Clause; ``docs/**/*.txt`` except the release notes and man page), about
  600,000 words of technical prose, so long prompts do not repeat each other. The sdist is fetched once
  with ``pip download`` into kvjax's cache directory and checked against :data:`DJANGO_SHA256`; reST markup
  is reduced to its text (roles, literals, links), and code blocks, directives, headings, lists and
  tables are left out.

Sentences are whitespace-collapsed prose of 16-300 characters, mostly letters; sentences seen earlier in
the same corpus are dropped. A corpus's paragraphs differ a little between Python versions
(``stdlib-docstrings``) but not between machines (``django-docs``).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import os
import re
import subprocess
import sys
import tarfile

CORPORA: tuple[str, ...] = ("stdlib-docstrings", "django-docs")
DJANGO_VERSION = "5.1.4"
DJANGO_SDIST = f"Django-{DJANGO_VERSION}.tar.gz"
DJANGO_SHA256 = "de450c09e91879fa5a307f696e57c851955c910a438a35e6b4c895e86bedc82a"
DJANGO_SKIPPED = ("docs/releases/", "docs/man/", "docs/_ext/", "docs/_theme/")

# Disjoint from kvjax.calibration.CALIBRATION_MODULES. pdb and cmd are left out: pdb's docstrings are also in
# pydoc_data.topics (the evaluation's haystack), as its "debugger" topic.
CORPUS_MODULES: tuple[str, ...] = (
    "os", "re", "inspect", "ast", "pickle", "socket", "selectors", "contextlib", "enum", "dataclasses", "abc",
    "codecs", "locale", "calendar", "time", "hashlib", "base64", "struct", "bisect", "copy", "pprint", "difflib",
    "operator", "glob", "fnmatch", "gzip", "configparser", "mimetypes", "uuid", "ipaddress", "imaplib", "smtplib",
    "ftplib", "shlex", "sched", "queue", "weakref", "warnings", "traceback", "tokenize", "dis", "timeit", "gettext",
    "numbers", "array", "mmap", "select", "ssl", "poplib", "xmlrpc.client", "http.server", "http.cookies", "mailbox",
    "plistlib", "netrc", "shelve", "bz2", "lzma", "pkgutil", "runpy", "html.parser", "platform", "sysconfig", "zlib",
    "binascii", "math", "cmath", "signal", "reprlib", "graphlib", "secrets", "hmac", "stat", "filecmp", "fileinput",
)


MAX_SENTENCE_CHARS = 300
MIN_SENTENCE_CHARS = 16
MIN_SENTENCE_WORDS = 3


_SPLIT = re.compile(r"(?<=[.!?])(?<!\be\.g\.)(?<!\bi\.e\.)(?<!\betc\.)(?<!\bvs\.)(?<!\bcf\.)\s+(?=[A-Z(\"'])")
_SIGNATURE = re.compile(r"^[\w.]+\(.*\)\s*(->.*)?$")  # "open(file, mode='r') -> int"
_CODE_CHARS = set("_()[]{}=<>*`|\\/#@$%^~;")


def _source_functions(mod) -> dict:
    """Top-level function definitions of ``mod``'s Python source by name ({} for a module without source)."""
    try:
        source = inspect.getsource(mod)
    except (OSError, TypeError):
        return {}
    return {node.name: node for node in ast.parse(source).body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _module_docstrings(mod) -> list[str]:
    """``mod``'s docstrings (``inspect.getdoc``): the module's, then its public classes' and functions'
    (sorted), each class followed by its own public methods' (sorted).

    A public function the module's source defines but another library has since replaced (torch
    replaces ``inspect.getfile`` when imported) contributes its docstring from the source, so the
    corpus does not depend on what else the process imported.
    """
    own = {mod.__name__, "_" + mod.__name__, "posix" if mod.__name__ == "os" else mod.__name__}
    docs = [inspect.getdoc(mod)]
    defined = None
    for attr, obj in sorted(vars(mod).items()):
        if attr.startswith("_"):
            continue
        if getattr(obj, "__module__", None) not in own:
            if inspect.isfunction(obj) or inspect.isbuiltin(obj):  # replaced after import?
                defined = _source_functions(mod) if defined is None else defined
                if attr in defined:
                    docs.append(ast.get_docstring(defined[attr], clean=True))
            continue
        if inspect.isclass(obj):
            docs.append(inspect.getdoc(obj))
            for name, meth in sorted(vars(obj).items()):
                if not name.startswith("_") and (inspect.isfunction(meth) or inspect.ismethoddescriptor(meth)):
                    docs.append(inspect.getdoc(meth))
        elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
            docs.append(inspect.getdoc(obj))
    return docs


def _is_sentence(s: str) -> bool:
    if not MIN_SENTENCE_CHARS <= len(s) <= MAX_SENTENCE_CHARS or len(s.split()) < MIN_SENTENCE_WORDS:
        return False
    if not s[0].isalpha() or s[-1] not in ".!?" or s.endswith(("e.g.", "i.e.", "etc.", "...")):
        return False
    if sum(c in _CODE_CHARS for c in s) > 0.05 * len(s) or "::" in s or ">>>" in s or "->" in s:
        return False
    nonspace = [c for c in s if not c.isspace()]
    return sum(c.isalpha() for c in nonspace) >= 0.8 * len(nonspace)


def _paragraph_sentences(para: str) -> list[str]:
    """The prose sentences of one docstring paragraph (code, doctests, lists and headings dropped)."""
    lines = para.split("\n")
    if all(line.startswith("    ") for line in lines):  # an indented block: code or a parameter list
        return []
    kept = []
    for line in lines:
        text = line.strip()
        if text.startswith((">>>", "...")):  # a doctest: drop it and its output
            break
        if (
            not text
            or _SIGNATURE.match(text)
            or re.match(r"^([-*+|•]|\d+[.)]|[A-Z][\w ]*:$)", text)  # bullets, numbered items, "Args:" headings
            or re.fullmatch(r"[\W_]+", text)  # underlines, rules
            or re.fullmatch(r"\*{0,2}[A-Za-z_]\w*", text)  # a parameter's name on its own line
        ):
            continue
        kept.append(text)
    text = re.sub(r"\s+", " ", " ".join(kept)).strip()
    return [s for s in _SPLIT.split(text) if _is_sentence(s)] if text else []


def stdlib_docstrings() -> tuple[tuple[str, ...], ...]:
    """The ``stdlib-docstrings`` corpus: paragraphs (tuples of sentences) of :data:`CORPUS_MODULES`' docstrings.

    One paragraph per docstring (module, public class or function, public method), so a paragraph's first
    sentence is usually its docstring's summary line. Sentences are whitespace-collapsed prose of 16-300
    characters; doctests, code-like lines, lists, headings and sentences seen earlier in the corpus are dropped.
    """
    seen: set[str] = set()
    paragraphs = []
    for name in CORPUS_MODULES:
        mod = importlib.import_module(name)
        for doc in _module_docstrings(mod):
            if not doc:
                continue
            sentences = []  # one paragraph per docstring: its first sentence is the docstring's summary line
            for para in re.split(r"\n\s*\n", doc):
                for s in _paragraph_sentences(para):
                    if s not in seen:
                        seen.add(s)
                        sentences.append(s)
            if sentences:
                paragraphs.append(tuple(sentences))
    return tuple(paragraphs)


def _new_sentences(paragraph: str, seen: set) -> list[str]:
    out = []
    for s in _SPLIT.split(re.sub(r"\s+", " ", paragraph).strip()):
        if _is_sentence(s) and s not in seen:
            seen.add(s)
            out.append(s)
    return out


# ------------------------------------------------------------------------------------------- django-docs

_ROLE_TITLE = re.compile(r":[\w:.-]+:`([^`<]*?)\s*<[^`>]*>`")  # :doc:`the guide </topics/x>` -> the guide
_ROLE = re.compile(r":[\w:.-]+:`~?([^`]*)`")  # :class:`~django.db.Model` -> django.db.Model (last part below)
_LINK = re.compile(r"`([^`<]*?)\s*<[^`>]*>`_{1,2}")  # `text <url>`_ -> text
_REF = re.compile(r"`([^`]+)`_{1,2}")  # `text`_ -> text
_LITERAL = re.compile(r"``([^`]+)``")
_NAMED_REF = re.compile(r"\b(\w+)_(?=[\s.,;:)]|$)")  # Selenium_ -> Selenium
_EMPHASIS = re.compile(r"\*{1,2}([^*\s][^*]*?)\*{1,2}")
_RULE = re.compile(r"^([=\-~^\"'`#*+.:_])\1{2,}\s*$")  # a heading's under/overline or a table's border
_LIST_ITEM = re.compile(r"^([-*+•]|\d+[.)]|#\.|[a-z][.)])\s")


def _role_text(match: re.Match) -> str:
    text = match.group(1)
    return text.rsplit(".", 1)[-1] if match.group(0).split("`", 1)[1].startswith("~") else text


def rest_paragraphs(text: str) -> list[str]:
    """The prose paragraphs of one reStructuredText document, markup reduced to its text.

    A paragraph is a run of non-blank lines; it is left out when it is indented (code, a directive's body,
    a list's continuation), starts a directive or comment (``..``), is a heading (a line over or under a
    rule of punctuation), a list item, a field (``:name:``) or a table.
    """
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line.rstrip() for line in block.split("\n") if line.strip()]
        if not lines or lines[0][0].isspace():
            continue
        first = lines[0]
        if (first.startswith(("..", ":", "|", "+-", ">>>")) or any(_RULE.match(line) for line in lines)
                or _LIST_ITEM.match(first)):
            continue
        para = " ".join(line.strip() for line in lines)
        para = _ROLE_TITLE.sub(r"\1", para)
        para = _ROLE.sub(_role_text, para)
        para = _LINK.sub(r"\1", para)
        para = _REF.sub(r"\1", para)
        para = _LITERAL.sub(r"\1", para)
        para = _NAMED_REF.sub(r"\1", para)
        para = _EMPHASIS.sub(r"\1", para)
        para = para.replace("::", ":").replace("\\", "")
        out.append(para)
    return out


def django_sdist_path() -> str:
    """Where kvjax keeps Django's sdist (in its cache directory)."""
    from kvjax.models.registry import cache_dir

    return os.path.join(cache_dir(), "corpora", DJANGO_SDIST)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_django_sdist() -> str:
    """The path of Django's sdist, downloaded with ``pip download`` on first use and checked by its sha256."""
    path = django_sdist_path()
    if not os.path.isfile(path):
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", f"django=={DJANGO_VERSION}", "--no-deps", "--no-binary", ":all:",
               "-d", folder, "-q"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not os.path.isfile(path):
            raise RuntimeError(
                f"could not download Django {DJANGO_VERSION}'s sdist, the django-docs corpus ({' '.join(cmd)}: "
                f"{done.stderr.strip()[-500:]}); put {DJANGO_SDIST} (sha256 {DJANGO_SHA256}) at {path} by hand")
    digest = _sha256(path)
    if digest != DJANGO_SHA256:
        raise RuntimeError(f"{path} has sha256 {digest}, not Django {DJANGO_VERSION}'s {DJANGO_SHA256}; delete it to download again")
    return path


def django_docs(path: str | None = None) -> tuple[tuple[str, ...], ...]:
    """The ``django-docs`` corpus: one paragraph per reST paragraph of ``docs/**/*.txt``, files in name order.

    ``path``: a Django sdist (default: :func:`fetch_django_sdist`)."""
    path = path or fetch_django_sdist()
    seen: set[str] = set()
    paragraphs = []
    with tarfile.open(path, "r:gz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile()), key=lambda m: m.name)
        for m in members:
            name = m.name.split("/", 1)[-1]
            if not (name.startswith("docs/") and name.endswith(".txt")) or name.startswith(DJANGO_SKIPPED):
                continue
            text = tar.extractfile(m).read().decode("utf-8")
            for para in rest_paragraphs(text):
                sentences = _new_sentences(para, seen)
                if sentences:
                    paragraphs.append(tuple(sentences))
    return tuple(paragraphs)


@functools.lru_cache(maxsize=None)
def corpus_paragraphs(name: str) -> tuple[tuple[str, ...], ...]:
    """The paragraphs (tuples of sentences) of corpus ``name`` (one of :data:`CORPORA`), cached."""
    if name == "stdlib-docstrings":
        return stdlib_docstrings()
    if name == "django-docs":
        return django_docs()
    raise ValueError(f"unknown corpus {name!r}; allowed: {', '.join(CORPORA)}")


__all__ = ["CORPORA", "CORPUS_MODULES", "DJANGO_VERSION", "DJANGO_SHA256", "corpus_paragraphs", "django_docs",
           "django_sdist_path", "fetch_django_sdist", "rest_paragraphs", "stdlib_docstrings"]
