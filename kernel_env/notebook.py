"""Episodes as Jupyter notebooks: export a record to ``.ipynb``, and compare re-run outputs.

An exported notebook reads like the episode's story: a title and the task, a setup cell that
restores ``context`` and the helpers (answering ``llm_query`` from the recorded responses, so it
re-runs offline), one code cell per step with its real outputs, execution count and nbclient-style
timing, a readable summary of the step's LLM calls, and a closing cell with the outcome.
"""

from __future__ import annotations

import copy
import functools
import io
import os
import platform
import re
import tempfile
import zipfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import nbformat
from nbformat import NotebookNode
from nbformat.corpus.words import generate_corpus_id

from kernel_env.errors import ExportPathError
from kernel_env.inkernel.contract import EXTENSION_MODULE, RECORDED_MAGIC, recorded_pair
from kernel_env.languages.catalog import DEFAULT_KERNEL, language_for
from kernel_env.record import EpisodeRecord, StepRecord
from kernel_env.text import shorten

__all__ = [
    "ExportPathError",
    "cells_match",
    "child_notebook_name",
    "episode_to_notebook",
    "export_zip",
    "normalize_outputs",
    "notebook_name",
    "notebook_text",
    "recorded_steps",
    "safe_path",
    "write_html",
    "write_notebook",
]

INLINE_CONTEXT_CHARS = 10_000  # larger contexts go to a sidecar file next to the notebook
SETUP_TAG = "kernel-env-setup"
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def new_code_cell(
    source: str,
    *,
    outputs: list[Any] | None = None,
    execution_count: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> NotebookNode:
    # nbformat's own constructors validate every cell against the schema: most of a long
    # export's time. Cells are built plainly here and the notebook validated once.
    return NotebookNode(
        id=generate_corpus_id(),
        cell_type="code",
        source=source,
        outputs=outputs or [],
        execution_count=execution_count,
        metadata=NotebookNode(metadata or {}),
    )


def new_markdown_cell(source: str, *, metadata: dict[str, Any] | None = None) -> NotebookNode:
    return NotebookNode(
        id=generate_corpus_id(),
        cell_type="markdown",
        source=source,
        metadata=NotebookNode(metadata or {}),
    )


def safe_path(root: str | os.PathLike[str], name: str) -> Path:
    """``root/name`` for a file name that stays inside ``root`` (no ``..``, no absolute path,
    no NUL, no symlink leading out). Raises :class:`ExportPathError` otherwise."""
    if not name or "\x00" in name or os.path.isabs(name) or name in (".", ".."):
        raise ExportPathError(f"not a file name inside the export directory: {name!r}")
    base = Path(root).resolve()
    target = (base / name).resolve()
    if target == base or base not in target.parents:
        raise ExportPathError(f"{name!r} leads outside {str(base)!r}")
    return target


@functools.cache  # reading package metadata took most of a short episode's export
def _installed_versions() -> tuple[tuple[str, str], ...]:
    out = {"python": platform.python_version()}
    for package in ("kernel-env", "ipykernel", "jupyter_client", "nbformat"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            continue
    return tuple(out.items())


def _versions() -> dict[str, str]:
    return dict(_installed_versions())


def _timestamp(value: Any) -> str:
    return value.isoformat().replace("+00:00", "Z")


def _language_setup(record: EpisodeRecord, context_file: str | None) -> str:
    """Another language's setup cell: its shim, context and recorded answers (offline)."""
    params: dict[str, Any] = {"task_prompt": record.task_prompt}
    if context_file is not None:
        params["context_path"] = context_file
    else:
        params["context"] = record.context
    params["replay"] = [
        [c.prompt, c.response] for s in record.steps for c in s.llm_calls if not c.error
    ]
    language = language_for(record.kernel_name)
    setup = language.notebook_setup(params)
    if setup is None:
        why = f"no kernel_env helpers in the {record.kernel_name!r} kernel: nothing to restore"
        return f"{language.comment} kernel_env: {why}"
    return setup


def _setup_source(record: EpisodeRecord, context_file: str | None) -> str:
    if record.kernel_name != DEFAULT_KERNEL:
        return _language_setup(record, context_file)
    params: dict[str, Any] = {"seed": record.seed}
    if context_file is not None:
        params["context_path"] = context_file
    else:
        params["context"] = record.context
    params["replay"] = [
        recorded_pair(c.prompt, c.response, error=c.error)
        for s in record.steps
        for c in s.llm_calls
    ]
    args = ", ".join(f"{k}={v!r}" for k, v in params.items())
    return (
        "# kernel_env: restore this episode's `context` and helpers. Recorded llm_query answers\n"
        f"# replay offline; with a model configured ({EXTENSION_MODULE}.register_llm\n"
        "# or the KERNEL_ENV_LLM_* variables) the calls go to it instead.\n"
        "%load_ext kernel_env\n"
        f"import {EXTENSION_MODULE} as _kernel_env\n"
        f"_kernel_env.setup_notebook({args})"
    )


def _step_source(step: StepRecord, kernel_name: str = DEFAULT_KERNEL) -> str:
    if kernel_name != DEFAULT_KERNEL and step.status in ("timeout", "died"):
        # No cell magic in other languages: the code stays, as comments, and is not re-run.
        why = f"this step {'timed out' if step.status == 'timeout' else 'killed its kernel'}"
        return language_for(kernel_name).commented(step.code, f"{why}; not re-run")
    if step.status in ("timeout", "died") and not step.interrupted:
        # Re-running it would hang or kill the kernel; the recorded outputs stay in the cell.
        how = "restarted" if step.restarted else "recorded"
        return f"{RECORDED_MAGIC} {how}\n{step.code}"
    if step.status == "timeout":
        return f"{RECORDED_MAGIC} interrupted\n{step.code}"
    return step.code


def _step_cell(step: StepRecord, kernel_name: str = DEFAULT_KERNEL) -> NotebookNode:
    cell = new_code_cell(
        source=_step_source(step, kernel_name),
        outputs=[nbformat.from_dict(o) for o in step.outputs],
        execution_count=step.execution_count,
    )
    cell.metadata["execution"] = {
        "iopub.execute_input": _timestamp(step.started),
        "iopub.status.busy": _timestamp(step.started),
        "shell.execute_reply": _timestamp(step.finished),
        "iopub.status.idle": _timestamp(step.finished),
    }
    cell.metadata["kernel_env"] = {
        "step": step.index,
        "author": step.author,
        "status": step.status,
        "duration": round(step.duration, 6),
        "reward": step.reward,
        "interrupted": step.interrupted,
        "restarted": step.restarted,
        "llm_calls": [
            {
                "op": c.op,
                "prompt": c.prompt,
                "response": c.response,
                "model": c.model,
                "duration": round(c.duration, 6),
                "error": c.error,
            }
            for c in step.llm_calls
        ],
    }
    if step.status == "error":
        cell.metadata["tags"] = ["raises-exception"]
    return cell


def child_notebook_name(stem: str, step: int, n: int) -> str:
    """The file name of the ``n``-th child episode of a step (rlm_query), beside its parent."""
    return f"{stem}.child-{step}-{n}.ipynb"


def _children(step: StepRecord) -> list[EpisodeRecord]:
    return [child for call in step.llm_calls for child in call.children]


def _calls_summary(step: StepRecord, stem: str | None) -> NotebookNode | None:
    if not step.llm_calls:
        return None
    links = []
    if stem is not None:
        names = [
            child_notebook_name(stem, step.index, n) for n in range(1, len(_children(step)) + 1)
        ]
        links = [f"[child episode {n}]({name})" for n, name in enumerate(names, 1)]
    lines = [
        f"<details><summary>Step {step.index}: {len(step.llm_calls)} LLM call(s)</summary>",
        "",
    ]
    for i, call in enumerate(step.llm_calls, 1):
        model = f" · {call.model}" if call.model else ""
        lines += [
            f"**{i}. `{call.op}`**{model} · {call.duration * 1000:.0f} ms"
            + (" · failed" if call.error else ""),
            "",
            "```text",
            _clip(call.prompt),
            "```",
            "→",
            "```text",
            _clip(call.response),
            "```",
            "",
        ]
    lines.append("</details>")
    if links:
        lines += ["", "rlm_query ran " + ", ".join(links) + "."]
    return new_markdown_cell("\n".join(lines), metadata={"kernel_env": {"llm_summary": True}})


def _clip(text: str, limit: int = 2000) -> str:
    text = text.replace("```", "` ` `")  # keep a fence in the text from closing ours
    return shorten(text, limit)


def _closing_cell(record: EpisodeRecord) -> NotebookNode:
    total = sum(s.duration for s in record.steps)
    calls = sum(len(s.llm_calls) for s in record.steps)
    status = "finished" if record.done else "not finished"
    lines = [
        "## Outcome",
        "",
        "| | |",
        "|---|---|",
        f"| episode | {status} |",
        f"| final answer | `{record.final_answer}` |"
        if record.final_answer is not None
        else "| final answer | none |",
        f"| expected answer | `{record.expected_answer}` |"
        if record.expected_answer is not None
        else "| expected answer | not given |",
        f"| reward | {record.reward} |",
        f"| steps | {_steps_line(record)} |",
        f"| LLM calls | {calls} |",
        *([f"| forks | {', '.join(f'`{f}`' for f in record.forks)} |"] if record.forks else []),
        f"| execution time | {total:.3f} s |",
    ]
    return new_markdown_cell("\n".join(lines))


def _prefix_note(record: EpisodeRecord) -> str:
    origin = record.forked_from or {}
    matched = "yes" if origin.get("outputs_matched") else "no (see each cell's outputs)"
    return (
        f"**Shared prefix.** This episode is a fork of `{origin.get('episode_id')}`: its first "
        f"{origin.get('steps')} step(s) are the parent's, re-run by {origin.get('method')} "
        f"(outputs matched the parent's: {matched})."
    )


def notebook_title(record: EpisodeRecord) -> str:
    """The task, on one line (or the episode id when there is none)."""
    task = " ".join(record.task_prompt.split())
    return shorten(task, 120) if task else f"kernel_env episode {record.episode_id}"


def _steps_line(record: EpisodeRecord) -> str:
    """Steps run, against the budget as the user set it: an agent's model turns, or cells."""
    if record.agent_max_turns is not None:
        return f"{record.iterations} (the agent's budget: {record.agent_max_turns} model turns)"
    line = f"{record.iterations} of {record.max_iterations}"
    people = len(record.steps) - record.iterations
    return line + (f", and {people} cell(s) run from Jupyter" if people else "")


def episode_to_notebook(
    record: EpisodeRecord, *, context_file: str | None = None, stem: str | None = None
) -> NotebookNode:
    """The episode as a notebook; ``context_file`` (a path relative to the notebook) when the
    context is kept in a sidecar file instead of inline; ``stem``, the notebook's file name
    without ``.ipynb``, to link child episodes written beside it."""
    task = record.task_prompt.strip() or "_(no task prompt)_"
    cells = [
        new_markdown_cell(
            f"# {notebook_title(record)}\n\nkernel_env episode `{record.episode_id}`\n\n"
            f"**Task.** {task}\n\n`context`: {len(record.context):,} characters."
        ),
        new_code_cell(_setup_source(record, context_file), metadata={"tags": [SETUP_TAG]}),
    ]
    prefix = int((record.forked_from or {}).get("steps", 0))
    for position, step in enumerate(record.steps):
        if position == 0 and prefix:
            cells.append(new_markdown_cell(_prefix_note(record)))
        if position == prefix and prefix:
            cells.append(new_markdown_cell("**This fork's own steps.**"))
        if step.status == "final":
            cells.append(
                new_markdown_cell(
                    f"**Step {step.index}: final answer submitted:** `{step.final_answer}`"
                )
            )
            continue
        if step.note:
            cells.append(new_markdown_cell(step.note, metadata={"kernel_env": {"note": True}}))
        cell = _step_cell(step, record.kernel_name)
        if position < prefix:
            cell.metadata.setdefault("kernel_env", {})["shared_prefix"] = True
        cells.append(cell)
        summary = _calls_summary(step, stem)
        if summary is not None:
            cells.append(summary)
    cells.append(_closing_cell(record))
    # Not new_notebook(cells=...), which validates the whole notebook: the export validates
    # it once, when it is complete.
    nb = NotebookNode(
        nbformat=nbformat.v4.nbformat,
        nbformat_minor=nbformat.v4.nbformat_minor,
        metadata=NotebookNode(),
        cells=cells,
    )
    nb.metadata["title"] = notebook_title(record)  # nbconvert's HTML <title>
    nb.metadata["kernelspec"], nb.metadata["language_info"] = _kernel_metadata(record)
    nb.metadata["kernel_env"] = {
        "episode_id": record.episode_id,
        "kernel_name": record.kernel_name,
        "task_prompt": record.task_prompt,
        "llm_model": record.llm_model,
        "kernel_backend": record.kernel_backend,
        "expected_answer": record.expected_answer,
        "final_answer": record.final_answer,
        "reward": record.reward,
        "done": record.done,
        "max_iterations": record.max_iterations,
        "depth": record.depth,
        "llm_usage": record.llm_usage,
        "forked_from": record.forked_from,
        "forks": record.forks,
        "context_length": len(record.context),
        "context_file": context_file,
        "context": record.context if context_file is None else None,
        "versions": _versions(),
    }
    return nb


def _kernel_metadata(record: EpisodeRecord) -> tuple[dict[str, Any], dict[str, Any]]:
    """The notebook's kernelspec and language_info: the episode's kernel's."""
    if record.kernel_name == DEFAULT_KERNEL:
        spec = {"name": "python3", "display_name": "Python 3", "language": "python"}
        return spec, {"name": "python", "version": platform.python_version()}
    language = language_for(record.kernel_name)
    spec = {
        "name": record.kernel_name,
        "display_name": f"{language.language} ({record.kernel_name})",
        "language": language.language,
    }
    return spec, dict(record.language_info or {"name": language.language})


def write_notebook(record: EpisodeRecord, directory: str | os.PathLike[str], name: str) -> Path:
    """Write ``name`` (``.ipynb`` added if missing) inside ``directory``, with a context sidecar
    when the context is large; returns the notebook's path. Validates before writing."""
    if not name.endswith(".ipynb"):
        name += ".ipynb"
    path = safe_path(directory, name)
    if _uses_sidecar(record):
        safe_path(directory, _sidecar_name(path.stem)).write_text(record.context, "utf-8")
    path.write_text(notebook_text(record, path.name), encoding="utf-8")
    for step in record.steps:
        for n, child in enumerate(_children(step), 1):
            write_notebook(child, directory, child_notebook_name(path.stem, step.index, n))
    return path


def notebook_text(record: EpisodeRecord, name: str, *, validate: bool = True) -> str:
    """The validated text of the notebook :func:`write_notebook` writes as ``name`` (it refers
    to the context sidecar and child notebooks by their names beside it). ``validate=False``:
    the same notebook, not checked against the schema again (the episode store renders one
    each time a running episode's notebook is read; the check was most of that time)."""
    stem = Path(name).stem
    context_file = _sidecar_name(stem) if _uses_sidecar(record) else None
    nb = episode_to_notebook(record, context_file=context_file, stem=stem)
    if validate:
        nbformat.validate(nb)
    # nbformat.writes would validate the whole notebook a second time.
    return str(nbformat.v4.writes(nb))


def _uses_sidecar(record: EpisodeRecord) -> bool:
    return len(record.context) > INLINE_CONTEXT_CHARS


def _sidecar_name(stem: str) -> str:
    return f"{stem}.context.txt"


def notebook_name(episode_id: str) -> str:
    """A file name for an episode's notebook: its id, with anything unsafe replaced."""
    stem = _SAFE_NAME.sub("_", episode_id).strip("._")[:120]
    return f"{stem or 'episode'}.ipynb"


def named_notebook(record: EpisodeRecord) -> tuple[str, str]:
    """The episode's notebook file name (from its id) and text, as a download serves them."""
    name = notebook_name(record.episode_id)
    return name, notebook_text(record, name)


def export_zip(record: EpisodeRecord, name: str) -> bytes:
    """Everything :func:`write_notebook` writes (the notebook, its context sidecar, child
    episodes' notebooks), as the bytes of a zip archive with the files at its top level."""
    with tempfile.TemporaryDirectory(prefix="kernel-env-export-") as tmp:
        write_notebook(record, tmp, name)
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            for file in sorted(Path(tmp).iterdir()):
                archive.write(file, file.name)
        return buffer.getvalue()


def write_html(
    notebook_path: str | os.PathLike[str], target: str | os.PathLike[str] | None = None
) -> Path:
    """An HTML page of a notebook (at ``target``, default next to it with ``.html``), for
    sharing a rollout (needs the ``html`` extra: nbconvert)."""
    source = Path(notebook_path)
    body = notebook_html(nbformat.read(source, as_version=4))
    out = Path(target) if target is not None else source.with_suffix(".html")
    out.write_text(body, encoding="utf-8")
    return out


def notebook_html(nb: NotebookNode) -> str:
    """``nb`` as a standalone HTML page that shows the episode and runs nothing (nbconvert's
    lab export; its title is the notebook's ``metadata.title`` when set). Cell output is
    untrusted: only passive kinds of output are kept (text, HTML, Markdown, LaTeX, images), HTML
    and Markdown are sanitised (no script, event handler or ``javascript:`` link), the page
    loads nothing from anywhere (no require.js, MathJax or fonts) and its
    ``<meta http-equiv="Content-Security-Policy">`` (``PAGE_CSP``) allows no script at all,
    so the file is safe to open from disk. Needs the ``html`` extra."""
    try:
        from jinja2 import DictLoader
        from nbconvert import HTMLExporter
    except ImportError as exc:
        raise RuntimeError(
            "HTML export needs nbconvert: .venv/bin/pip install -e '.[html]' in the clone"
        ) from exc
    exporter = HTMLExporter(
        sanitize_html=True,  # HTML and Markdown through clean_html, JavaScript output dropped
        filters={"clean_html": _clean_html},
        extra_loaders=[DictLoader({"kernel_env_page.html.j2": _PAGE_TEMPLATE})],
        template_file="kernel_env_page.html.j2",
    )
    body, _ = exporter.from_notebook_node(_passive(nb))
    return str(body)


# The page's own policy: no script, nothing fetched; inline styles and data: images only.
PAGE_CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; "
    "form-action 'none'"
)
# nbconvert's lab page without its scripts (require.js, MathJax, Mermaid, widgets), with the
# policy first in <head>.
_PAGE_TEMPLATE = f"""{{%- extends 'index.html.j2' -%}}
{{%- block html_head_js -%}}
<meta http-equiv="Content-Security-Policy" content="{PAGE_CSP}">
{{%- endblock html_head_js -%}}
{{% block jupyter_widgets %}}{{% endblock jupyter_widgets %}}
{{%- block html_head_js_mathjax -%}}{{%- endblock html_head_js_mathjax -%}}
{{%- block html_head_js_mermaidjs -%}}{{%- endblock html_head_js_mermaidjs -%}}
"""
# Output kinds the page shows; the rest (JavaScript, widgets, Mermaid, ...) are left out.
_PASSIVE_MIMES = frozenset(
    {"text/plain", "text/html", "text/markdown", "text/latex"}
    | {"image/png", "image/jpeg", "image/svg+xml"}
)


def _passive(nb: NotebookNode) -> NotebookNode:
    """A copy of ``nb`` with only passive outputs (an output with none left is dropped), image
    sizes only as numbers (nbconvert writes them unquoted into ``<img>``), no widget state."""
    nb = copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if "outputs" in cell:
            cell.outputs = [out for out in map(_passive_output, cell.outputs) if out is not None]
    return nb


def _passive_output(output: NotebookNode) -> NotebookNode | None:
    if "data" not in output:  # a stream or an error: text, escaped by the template
        return output
    output.data = NotebookNode({k: v for k, v in output.data.items() if k in _PASSIVE_MIMES})
    meta = output.get("metadata", {})
    output.metadata = NotebookNode({k: _image_size(v) for k, v in meta.items() if k in output.data})
    return output if output.data else None


def _image_size(meta: Any) -> NotebookNode:
    sizes = meta.items() if isinstance(meta, dict) else ()
    return NotebookNode({k: v for k, v in sizes if k in ("width", "height") and type(v) is int})


# What HTML from a cell (or Markdown rendered to HTML) may keep: structure, tables, text
# formatting and embedded images; no script, style sheet, frame, form or event handler.
_TAGS = frozenset(
    {"div", "p", "pre", "blockquote", "hr", "br", "details", "summary", "ul", "ol", "li"}
    | {"dl", "dt", "dd", "h1", "h2", "h3", "h4", "h5", "h6", "table", "caption", "colgroup"}
    | {"col", "thead", "tbody", "tfoot", "tr", "th", "td", "a", "abbr", "b", "code", "del"}
    | {"em", "i", "img", "ins", "kbd", "q", "s", "samp", "small", "span", "strong", "sub"}
    | {"sup", "u", "var"}
)
_ATTRIBUTES = {
    "*": {"class", "id", "title", "style", "align"},
    "img": {"alt", "width", "height"},
    "td": {"colspan", "rowspan"},
    "th": {"colspan", "rowspan", "scope"},
    "col": {"span"},
    "colgroup": {"span"},
    "ol": {"start"},
}
# A script or style element's text would show once its tags are stripped: drop it whole.
# (Cosmetic: bleach below is what keeps scripts out.)
_SCRIPT_OR_STYLE = re.compile(r"<(script|style)\b.*?</\1\s*>", re.IGNORECASE | re.DOTALL)


def _allowed_attribute(tag: str, name: str, value: str) -> bool:
    if name == "src":  # images embedded in the page only: it fetches nothing
        return tag == "img" and value.startswith("data:image/")
    if name == "href":  # links a reader may follow; bleach checks the scheme again
        return tag == "a" and value.startswith(("https://", "http://", "mailto:", "#"))
    return name in _ATTRIBUTES["*"] or name in _ATTRIBUTES.get(tag, ())


def _clean_html(html: str | bytes) -> str:
    """nbconvert's ``clean_html`` filter, with tables and text formatting kept."""
    import bleach
    from bleach.css_sanitizer import CSSSanitizer

    text = html.decode() if isinstance(html, bytes) else str(html)
    return bleach.clean(
        _SCRIPT_OR_STYLE.sub("", text),
        tags=_TAGS,
        attributes=_allowed_attribute,
        protocols={"http", "https", "mailto", "data"},  # data: only where _allowed_attribute lets
        strip=True,
        css_sanitizer=CSSSanitizer(),
    )


# -- comparing a re-run with the record ------------------------------------------------------

_VOLATILE = re.compile(r"0x[0-9a-fA-F]+|\d+\.\d+ ?(?:s|ms|µs|sec|seconds)\b")


def normalize_outputs(outputs: list[dict[str, Any]]) -> list[Any]:
    """What must match between two runs: output types, stream text, plain-text data, which rich
    mime types exist, error names and values. Object addresses and timings are masked."""
    norm: list[Any] = []
    for out in outputs:
        kind = out.get("output_type")
        if kind == "stream":
            text = "".join(out.get("text", ""))
            if norm and norm[-1][0] == "stream" and norm[-1][1] == out.get("name"):
                norm[-1] = ("stream", out.get("name"), norm[-1][2] + _mask(text))
            else:
                norm.append(("stream", out.get("name"), _mask(text)))
        elif kind in ("display_data", "execute_result"):
            data = out.get("data", {})
            plain = data.get("text/plain", "")
            plain = "".join(plain) if isinstance(plain, list) else plain
            norm.append(("data", _mask(plain), sorted(data)))
        elif kind == "error":
            norm.append(("error", out.get("ename"), _mask(str(out.get("evalue")))))
    return norm


def _mask(text: str) -> str:
    return _VOLATILE.sub("<~>", text)


def cells_match(recorded: list[dict[str, Any]], actual: list[dict[str, Any]]) -> bool:
    """Whether a re-run cell produced the recorded outputs (timing-dependent values aside)."""
    return normalize_outputs(recorded) == normalize_outputs(actual)


def recorded_steps(nb: NotebookNode) -> list[NotebookNode]:
    """The code cells of a notebook that are episode steps (not the setup cell)."""
    return [
        cell
        for cell in nb.cells
        if cell.cell_type == "code" and SETUP_TAG not in cell.metadata.get("tags", [])
    ]
